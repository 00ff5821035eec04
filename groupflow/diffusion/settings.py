"""The diffusion policy's plain settings and the per-sample helpers its worker uses.

Design decision: what needs no model — the settings dataclass with its checks, which steps a
sample trains, the per-sample random streams, the prompt rows ``generate`` takes, and the small
Batch/metrics helpers — lives apart from the worker, which keeps only model calls and updates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from groupflow.batch import Batch
from groupflow.diffusion.samplers import get_sampler

__all__ = [
    "COND_PREFIX",
    "DiffusionSettings",
    "select_steps",
    "training_steps",
    "initial_noise",
    "stream_seed",
    "seeded_generator",
    "renoise_noise",
    "prompt_rows",
    "cpu_state",
    "cond_of",
    "index_cond",
    "combine_metrics",
]

COND_PREFIX = "cond."  # condition tensors travel in the Batch as cond.<name> [B, ...]


OBJECTIVES = ("grpo", "nft", "flow_dppo", "awm")


@dataclass(frozen=True)
class DiffusionSettings:
    """Plain sampling/training knobs of the diffusion policy (built from the config by the builder)."""

    sampler: str = "flow_sde"
    noise_level: float | None = None  # None: the sampler's default (flow 0.7, dance 0.3)
    num_steps: int = 10
    shift: float = 3.0
    cfg_scale: float = 1.0
    same_noise_per_group: bool = True
    timestep_selection: str = "random"  # "random" (fraction per sample) or "window"
    timestep_fraction: float = 0.5
    window: tuple[int, int] | None = None
    lora: dict | None = field(default=None)  # {rank, alpha, target_modules}
    sde_window: dict | None = None  # MixGRPO {size, shift_interval, stride, roll_back}
    ratio_norm: bool = False  # GRPO-Guard
    objective: str = "grpo"  # or "nft" (DiffusionNFT), "flow_dppo", "awm"
    # {beta, old_decay_rate, old_decay_max, adaptive_weight_min}
    nft: dict = field(default_factory=dict)
    flow_dppo: dict = field(default_factory=dict)  # {kl_mask_threshold}
    awm: dict = field(default_factory=dict)  # {weighting}
    distill: dict | None = None  # on-policy distillation {coef, reward_weight}; None: no teacher
    adv_clip_max: float = 5.0  # DiffusionNFT maps advantages to [0, 1] through it
    fsdp: bool = False  # shard the model over the ranks (FSDP2) instead of replicating it
    activation_checkpointing: bool = False  # recompute block activations in backward
    bf16: bool = False  # with fsdp: bf16 params/compute, fp32 reduce and master weights
    cpu_offload: bool = False  # with fsdp: parameter shards, gradients, AdamW state in CPU memory

    def __post_init__(self):
        spec = get_sampler(self.sampler)  # unknown names raise, listing the valid ones
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.objective == "grpo" and not spec.stochastic:
            raise ValueError(
                f"sampler '{self.sampler}' is deterministic and has no step log-probs; train with "
                "'flow_sde' or 'dance_sde' (the ODE sampler is for evaluation)"
            )
        if self.timestep_selection not in ("random", "window"):
            raise ValueError(
                f"timestep_selection must be 'random' or 'window', got {self.timestep_selection!r}"
            )
        if self.window is not None and not 0 <= self.window[0] < self.window[1] <= self.num_steps:
            raise ValueError(
                f"window {list(self.window)} must satisfy 0 <= start < end <= num_steps={self.num_steps}"
            )


def select_steps(num_steps: int, settings: DiffusionSettings, generator: torch.Generator) -> Tensor:
    """The [num_steps] 0/1 mask of steps one sample trains on."""
    mask = torch.zeros(num_steps, dtype=torch.long)
    if settings.timestep_selection == "window":
        start, end = settings.window or (0, num_steps)
        mask[start:end] = 1
        return mask
    k = max(1, round(settings.timestep_fraction * num_steps))
    mask[torch.randperm(num_steps, generator=generator)[:k]] = 1
    return mask


def training_steps(
    settings: DiffusionSettings, seeds: Sequence[int], sde_steps: Tensor | None, trainable: Tensor
) -> Tensor:
    """The [B, num_steps] 0/1 mask of the steps each sample (by rollout seed) trains on: MixGRPO's
    whole SDE window (``sde_steps``), else :func:`select_steps` drawn from the seed's stream 2;
    only ``trainable`` steps (those with exploration noise). A sample left with none is an error:
    its rollout would cost a sampling pass and train nothing."""
    if sde_steps is not None:
        mask = sde_steps.long().expand(len(seeds), -1).clone()
    else:
        gens = [seeded_generator(s, 2) for s in seeds]
        mask = torch.stack([select_steps(settings.num_steps, settings, g) for g in gens])
    mask = mask * trainable.long()
    if not bool(mask.any(1).all()):
        raise ValueError(
            "diffusion: a sample has no trainable step (CPS's last step is deterministic); "
            "choose diffusion.window / sde_window / timestep_fraction to include earlier steps"
        )
    return mask


def initial_noise(seeds: Sequence[int], shape: Sequence[int]) -> Tensor:
    """[B, *shape] initial latents, each from its seed's stream 0 (any rank draws the same)."""
    return torch.stack([torch.randn(tuple(shape), generator=seeded_generator(s, 0)) for s in seeds])


