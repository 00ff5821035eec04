"""The GPU check: what groupflow does on one CUDA GPU, in one command of at most 8 minutes.

A GPU machine is lent only now and then, for minutes, with no network (no weights, no pip index),
so this check is prepared on CPU and proven there by ``--dry-run`` (the same code on tiny shapes,
run by the test suite). ``scripts/gpu_check.sh`` installs the carried wheels and runs it.

Design decisions:

- Parts, not one script: each part (see ``PARTS``) runs in its own ``try``; a failure is recorded
  with its traceback and the next part still runs. The JSON file is rewritten after every part,
  so a run cut off by the machine's time limit still leaves what it measured. Parts run in order
  of importance, and a part whose estimate no longer fits the time budget is skipped, saying so.
- Real shapes, random weights: a Qwen2.5-0.5B-shaped causal LM (its config's sizes, vocabulary
  included) and diffusion transformers shaped as Wan2.1-1.3B, SD3-medium, FLUX.1-dev, Qwen-Image,
  Z-Image-Turbo and FLUX.2-dev (their block widths, with few blocks), built here and saved as Hugging Face / diffusers directories, then loaded through
  groupflow's own loading path. The tokenizer is groupflow's character tokenizer padded to the
  model's full vocabulary (one character per id), so every sampled id decodes to text.
- A random policy gets no reward from a task's answer check, and groupflow leaves zero-advantage
  samples out of its update, which would make its step look cheap. The LM parts therefore use
  ``text_hash_reward``, a fixed function of the completion's text that differs between samples,
  so every sample has an advantage and both frameworks do the full update.
- TRL side by side reuses ``bench_trl.py`` (its TRL configuration, callback and timers): TRL's
  ``train()`` loop runs, and after each TRL step a callback runs one groupflow step, so the two
  alternate in one process on the same GPU; the first step of each is a discarded warm-up. GPU
  work is synchronised before every clock read. Peak memory per step is
  ``torch.cuda.max_memory_allocated`` over that step less what was allocated before it (both
  frameworks' weights and optimizer states stay resident throughout, so only the step's own
  memory is comparable).
- The diffusion trainer's bf16 mode is FSDP2 mixed precision, which needs two ranks (one GPU holds
  one NCCL rank), so the diffusion part runs groupflow's GRPO step in fp32 weights on one GPU and,
  separately, one denoising step's forward and backward through the same flow model under bf16
  autocast.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_trl (TRL's side of the comparison)
sys.path.insert(0, str(ROOT))  # groupflow from this tree, also when not installed

import torch  # noqa: E402

# Parts in the order they run: the bounded, most wanted ones first; the demo (its 160 steps are the
# least predictable in time) last.
PARTS = (
    "environment",
    "lm_groupflow",
    "lm_vs_trl",
    "weight_transfer",
    "diffusion",
    "gpu_tests",
    "demo",
)
OPTIONAL_PACKAGES = (
    "pydantic",
    "pydantic_core",
    "yaml",
    "safetensors",
    "pyarrow",
    "transformers",
    "tokenizers",
    "accelerate",
    "peft",
    "diffusers",
    "datasets",
    "trl",
    "ray",
    "vllm",
    "pytest",
)
# Packages the GPU image lacks and nobody carries there (too large, or not on the checked path):
# the dry run makes them unimportable in its own process, so a core-path import of one fails here.
ABSENT_ON_GPU = ("ray", "vllm", "mlflow", "wandb", "math_verify", "gguf")
DEMO_CONFIG = ROOT / "examples" / "reverse_demo.yaml"
MIB = 2**20

# Qwen2.5-0.5B's config (hidden 896, 24 layers, 14 query / 2 key-value heads, vocabulary 151,936,
# tied embeddings: 494M parameters).
QWEN25_05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# Wan2.1-T2V-1.3B's transformer blocks (width 1536, 12 heads, FFN 8960, UMT5 text width 4096),
# 2 of its 30 blocks.
WAN_13B = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}
# SD3-medium's transformer blocks (width 1536, 24 heads; T5 4096 / pooled CLIP 2048), 2 of its 24.
SD3_MEDIUM = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "out_channels": 16,
    "pos_embed_max_size": 192,
}


# The 2026 families' transformers at their real widths (diffusers' defaults are these models'
# configs), a few blocks each; latents of a 512x512 image (their VAEs downsample 8x; FLUX.2's
# pipeline samples the 2x2-patchified latent of its 32-channel VAE).
FAMILIES = {
    "flux": {  # FLUX.1-dev: 2 of 19 dual-stream and 2 of 38 single-stream blocks
        "config": {"patch_size": 1, "in_channels": 64, "num_layers": 2, "num_single_layers": 2,
                   "attention_head_dim": 128, "num_attention_heads": 24,
                   "joint_attention_dim": 4096, "pooled_projection_dim": 768,
                   "guidance_embeds": True, "axes_dims_rope": [16, 56, 56]},
        "latent": [16, 64, 64],
    },
    "qwen_image": {  # Qwen-Image: 2 of its 60 blocks
        "config": {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 2,
                   "attention_head_dim": 128, "num_attention_heads": 24,
                   "joint_attention_dim": 3584, "axes_dims_rope": [16, 56, 56]},
        "latent": [16, 64, 64],
    },
    "z_image": {  # Z-Image-Turbo: 2 of 30 layers, 1 of 2 refiner layers per stream
        "config": {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16,
                   "dim": 3840, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 30,
                   "n_kv_heads": 30, "cap_feat_dim": 2560, "axes_dims": [32, 48, 48],
                   "axes_lens": [1024, 512, 512]},
        "latent": [16, 64, 64],
    },
    "flux2": {  # FLUX.2-dev: 1 of 8 dual-stream and 1 of 48 single-stream blocks (width 6144;
        # ≈2.3B parameters, an fp32 AdamW step within an 80 GB GPU)
        "config": {"patch_size": 1, "in_channels": 128, "num_layers": 1, "num_single_layers": 1,
                   "attention_head_dim": 128, "num_attention_heads": 48,
                   "joint_attention_dim": 15360, "timestep_guidance_channels": 256,
                   "axes_dims_rope": [32, 32, 32, 32], "guidance_embeds": True},
        "latent": [128, 32, 32],
    },
}  # fmt: skip
# The same families shrunk for the dry run (the configs tests/diffusion builds them from).
DRY_FAMILIES = {
    "flux": {
        "config": {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1,
                   "attention_head_dim": 8, "num_attention_heads": 2, "joint_attention_dim": 16,
                   "pooled_projection_dim": 8, "guidance_embeds": True,
                   "axes_dims_rope": [2, 2, 4]},
        "latent": [4, 8, 8],
    },
    "qwen_image": {
        "config": {"patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 1,
                   "attention_head_dim": 8, "num_attention_heads": 2, "joint_attention_dim": 16,
                   "axes_dims_rope": [2, 2, 4]},
        "latent": [4, 8, 8],
    },
    "z_image": {
        "config": {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 4, "dim": 16,
                   "n_layers": 1, "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2,
                   "cap_feat_dim": 16, "axes_dims": [2, 2, 4], "axes_lens": [1536, 512, 512]},
        "latent": [4, 8, 8],
    },
    "flux2": {
        "config": {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1,
                   "attention_head_dim": 8, "num_attention_heads": 2, "joint_attention_dim": 16,
                   "timestep_guidance_channels": 8, "axes_dims_rope": [2, 2, 2, 2],
                   "guidance_embeds": True},
        "latent": [16, 4, 4],
    },
}  # fmt: skip


@dataclass(frozen=True)
class Shapes:
    """What each part runs on: the GPU's real shapes, or the dry run's tiny ones."""

    lm: dict[str, Any]
    prompts_per_step: int  # B
    samples_per_prompt: int  # G
    new_tokens: int
    steps: int  # timed steps (after one warm-up)
    wan: dict[str, Any]
    wan_latent: tuple[int, ...]  # [C, F, H, W]
    sd3: dict[str, Any]
    sd3_latent: tuple[int, ...]  # [C, H, W]
    diffusion_steps: int  # denoising steps of a rollout
    families: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind -> config, latent
    demo_overrides: tuple[str, ...] = ()
    # seconds each part is expected to take here: skipped when the budget has less left
    estimates_s: dict[str, float] = field(default_factory=dict)


GPU = Shapes(
    lm=QWEN25_05B,
    prompts_per_step=8,
    samples_per_prompt=8,
    new_tokens=128,
    steps=3,
    wan=WAN_13B,
    wan_latent=(16, 5, 32, 32),
    sd3=SD3_MEDIUM,
    sd3_latent=(16, 64, 64),
    diffusion_steps=8,
    families=FAMILIES,
    estimates_s={
        "lm_groupflow": 60,
        "lm_vs_trl": 90,
        "weight_transfer": 30,
        "diffusion": 150,
        "demo": 120,
        "gpu_tests": 40,
    },
)
DRY = Shapes(
    lm={
        "vocab_size": 512,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    prompts_per_step=2,
    samples_per_prompt=2,
    new_tokens=4,
    steps=1,
    wan={
        **WAN_13B,
        "num_attention_heads": 2,
        "attention_head_dim": 8,
        "in_channels": 4,
        "out_channels": 4,
        "text_dim": 16,
        "freq_dim": 16,
        "ffn_dim": 16,
        "num_layers": 1,
        "rope_max_seq_len": 32,
    },
    wan_latent=(4, 2, 4, 4),
    sd3={
        **SD3_MEDIUM,
        "sample_size": 8,
        "in_channels": 4,
        "num_layers": 1,
        "attention_head_dim": 8,
        "num_attention_heads": 2,
        "joint_attention_dim": 16,
        "caption_projection_dim": 16,
        "pooled_projection_dim": 8,
        "out_channels": 4,
        "pos_embed_max_size": 8,
    },
    sd3_latent=(4, 8, 8),
    diffusion_steps=2,
    families=DRY_FAMILIES,
    demo_overrides=(
        "run.total_steps=2",
        "sft.steps=2",
        "sft.check_every=1",
        "data.task.num_train=200",
        "data.task.num_val=8",
        "validation.every_steps=0",
        "validation.samples_per_prompt=1",
        "data.prompts_per_step=4",
        "rollout.samples_per_prompt=2",
    ),
)


@dataclass
class Context:
    dry_run: bool
    shapes: Shapes
    device: torch.device
    work: Path  # scratch directory (models, run directories)
    deadline: float  # time.monotonic() past which no part starts
    gpu_tests: tuple[str, ...]
    install_log: Path | None
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


class CheckFailed(AssertionError):
    """A part ran but a result is wrong (it does not learn, a loss is not finite, ...)."""


# ----- helpers -----------------------------------------------------------------------------------


def text_hash_reward(prompts, completions, **kwargs) -> list[float]:
    """A fixed function of each completion's text in [0, 1): differs between samples of a random
    policy, so every group has advantages and no sample is left out of the update."""
    return [zlib.crc32(_text(c).encode("utf-8")) / 2**32 for c in completions]


def _text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):  # chat messages
        return "".join(str(m.get("content", "")) for m in completion)
    return str(completion)


def block_imports(names: tuple[str, ...]) -> list[str]:
    """Make ``names`` unimportable in this process (``import`` raises ModuleNotFoundError and
    ``importlib.util.find_spec`` says absent, as where they are not installed); returns those
    blocked (a module already imported stays)."""
    blocked = [n for n in names if n not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]
    return blocked


def sync(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()


def gpu_memory_mib() -> dict[str, float | None]:
    """Allocated and peak allocated (since the last reset) CUDA memory; None without CUDA."""
    if not torch.cuda.is_available():
        return {"allocated_mib": None, "peak_mib": None}
    return {
        "allocated_mib": torch.cuda.memory_allocated() / MIB,
        "peak_mib": torch.cuda.max_memory_allocated() / MIB,
    }


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def padded_char_tokenizer(vocab_size: int, save_dir: Path):
    """groupflow's character tokenizer with one extra character per id up to ``vocab_size``, so
    a random model's every sampled id decodes to text (code points from U+0100, no surrogates)."""
    from groupflow.data.tokenizer import DEFAULT_ALPHABET, SPECIAL_TOKENS, train_char_tokenizer

    extra = vocab_size - len(SPECIAL_TOKENS) - len(set(DEFAULT_ALPHABET))
    if extra < 0:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the character tokenizer's")
    chars, cp = [], 0x100
    while len(chars) < extra:
        if not 0xD800 <= cp <= 0xDFFF:
            chars.append(chr(cp))
        cp += 1
    tok = train_char_tokenizer(base_alphabet=DEFAULT_ALPHABET + "".join(chars))
    if len(tok) != vocab_size:
        raise RuntimeError(f"padded tokenizer has {len(tok)} ids, expected {vocab_size}")
    tok.save_pretrained(str(save_dir))
    return tok


