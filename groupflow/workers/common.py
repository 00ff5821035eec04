"""What every worker (actor, critic, inference, diffusion) needs: how to build its model in its own
process, which device it lives on, how its LR schedule goes, and the guard against a diverged run.

Design decision: one small leaf module under the workers, so that no worker imports another
(the critic and the diffusion worker used to import the actor's module for these helpers).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from groupflow.algorithms import POLICY_LOSSES
from groupflow.algorithms.registry import option_names
from groupflow.assembly.models import build_model
from groupflow.config import ActorConfig
from groupflow.config.loss_keys import LOSS_TYPED_OPTIONS

__all__ = [
    "NonFiniteLossError",
    "ModelSpec",
    "lr_lambda",
    "loss_options",
    "optimizer_state_by_name",
    "worker_device",
    "decoder_layers",
]


class NonFiniteLossError(RuntimeError):
    """Too many consecutive updates produced NaN/inf losses or gradients."""


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """Multiplier of the base LR at a given (0-based) step: linear warm-up, then constant or cosine."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def loss_options(cfg: ActorConfig) -> dict:
    """The typed PPO options the chosen loss declares, plus its free-form extras (``loss_options``)."""
    accepted = option_names(POLICY_LOSSES.get(cfg.loss_fn))
    chosen = {k: getattr(cfg, k) for k in LOSS_TYPED_OPTIONS if accepted is None or k in accepted}
    return {**chosen, **cfg.loss_options}


class ModelSpec:
    """How a worker builds its model and tokenizer inside its own process (picklable for Ray).

    ``tokenizer_files`` (name → bytes): a tokenizer the run trained itself travels with the spec,
    because its directory is in the driver's run directory, which a worker on another node need
    not see; a model's own tokenizer (``model.path``) is read where the model is."""

    def __init__(self, model_cfg, tokenizer_dir: str, seed: int,
                 tokenizer_files: dict[str, bytes] | None = None):  # fmt: skip
        self.model_cfg, self.tokenizer_dir, self.seed = model_cfg, tokenizer_dir, seed
        self.tokenizer_files = tokenizer_files
        self._local: str | None = None

    @classmethod
    def carrying(cls, model_cfg, tokenizer_dir: str, seed: int) -> ModelSpec:
        """A spec that carries the (small) files of ``tokenizer_dir`` with it."""
        files = {
            p.name: p.read_bytes() for p in sorted(Path(tokenizer_dir).iterdir()) if p.is_file()
        }
        return cls(model_cfg, tokenizer_dir, seed, files)

    def tokenizer_path(self) -> str:
        """A directory on this node holding the tokenizer (the carried files, written once)."""
        if self.tokenizer_files is None:
            return self.tokenizer_dir
        if self._local is None:
            import tempfile

            local = Path(tempfile.mkdtemp(prefix="groupflow-tokenizer-"))
            for name, data in self.tokenizer_files.items():
                (local / name).write_bytes(data)
            self._local = str(local)
        return self._local

    def __getstate__(self):
        return {**self.__dict__, "_local": None}  # a temp directory is this process's own

    def build(self):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(
            self.tokenizer_path(),
            local_files_only=True,
            trust_remote_code=self.model_cfg.trust_remote_code,
        )
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return build_model(self.model_cfg, tok, self.seed), tok


def optimizer_state_by_name(osd: dict, names: Sequence[str]) -> dict:
    """A ``torch.optim`` state dict keyed by parameter index, re-keyed by parameter name (the form
    ``torch.distributed.checkpoint.state_dict`` shards from); indices follow ``names``' order."""
    count = sum(len(g["params"]) for g in osd["param_groups"])
    if count != len(names):
        raise ValueError(
            f"the checkpoint's optimizer holds {count} parameters but the model has {len(names)}; "
            "was it written for a different model?"
        )
    return {
        "state": {names[i]: v for i, v in osd["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]
        ],
    }


def worker_device(rank: int) -> torch.device:
    """This worker's GPU (by local rank) when CUDA is available, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def decoder_layers(model: nn.Module):
    """The transformer blocks of an HF causal LM (FSDP2 shards each as a unit)."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None)
    if layers is None:
        raise ValueError(f"cannot find the transformer layers of {type(model).__name__} to shard")
    return list(layers)