def stream_seed(seed: int, stream: int) -> int:
    """A seed for one of a sample's random streams (0: initial noise, 1: SDE noise, 2: step
    choice; from 3: the training noise of DiffusionNFT / AWM, ``renoise_noise``). Mixed, not
    ``seed + stream``: the trainer's per-sample seeds are consecutive integers, so offsets would
    make one sample's SDE noise another group's initial noise."""
    return (seed * 6364136223846793005 + (stream + 1) * 1442695040888963407) % (2**63 - 1)


def seeded_generator(seed: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(stream_seed(int(seed), stream))


def renoise_noise(
    seeds: Tensor, shape: Sequence[int], epoch: int, step: int, num_steps: int
) -> Tensor:
    """[b, *shape] standard normal noise re-noising b samples' final latents at denoising step
    ``step`` (of ``num_steps``) in update epoch ``epoch`` (DiffusionNFT / AWM training).

    ``seeds`` [b] are the samples' rollout seeds (the run seed, the step and the sample's index),
    so a sample's noise is its own: the same on any rank, in any micro-batch or mini-batch, on
    resume; distinct per step and per epoch (stream ``3 + epoch × num_steps + step``)."""
    stream = 3 + epoch * num_steps + step
    rows = [
        torch.randn(tuple(shape), generator=seeded_generator(s, stream)) for s in seeds.tolist()
    ]
    return torch.stack(rows) if rows else torch.zeros(0, *shape)


def cond_of(batch: Batch) -> dict[str, Tensor]:
    return {k[len(COND_PREFIX) :]: v for k, v in batch.tensors.items() if k.startswith(COND_PREFIX)}


def index_cond(cond: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
    return {k: v[rows] for k, v in cond.items()}


def combine_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for s in steps for k in s):
        values = [s[key] for s in steps if key in s]
        if key.endswith("ratio_max"):
            out[key] = max(values)
        elif key.endswith("ratio_min"):
            out[key] = min(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def cpu_state(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}


def prompt_rows(
    prompts: Sequence[str], seeds: Sequence[Sequence[int]], group_ids: Sequence[int]
) -> Batch:
    """The input of ``generate``: one row per prompt with its text and one seed per sample."""
    return Batch(
        {"group_ids": torch.as_tensor(list(group_ids), dtype=torch.long)},
        {"prompt": list(prompts), "seeds": [list(s) for s in seeds]},
    )