def qwen_shaped_model_dir(ctx: Context) -> Path:
    """A Qwen2-architecture HF directory with the shapes' sizes and random bf16 weights (cached)."""
    if "lm_dir" in ctx.cache:
        return ctx.cache["lm_dir"]
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = ctx.work / "qwen2-shaped"
    tok = padded_char_tokenizer(ctx.shapes.lm["vocab_size"], path)
    config = Qwen2Config(
        **ctx.shapes.lm,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(ctx.device):  # random initialisation on the GPU: seconds, not a minute
        model = Qwen2ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(str(path))
    del model
    free_memory()
    ctx.cache["lm_dir"] = path
    return path


def lm_config(ctx: Context, name: str, model_dir: Path):
    from groupflow.config import config_from_dict

    s = ctx.shapes
    return config_from_dict(
        {
            "run": {
                "name": name,
                "output_dir": str(ctx.work / "runs"),
                "seed": 0,
                "total_steps": 10**6,
                "resume": "never",
                "loggers": [],
                "samples_every": 0,
                "num_threads": 1 if ctx.dry_run else 8,
            },
            "model": {"path": str(model_dir), "dtype": "bfloat16"},
            "data": {
                "task": {"name": "reverse", "digits": 6, "num_train": 2000, "num_val": 1},
                "prompts_per_step": s.prompts_per_step,
            },
            "rollout": {
                "samples_per_prompt": s.samples_per_prompt,
                "max_new_tokens": s.new_tokens,
                "temperature": 1.0,
            },
            "validation": {"before_training": False},
            "actor": {"lr": 1e-6, "loss_agg": "token_mean", "grad_clip": 1.0},
        }
    )


def build_lm_trainer(ctx: Context, name: str):
    import bench_trl

    from groupflow.api import reward_functions
    from groupflow.assembly.data import PythonInputs
    from groupflow.trainer import Trainer

    cfg = lm_config(ctx, name, qwen_shaped_model_dir(ctx))
    trainer = Trainer(cfg, inputs=PythonInputs(rewards=tuple(reward_functions([text_hash_reward]))))
    # No EOS id: every sample runs the full new_tokens (TRL gets min_new_tokens), so the work and
    # the token count are known.
    bench_trl.actor_worker(trainer).eos_ids = []
    return trainer


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _finite(name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CheckFailed(f"{name} is not a finite number: {value!r}")
    return float(value)


# ----- the parts ---------------------------------------------------------------------------------


def part_environment(ctx: Context) -> dict[str, Any]:
    """Versions, the GPU, and which packages import (with the reason of those that do not)."""
    packages: dict[str, str] = {}
    for name in OPTIONAL_PACKAGES:
        try:
            module = __import__(name)
            packages[name] = str(getattr(module, "__version__", "?"))
        except Exception as err:  # noqa: BLE001 — any import error is a finding, not a crash
            packages[name] = f"missing: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "packages": packages,
        "groupflow_from": str(Path(__import__("groupflow").__file__).parent),
        "install": _read_install_log(ctx.install_log),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(
            gpu=props.name,
            gpu_memory_mib=props.total_memory / MIB,
            capability=f"{props.major}.{props.minor}",
            bf16_supported=torch.cuda.is_bf16_supported(),
            nccl_available=torch.distributed.is_nccl_available(),
        )
    return out


def _read_install_log(path: Path | None) -> dict[str, Any]:
    """The shell script's record of each wheel: installed, or why not."""
    if path is None or not path.is_file():
        return {"note": "no install log (run through scripts/gpu_check.sh to install the wheels)"}
    out = {}
    for line in path.read_text().splitlines():
        name, _, status = line.partition("\t")
        if name.strip():
            out[name.strip()] = status.strip()
    return out


def part_lm_groupflow(ctx: Context) -> dict[str, Any]:
    """groupflow alone on the Qwen2.5-0.5B-shaped model: generation tokens/s, GRPO step, memory."""
    import bench_trl

    s = ctx.shapes
    free_memory()
    t0 = time.perf_counter()
    trainer = build_lm_trainer(ctx, "lm-groupflow")
    build_s = time.perf_counter() - t0
    worker = bench_trl.actor_worker(trainer)
    gen: list[float] = []
    bench_trl._timed_method(worker, "generate", gen)
    resident = gpu_memory_mib()["allocated_mib"]
    steps, peaks, last = [], [], {}
    try:
        for _ in range(s.steps + 1):
            sync(ctx)
            reset_peak()
            before = gpu_memory_mib()["allocated_mib"]
            t = time.perf_counter()
            _, last = trainer.train_step()
            sync(ctx)
            steps.append(time.perf_counter() - t)
            peak = gpu_memory_mib()["peak_mib"]
            peaks.append(None if peak is None else peak - before)
    finally:
        trainer.shutdown()
    tokens = s.prompts_per_step * s.samples_per_prompt * s.new_tokens
    skipped = float(last.get("actor/zero_adv_skipped", 0.0))
    out = {
        "params": bench_trl.param_count(worker.model),
        "dtype": str(next(worker.model.parameters()).dtype),
        "device": str(next(worker.model.parameters()).device),
        "work": {
            "prompts": s.prompts_per_step,
            "samples_per_prompt": s.samples_per_prompt,
            "new_tokens": s.new_tokens,
            "timed_steps": s.steps,
        },
        "build_s": build_s,
        "step_s": steps[1:],
        "median_step_s": _median(steps[1:]),
        "median_generate_s": _median(gen[1:]),
        "generate_tokens_per_s": tokens / _median(gen[1:]),
        "resident_mib": resident,
        "step_extra_peak_mib": max(peaks[1:]) if peaks[1:] and peaks[1] is not None else None,
        "peak_mib": torch.cuda.max_memory_allocated() / MIB if ctx.cuda else None,
        "zero_adv_skipped": skipped,
        "last_metrics": {
            k: last[k]
            for k in sorted(last)
            if k.split("/")[0] in ("actor", "reward", "time", "response")
        },
    }
    _finite("actor/grad_norm", last.get("actor/grad_norm"))
    if skipped > 0.5:
        raise CheckFailed(f"{skipped:.0%} of the samples had no advantage: the update is not full")
    return out


def part_lm_vs_trl(ctx: Context) -> dict[str, Any]:
    """The same work through TRL's GRPOTrainer and groupflow, alternating in this process."""
    try:
        import trl  # noqa: F401
    except Exception as err:  # noqa: BLE001
        return {"status": "skipped", "reason": f"TRL does not import: {type(err).__name__}: {err}"}
    import bench_trl

    s = ctx.shapes
    free_memory()
    gf = build_lm_trainer(ctx, "lm-vs-trl")
    worker = bench_trl.actor_worker(gf)
    trl_model = copy.deepcopy(worker.model)  # identical initial weights, outside groupflow's wrap
    wall: dict[str, list[float]] = {"trl": [], "groupflow": []}
    gen: dict[str, list[float]] = {"trl": [], "groupflow": []}
    peak: dict[str, list[float | None]] = {"trl": [], "groupflow": []}
    bench_trl._timed_method(worker, "generate", gen["groupflow"])
    mark: dict[str, Any] = {}

    def start() -> None:
        sync(ctx)
        reset_peak()
        mark.update(t=time.perf_counter(), mem=gpu_memory_mib()["allocated_mib"])

    def record(fw: str) -> None:
        sync(ctx)
        wall[fw].append(time.perf_counter() - mark["t"])
        p = gpu_memory_mib()["peak_mib"]
        peak[fw].append(None if p is None else p - mark["mem"])

    def after_trl_step() -> None:
        record("trl")
        start()
        bench_trl.groupflow_step(gf)
        record("groupflow")
        start()

    settings = bench_trl.Settings(
        prompts_per_step=s.prompts_per_step,
        samples_per_prompt=s.samples_per_prompt,
        new_tokens=s.new_tokens,
        steps=s.steps,
        lr=1e-6,
    )
    try:
        trainer = bench_trl.build_trl(
            trl_model,
            gf.policy.tokenizer,
            gf.workflow.train_rows,
            settings,
            ctx.work,
            max_steps=s.steps + 1,
            callbacks=[bench_trl._step_callback(after_trl_step)],
            reward_funcs=[text_hash_reward],
            use_cpu=not ctx.cuda,
            bf16=ctx.cuda,
        )
        bench_trl._timed_method(trainer, "_generate_single_turn", gen["trl"])
        start()
        trainer.train()
    finally:
        gf.shutdown()
    for fw in ("trl", "groupflow"):
        if len(wall[fw]) != s.steps + 1:
            raise RuntimeError(f"expected {s.steps + 1} {fw} steps, got {len(wall[fw])}")
    tokens = s.prompts_per_step * s.samples_per_prompt * s.new_tokens
    med = {fw: statistics.median(wall[fw][1:]) for fw in wall}
    gmed = {fw: statistics.median(gen[fw][1:]) for fw in gen}
    return {
        "trl_version": __import__("trl").__version__,
        "step_s": {fw: v[1:] for fw, v in wall.items()},
        "median_step_s": med,
        "median_generate_s": gmed,
        "generate_tokens_per_s": {fw: tokens / gmed[fw] for fw in gmed},
        "step_extra_peak_mib": {
            fw: (max(v[1:]) if v[1] is not None else None) for fw, v in peak.items()
        },
        "speedup_vs_trl": med["trl"] / med["groupflow"],
        "generate_speedup_vs_trl": gmed["trl"] / gmed["groupflow"],
    }


def _flow_dir(kind: str, config: dict[str, Any], path: Path) -> Path:
    """A diffusers directory of ``kind``'s transformer class, built from ``config`` with random
    weights (the class groupflow loads for that kind)."""
    import diffusers

    from groupflow.diffusion.models import DIFFUSERS_KINDS

    torch.manual_seed(0)
    getattr(diffusers, DIFFUSERS_KINDS[kind])(**config).save_pretrained(str(path))
    return path


def flow_models(shapes: Shapes) -> list[tuple[str, dict[str, Any], tuple[int, ...]]]:
    """(kind, transformer config, latent shape) of every diffusion model the check runs."""
    fams = [(k, f["config"], tuple(f["latent"])) for k, f in shapes.families.items()]
    return [("wan", shapes.wan, shapes.wan_latent), ("sd3", shapes.sd3, shapes.sd3_latent), *fams]


def _diffusion_trainer_step(ctx: Context, kind: str, model: Path, latent: tuple[int, ...]):
    from groupflow.config import config_from_dict
    from groupflow.trainer import Trainer

    prompts = ctx.work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a cat", "a dog")))
    cfg = config_from_dict(
        {
            "run": {
                "name": f"diffusion-{kind}",
                "output_dir": str(ctx.work / "runs"),
                "seed": 0,
                "total_steps": 10**6,
                "resume": "never",
                "loggers": [],
                "samples_every": 0,
                "num_threads": 1 if ctx.dry_run else 8,
                "save_final": False,
            },
            "diffusion": {
                "model": {"kind": kind, "path": str(model), "latent_shape": list(latent)},
                "num_steps": ctx.shapes.diffusion_steps,
                "timestep_fraction": 0.5,
                "eval_samples_per_prompt": 1,
                "save_images": False,
            },
            "data": {"train_files": [str(prompts)], "prompts_per_step": 2},
            "rollout": {"samples_per_prompt": 2},
            "validation": {"before_training": False},
            "actor": {"lr": 1e-5},
            "reward": {"functions": [{"name": "brightness"}]},
        }
    )
    trainer = Trainer(cfg)
    times, last = [], {}
    try:
        reset_peak()
        for _ in range(2):  # a warm-up step, then the timed one
            sync(ctx)
            t = time.perf_counter()
            _, last = trainer.train_step()
            sync(ctx)
            times.append(time.perf_counter() - t)
    finally:
        trainer.shutdown()
    _finite(f"{kind} actor/grad_norm", last.get("actor/grad_norm"))
    return {
        "step_s": times[-1],
        "warmup_step_s": times[0],
        "peak_mib": gpu_memory_mib()["peak_mib"],
        "grad_norm": last.get("actor/grad_norm"),
        "reward_mean": last.get("reward/mean"),
    }


def _bf16_denoising_step(ctx: Context, kind: str, model: Path, latent: tuple[int, ...]):
    """One denoising step's velocity forward and flow-matching loss backward under bf16 autocast,
    through groupflow's flow-model wrapper (what FSDP2 mixed precision computes per block)."""
    from groupflow.diffusion.models import load_diffusers_model

    flow = load_diffusers_model(model, kind, latent).to(ctx.device)
    batch = 2
    g = torch.Generator(device="cpu").manual_seed(0)
    x0 = torch.randn(batch, *latent, generator=g).to(ctx.device)
    noise = torch.randn(batch, *latent, generator=g).to(ctx.device)
    sigma = torch.full((batch,), 0.5, device=ctx.device)
    cond = {k: v.to(ctx.device) for k, v in flow.encode(["a cat", "a dog"]).items()}
    x_t = (1 - sigma.view(-1, *[1] * len(latent))) * x0 + sigma.view(-1, *[1] * len(latent)) * noise
    reset_peak()
    sync(ctx)
    t = time.perf_counter()
    with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
        v = flow(x_t, sigma, cond)
    loss = torch.nn.functional.mse_loss(v.float(), noise - x0)
    loss.backward()
    sync(ctx)
    seconds = time.perf_counter() - t
    grad = torch.sqrt(
        sum((p.grad.float() ** 2).sum() for p in flow.parameters() if p.grad is not None)
    )
    out = {
        "velocity_dtype": str(v.dtype),
        "loss": loss.item(),
        "grad_norm": grad.item(),
        "forward_backward_s": seconds,
        "peak_mib": gpu_memory_mib()["peak_mib"],
        "params": sum(p.numel() for p in flow.parameters()),
    }
    _finite(f"{kind} bf16 loss", out["loss"])
    _finite(f"{kind} bf16 grad norm", out["grad_norm"])
    return out


def part_diffusion(ctx: Context) -> dict[str, Any]:
    """Each model kind's transformer (``flow_models``): one groupflow GRPO step each, and one bf16
    denoising step."""
    out: dict[str, Any] = {}
    errors = []
    for kind, config, latent in flow_models(ctx.shapes):
        free_memory()
        try:
            model = _flow_dir(kind, config, ctx.work / kind)
            out[kind] = {
                "latent_shape": list(latent),
                "grpo_step": _diffusion_trainer_step(ctx, kind, model, latent),
                "bf16_denoising_step": _bf16_denoising_step(ctx, kind, model, latent),
            }
        except Exception as err:  # noqa: BLE001 — one model failing must not hide the other
            out[kind] = {
                "status": "failed",
                "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(),
            }
            errors.append(kind)
    if errors:
        out["status"] = "failed"
        out["error"] = f"failed: {', '.join(errors)} (see each one's traceback)"
    return out


def part_demo(ctx: Context) -> dict[str, Any]:
    """The CPU demo's config (examples/reverse_demo.yaml) on this device: held-out accuracy
    before and after training; on the GPU it must still learn."""
    from groupflow.config import load_config
    from groupflow.trainer import Trainer

    cfg = load_config(
        str(DEMO_CONFIG),
        [
            f"run.output_dir={ctx.work / 'runs'}",
            "run.name=demo",
            "run.loggers=[]",
            "run.overwrite=true",
            *ctx.shapes.demo_overrides,
        ],
    )
    t = time.perf_counter()
    trainer = Trainer(cfg)
    try:
        trainer.fit()
        device = str(next(trainer.policy.actor.local_worker().model.parameters()).device)
    finally:
        trainer.shutdown()
    seconds = time.perf_counter() - t
    rows = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in rows if "val/greedy/acc" in r]
    steps = [r for r in rows if "reward/mean" in r]
    out = {
        "steps": len(steps),
        "wall_s": seconds,
        "device": device,
        "val_greedy_acc_before": vals[0]["val/greedy/acc"] if vals else None,
        "val_greedy_acc_after": vals[-1]["val/greedy/acc"] if vals else None,
        "reward_mean_first10": _median([r["reward/mean"] for r in steps[:10]]),
        "reward_mean_last10": _median([r["reward/mean"] for r in steps[-10:]]),
    }
    if len(vals) < 2:
        raise CheckFailed(f"expected held-out accuracy before and after, got {len(vals)} values")
    out["learned"] = out["val_greedy_acc_after"] > out["val_greedy_acc_before"] + 0.3
    if not ctx.dry_run and not out["learned"]:  # the CPU demo goes from ~17 % to ~100 %
        raise CheckFailed(
            f"the demo did not learn on {ctx.device}: held-out greedy accuracy "
            f"{out['val_greedy_acc_before']:.2f} -> {out['val_greedy_acc_after']:.2f}"
        )
    return out


def part_weight_transfer(ctx: Context) -> dict[str, Any]:
    """Issue 21 item 9: one weight sync of the Qwen-shaped model through each one-host transport
    (``driver``: in-process, the local backend's default; ``filesystem``: safetensors buckets,
    what a cluster without a shared collective uses) into a second copy on the GPU, the way a
    rollout worker receives: bucket by bucket into its own tensors. Reports bytes, seconds
    (median of 3), GB/s and the peak extra GPU memory over the two copies; checks every tensor
    arrived equal."""
    from transformers import AutoModelForCausalLM

    from groupflow.distributed.transport import DriverTransport, FileTransport, receive_into

    path = qwen_shaped_model_dir(ctx)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    sender = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=dtype).to(ctx.device)
    receiver = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=dtype).to(ctx.device)
    with torch.no_grad():
        for p in receiver.parameters():
            p.zero_()
    weights = {k: v.detach() for k, v in sender.state_dict().items()}
    dest = receiver.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    out: dict[str, Any] = {"status": "ok", "bytes": nbytes, "transports": {}}
    transports = [
        DriverTransport(),
        FileTransport(str(ctx.work / "weights"), bucket_bytes=(64 << 20) if ctx.cuda else 1 << 16),
    ]
    for version, transport in enumerate(transports):
        times = []
        reset_peak()
        base = gpu_memory_mib()["allocated_mib"]
        for repeat in range(3):
            sync(ctx)
            start = time.perf_counter()
            ticket = transport.send(version * 3 + repeat, weights)
            receive_into(transport, ticket, dest)
            sync(ctx)
            times.append(time.perf_counter() - start)
        peak = gpu_memory_mib()["peak_mib"]
        bad = [k for k, v in weights.items() if not torch.equal(v, dest[k])]
        if bad:
            raise CheckFailed(
                f"{transport.name}: {len(bad)} tensors differ after the sync: {bad[:3]}"
            )
        seconds = _median(times)
        out["transports"][transport.name] = {
            "seconds": seconds,
            "gb_per_s": nbytes / seconds / 1e9 if seconds else None,
            "peak_extra_mib": (peak - base) if peak is not None and base is not None else None,
        }
        with torch.no_grad():
            for p in receiver.parameters():
                p.zero_()
    del sender, receiver, weights, dest
    free_memory()
    return out


