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
from groupflow.models.causal_lm import hf_model

__all__ = [
    "NonFiniteGuard",
    "NonFiniteLossError",
    "ModelSpec",
    "lr_lambda",
    "optimizer_and_schedule",
    "loss_options",
    "optimizer_state_by_name",
    "worker_device",
    "decoder_layers",
]


class NonFiniteLossError(RuntimeError):
    """Too many consecutive updates produced NaN/inf losses or gradients."""


class NonFiniteGuard:
    """Counts optimizer steps skipped for a non-finite loss or gradient norm; ``limit`` in a row
    is a NonFiniteLossError (a diverged run stops, naming ``advice``). Its two counters are part
    of a worker's training state (``state`` / ``load``), so a resumed run counts on."""

    def __init__(self, limit: int, what: str, advice: str):
        self.limit, self.what, self.advice = limit, what, advice
        self.in_a_row = self.total = 0

    def passed(self, *values: float) -> bool:
        """True when every value is finite (the step may go ahead); else count the skip."""
        if all(math.isfinite(v) for v in values):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row >= self.limit:
            raise NonFiniteLossError(
                f"{self.in_a_row} consecutive {self.what} had a non-finite loss or gradient norm; "
                f"{self.advice}"
            )
        return False

    def step(self, optimizer: torch.optim.Optimizer, *values: float) -> float:
        """``optimizer.step()`` when every value is finite, else drop the gradients and count the
        skip; the ``nonfinite_skipped`` metric of the step (1.0 skipped, 0.0 applied)."""
        if self.passed(*values):
            optimizer.step()
            return 0.0
        optimizer.zero_grad(set_to_none=True)
        return 1.0

    def state(self) -> list[int]:
        return [self.in_a_row, self.total]

    def load(self, state: Sequence[int]) -> None:
        self.in_a_row, self.total = (int(v) for v in state)


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


def optimizer_and_schedule(module: nn.Module, cfg, total_steps: int, warmup_steps: int):
    """AdamW over ``module``'s trainable parameters and its LR schedule (``lr_lambda``): what the
    actor, critic and diffusion workers train with; ``cfg`` is their section (lr, betas,
    weight_decay, lr_schedule, min_lr_ratio)."""
    optimizer = torch.optim.AdamW(
        [p for p in module.parameters() if p.requires_grad],
        lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
    )  # fmt: skip
    factor = lr_lambda(cfg.lr_schedule, warmup_steps, total_steps, cfg.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


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
    decoder = hf_model(model).get_decoder()
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None)
    if layers is None:
        raise ValueError(f"cannot find the transformer layers of {type(model).__name__} to shard")
    return list(layers)
