"""What generates and what carries weights to it: the rollout engine's options (``rollout.engine``)
and the weight transport (``rollout.weight_transport``).

Design decision: the engine is chosen here as plain picklable options that each generating worker
turns into an engine in its own process, and an unavailable engine (vLLM not installed) fails at
start-up, naming the install command, before any data or model is loaded.
"""

from __future__ import annotations

from pathlib import Path

from groupflow.assembly.tokenizers import is_vlm_config
from groupflow.config import Config, present
from groupflow.config.root import collective_refusal
from groupflow.distributed.collective import CollectiveTransport
from groupflow.distributed.transport import DriverTransport, FileTransport, RayObjectTransport
from groupflow.rollout.engines.base import HF
from groupflow.rollout.engines.vllm_engine import VLLMOptions, require_vllm

__all__ = ["build_rollout_engine", "build_weight_transport"]


def build_rollout_engine(cfg: Config):
    """Plain, picklable options of the rollout engine (``groupflow.rollout.engines.base``) the workers
    that generate build in their own processes: ``HFOptions`` or ``VLLMOptions``.

    Called at start-up: ``rollout.engine=vllm`` without vLLM installed fails here, naming the
    install command, before any data or model is loaded.
    """
    if cfg.rollout.engine == "hf":
        return HF
    require_vllm()
    v = cfg.rollout.vllm
    # a vision-language model: vLLM's multimodal processor reads the directory's processor files
    processor_path = None
    if is_vlm_config(cfg):
        processor_path = str(
            Path(present(present(cfg.model, "model").path, "model.path")).expanduser()
        )
    # rollout.vllm's keys are the engine's own options, passed through whole
    return VLLMOptions(
        **v.model_dump(),
        seed=cfg.run.seed,
        processor_path=processor_path,
        in_flight=cfg.rollout.async_mode == "in_flight",
    )


def build_weight_transport(cfg: Config, run_dir: Path, kind: str | None = None):
    """The configured weight transport (``groupflow.distributed.transport``); ``auto``: on
    run.backend=ray the collective one where it applies (a rollout pool fed synchronously: each
    actor rank broadcasts its shard), else Ray's object store (nothing passes the driver either
    way); in-process tensors otherwise. ``kind``: instead of ``rollout.weight_transport``."""
    r = cfg.rollout
    kind = kind or r.weight_transport
    if kind == "auto" and cfg.run.backend == "ray":
        kind = "ray" if collective_refusal(cfg) else "collective"
    bucket = max(1, int(r.weight_bucket_mb * (1 << 20)))
    timeout = cfg.run.worker_timeout_s
    if kind == "collective":
        return CollectiveTransport(bucket_bytes=bucket, timeout_s=timeout)
    if kind == "ray":
        return RayObjectTransport(bucket_bytes=bucket, timeout_s=timeout)
    if kind == "filesystem":
        root = Path(r.weight_dir).expanduser() if r.weight_dir else Path(run_dir) / "weights"
        return FileTransport(str(root), bucket_bytes=bucket, timeout_s=timeout)
    return DriverTransport()