def gpu_test_files() -> list[str]:
    """The test files that mark a test ``gpu``: collecting only these is seconds, and a module
    elsewhere that needs a package this machine lacks cannot break the run."""
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if "pytest.mark.gpu" in p.read_text(encoding="utf-8")
    )


def part_gpu_tests(ctx: Context) -> dict[str, Any]:
    """The suite's tests marked ``gpu`` (pytest -m gpu), in a subprocess."""
    files = list(ctx.gpu_tests) or gpu_test_files()
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        "-p",
        "no:cacheprovider",
        "-rs",
        "--continue-on-collection-errors",
        *files,
    ]
    t = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    text = done.stdout + done.stderr
    counts = {
        k: int(n)
        for n, k in re.findall(
            r"(\d+) (passed|failed|skipped|errors?|deselected)",
            text.splitlines()[-1] if text.strip() else "",
        )
    }
    out = {
        "files": files,
        "returncode": done.returncode,
        "counts": counts,
        "seconds": time.perf_counter() - t,
        "output_tail": text[-4000:],
    }
    # 0: passed; 5: no test selected (none collected). Anything else is a failure.
    if done.returncode not in (0, 5):
        raise CheckFailed(f"pytest -m gpu exited {done.returncode}: {counts}")
    if not ctx.dry_run and counts.get("skipped"):
        out["note"] = "GPU tests skipped on a GPU machine: see output_tail for the reasons"
    return out


PART_FUNCTIONS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "environment": part_environment,
    "lm_groupflow": part_lm_groupflow,
    "lm_vs_trl": part_lm_vs_trl,
    "diffusion": part_diffusion,
    "demo": part_demo,
    "weight_transfer": part_weight_transfer,
    "gpu_tests": part_gpu_tests,
}


# ----- running and reporting ---------------------------------------------------------------------


def run_part(name: str, ctx: Context) -> dict[str, Any]:
    """One part in its own try: ok, check_failed, failed (with traceback) or skipped."""
    left = ctx.deadline - time.monotonic()
    need = ctx.shapes.estimates_s.get(name, 0.0)
    if left < need:
        return {
            "status": "skipped",
            "reason": f"time budget: {left:.0f} s left, ~{need:.0f} s needed",
        }
    t = time.perf_counter()
    try:
        result = PART_FUNCTIONS[name](ctx)
        result.setdefault("status", "ok")
    except CheckFailed as err:
        result = {"status": "check_failed", "error": str(err), "traceback": traceback.format_exc()}
    except Exception as err:  # noqa: BLE001 — recorded, and the next part still runs
        result = {
            "status": "failed",
            "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc(),
        }
    result["seconds"] = time.perf_counter() - t
    free_memory()
    return result


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def format_report(report: dict[str, Any]) -> str:
    """The short text report: one or a few lines per part."""
    parts, env = report["parts"], report["parts"].get("environment", {})
    lines = [
        f"groupflow GPU check ({'DRY RUN, CPU, tiny shapes' if report['dry_run'] else 'GPU'}): "
        f"{env.get('gpu', report['device'])}, torch {env.get('torch')}, "
        f"{report['total_s']:.0f} s in all",
    ]
    if report.get("error"):
        lines.append(f"  ERROR: {report['error']}; only the environment was recorded")
    missing = [k for k, v in env.get("packages", {}).items() if str(v).startswith("missing")]
    if missing:
        lines.append(f"  not importable: {', '.join(missing)}")
    failed_installs = [k for k, v in env.get("install", {}).items() if v.startswith("FAILED")]
    if failed_installs:
        lines.append(f"  wheels that did not install: {', '.join(failed_installs)}")
    for name in PARTS:
        r = parts.get(name)
        if r is None:
            continue
        head = f"[{name}] {r['status']} ({r.get('seconds', 0):.1f} s)"
        if r["status"] != "ok":
            lines.append(f"{head}: {r.get('error') or r.get('reason', '')}".rstrip())
            if r["status"] != "failed" or name != "diffusion":
                continue
        else:
            lines.append(head)
        if name == "lm_groupflow":
            lines.append(
                f"  {r['params'] / 1e6:.0f}M params {r['dtype']} on {r['device']}: generation "
                f"{_fmt(r['generate_tokens_per_s'], '.0f')} tokens/s, GRPO step "
                f"{_fmt(r['median_step_s'])} s, peak {_fmt(r['peak_mib'], '.0f')} MiB "
                f"(step adds {_fmt(r['step_extra_peak_mib'], '.0f')} MiB)"
            )
        elif name == "lm_vs_trl":
            st, tps, mem = r["median_step_s"], r["generate_tokens_per_s"], r["step_extra_peak_mib"]
            lines.append(
                f"  step s: TRL {st['trl']:.2f}, groupflow {st['groupflow']:.2f} -> "
                f"{r['speedup_vs_trl']:.2f}x TRL; generation tokens/s: TRL {tps['trl']:.0f}, "
                f"groupflow {tps['groupflow']:.0f} ({r['generate_speedup_vs_trl']:.2f}x); step "
                f"adds MiB: TRL {_fmt(mem['trl'], '.0f')}, groupflow {_fmt(mem['groupflow'], '.0f')}"
                f" (TRL {r['trl_version']})"
            )
        elif name == "diffusion":
            for kind, k in r.items():  # each model kind's result, in the order they ran
                if not isinstance(k, dict):
                    continue
                if "grpo_step" in k:
                    g, b = k["grpo_step"], k["bf16_denoising_step"]
                    lines.append(
                        f"  {kind} {b['params'] / 1e6:.0f}M params, latent {k['latent_shape']}: GRPO "
                        f"step {g['step_s']:.2f} s (peak {_fmt(g['peak_mib'], '.0f')} MiB); bf16 "
                        f"denoising fwd+bwd {b['forward_backward_s']:.3f} s, loss {b['loss']:.3f}"
                    )
                elif k:
                    lines.append(f"  {kind}: {k.get('error')}")
        elif name == "demo":
            lines.append(
                f"  held-out greedy accuracy {_fmt(r['val_greedy_acc_before'])} -> "
                f"{_fmt(r['val_greedy_acc_after'])} in {r['steps']} steps ({r['wall_s']:.0f} s, "
                f"{r['device']})"
            )
        elif name == "weight_transfer":
            for transport, t in r["transports"].items():
                lines.append(
                    f"  {transport}: {r['bytes'] / 2**20:.0f} MiB in {t['seconds']:.3f} s "
                    f"({_fmt(t['gb_per_s'])} GB/s), peak extra {_fmt(t['peak_extra_mib'], '.0f')} MiB"
                )
        elif name == "gpu_tests":
            lines.append(f"  pytest -m gpu: {r['counts']} (exit {r['returncode']})")
    return "\n".join(lines)


def write_outputs(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "gpu_check.txt").write_text(format_report(report) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (the test suite's run)")
    p.add_argument("--out", type=Path, help="output folder (default: $OUT, else runs/gpu_check)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--budget-s", type=float, default=450.0, help="no part starts after this")
    p.add_argument(
        "--gpu-tests",
        nargs="+",
        default=[],
        help="paths for pytest -m gpu (default: every test file that marks one gpu)",
    )
    p.add_argument("--install-log", type=Path, help="scripts/gpu_check.sh's record of the wheels")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    start = time.monotonic()
    warnings.filterwarnings("ignore", category=FutureWarning)
    out = a.out or Path(os.environ.get("OUT") or ROOT / "runs" / "gpu_check")
    no_gpu = not a.dry_run and not torch.cuda.is_available()
    if no_gpu:  # record what this machine has (why no CUDA?), then stop
        print("gpu_check: no CUDA device here (use --dry-run on a CPU)", file=sys.stderr)
        a.parts = ["environment"]
    device = torch.device("cuda", 0) if not (a.dry_run or no_gpu) else torch.device("cpu")
    blocked: list[str] = []
    if a.dry_run:
        # the dry run is CPU-only even where a GPU exists: groupflow's workers pick CUDA if they see it
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        blocked = block_imports(ABSENT_ON_GPU)
    report: dict[str, Any] = {
        "dry_run": a.dry_run,
        "device": str(device),
        "parts": {},
        "error": "no CUDA device" if no_gpu else None,
        "blocked_imports": blocked,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "total_s": 0.0,
    }
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        ctx = Context(
            dry_run=a.dry_run,
            shapes=DRY if a.dry_run else GPU,
            device=device,
            work=Path(tmp),
            deadline=start + a.budget_s,
            gpu_tests=tuple(a.gpu_tests),
            install_log=a.install_log,
        )
        report["shapes"] = asdict(ctx.shapes)
        for name in a.parts:
            print(f"gpu_check: {name} ...", flush=True)
            report["parts"][name] = result = run_part(name, ctx)
            report["total_s"] = time.monotonic() - start
            write_outputs(report, out)  # after every part: a cut-off run keeps what it measured
            print(f"gpu_check: {name} {result['status']} in {result['seconds']:.1f} s", flush=True)
            if result["status"] in ("failed", "check_failed") and "traceback" in result:
                print(result["traceback"], file=sys.stderr, flush=True)
    print("\n" + format_report(report))
    print(f"\ngpu_check: wrote {out / 'gpu_check.json'} and {out / 'gpu_check.txt'}")
    if no_gpu:
        return 2
    bad = [n for n, r in report["parts"].items() if r["status"] in ("failed", "check_failed")]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
