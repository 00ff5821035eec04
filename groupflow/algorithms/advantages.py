"""Advantage estimators: outcome rewards of grouped samples -> one scalar advantage per sample.

Design decision: groups are given by explicit integer `group_ids` (any values, any order, any
sizes), never by reshaping to a fixed group size, so filtered or dynamically sampled batches work
unchanged. Group statistics are computed once, vectorised (`torch.unique(return_inverse=True)` +
`index_add_`), and handed to the selected estimator as a `GroupStats`. Two edge cases are decided
here, centrally, for every estimator: a singleton group and a group whose rewards are all equal
get advantage exactly 0 (no learning signal) -- unlike verl, which uses mean 0 / std 1 for
singletons and so turns the raw reward into the advantage.

Statistics are computed in float64 (batches are small, and constant groups must not produce
round-off "signal"); the result is float32.

Group statistics must cover the whole group: call this on the driver (or after gathering rewards
from every data-parallel rank), never per rank.

Token-level GAE (PPO with a critic) has a different signature and output ([B, T] advantages plus
returns), so it is not an entry of `ADVANTAGE_ESTIMATORS`; call `compute_gae` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from groupflow.algorithms.registry import Registry, check_options

AdvantageEstimator = Callable[..., Tensor]
"""Signature: fn(rewards: Tensor[B] float64, groups: GroupStats, *, <options>) -> Tensor[B].
Options must be keyword-only so that unknown options can be rejected."""

ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")

COMMON_OPTIONS = ("adv_clip_max", "reward_threshold")

_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def register_advantage_estimator(name: str, **kwargs):
    """Decorator adding an estimator `fn(rewards, groups, *, opts...) -> Tensor[B]`."""
    return ADVANTAGE_ESTIMATORS.register(name, **kwargs)


@dataclass(frozen=True)
class GroupStats:
    """Per-group statistics broadcast back to samples (all tensors are [B], float64 unless noted).

    index: [B] int64, dense group index 0..num_groups-1 of each sample.
    size: number of samples in the sample's group.
    mean, std: group mean and unbiased (n-1) std of the rewards (std = 0 for singletons).
    degenerate: [B] bool, True where the group is a singleton or all its rewards are equal.
    """

    index: Tensor
    num_groups: int
    size: Tensor
    mean: Tensor
    std: Tensor
    degenerate: Tensor


def group_stats(rewards: Tensor, group_ids: Tensor) -> GroupStats:
    """Vectorised group statistics; `rewards` float64 [B], `group_ids` integer [B]."""
    unique_ids, index = torch.unique(group_ids, return_inverse=True)
    num_groups = unique_ids.numel()
    zeros = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    size = zeros.index_add(0, index, torch.ones_like(rewards))
    mean = zeros.index_add(0, index, rewards) / size
    # Two-pass variance: subtract the group mean first, for accuracy.
    centered = rewards - mean[index]
    sq = zeros.index_add(0, index, centered * centered)
    std = (sq / (size - 1).clamp(min=1)).sqrt()
    # Exact min == max comparison: a constant group is detected without round-off tolerance.
    inf = torch.full_like(zeros, float("inf"))
    rmin = inf.scatter_reduce(0, index, rewards, "amin", include_self=True)
    rmax = (-inf).scatter_reduce(0, index, rewards, "amax", include_self=True)
    degenerate = (size < 2) | (rmin == rmax)
    return GroupStats(
        index=index,
        num_groups=num_groups,
        size=size[index],
        mean=mean[index],
        std=std[index],
        degenerate=degenerate[index],
    )


def _unbiased_std(x: Tensor) -> Tensor:
    if x.numel() < 2:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return x.std(unbiased=True)


def _check_eps(eps: float) -> None:
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")


@register_advantage_estimator("grpo")
def grpo(rewards: Tensor, groups: GroupStats, *, scale: str = "group", eps: float = 1e-6) -> Tensor:
    """A_i = (r_i - mean_g) / (std + eps).

    scale: "group" (std of the sample's group; GRPO), "batch" (std of all rewards in the batch;
    TRL `scale_rewards="batch"`), "none" (no division; Dr. GRPO). Std is the unbiased (n-1) std,
    as in verl and TRL. eps: verl uses 1e-6 (our default), TRL 1e-4.
    """
    _check_eps(eps)
    centered = rewards - groups.mean
    if scale == "group":
        return centered / (groups.std + eps)
    if scale == "batch":
        return centered / (_unbiased_std(rewards) + eps)
    if scale == "none":
        return centered
    raise ValueError(f"unknown scale {scale!r} for estimator 'grpo'; valid: group, batch, none")


@register_advantage_estimator("dr_grpo")
def dr_grpo(rewards: Tensor, groups: GroupStats) -> Tensor:
    """Dr. GRPO: A_i = r_i - mean_g (grpo with scale="none"; verl norm_adv_by_std_in_grpo=False)."""
    return rewards - groups.mean


@register_advantage_estimator("rloo")
def rloo(rewards: Tensor, groups: GroupStats) -> Tensor:
    """RLOO: A_i = r_i - mean_{j in g, j != i} r_j = G/(G-1) * (r_i - mean_g). Singletons -> 0."""
    size = groups.size
    return size / (size - 1).clamp(min=1) * (rewards - groups.mean)


@register_advantage_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline(rewards: Tensor, groups: GroupStats, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++-baseline: subtract the group mean, then whiten over the whole batch.

    Whitening: (c - mean_batch(c)) / (unbiased std_batch(c) + eps), over samples (verl whitens over
    response tokens, i.e. weights samples by length; we weight every sample once). Samples of
    degenerate groups (c = 0) count in the batch statistics and stay exactly 0.
    """
    _check_eps(eps)
    centered = torch.where(groups.degenerate, 0.0, rewards - groups.mean)
    return (centered - centered.mean()) / (_unbiased_std(centered) + eps)


def _validate(rewards: Tensor, group_ids: Tensor) -> None:
    for name, value in (("rewards", rewards), ("group_ids", group_ids)):
        if not isinstance(value, Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor, got {type(value).__name__}; wrap it with torch.tensor(...)"
            )
        if value.dim() != 1:
            raise ValueError(f"{name} must be 1-D [B], got shape {tuple(value.shape)}")
    if not rewards.is_floating_point():
        raise TypeError(f"rewards must be a floating-point tensor, got {rewards.dtype}")
    if group_ids.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must have the same length, got {rewards.numel()} and {group_ids.numel()}"
        )
    if rewards.device != group_ids.device:
        raise ValueError(
            f"rewards and group_ids must be on the same device, got {rewards.device} and {group_ids.device}"
        )
    bad = (~torch.isfinite(rewards)).nonzero().flatten()
    if bad.numel():
        shown = bad[:10].tolist()
        raise ValueError(
            f"rewards must be finite; non-finite values at sample indices {shown}"
            f"{' ...' if bad.numel() > 10 else ''} ({rewards[bad[:10]].tolist()})"
        )


def compute_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    estimator: str = "grpo",
    *,
    adv_clip_max: float | None = None,
    reward_threshold: float | None = None,
    **opts,
) -> Tensor:
    """Outcome-reward advantages, one per sample.

    Args:
        rewards: [B] floating, finite.
        group_ids: [B] integer; samples with equal id form a group (any order, any group sizes).
        estimator: a name in `ADVANTAGE_ESTIMATORS` ("grpo", "dr_grpo", "rloo",
            "reinforce_pp_baseline", or a user-registered one).
        adv_clip_max: clip advantages to [-v, v] (diffusion recipes use 5-10); None = off.
        reward_threshold: zero the advantages of every group whose mean reward is below this
            (MMDanceGRPO's reward_threshold); None = off.
        **opts: estimator options (e.g. grpo's `scale`, `eps`); unknown ones raise.

    Returns:
        [B] float32 on the device of `rewards`. Singleton and constant groups are exactly 0.
    """
    if estimator == "gae":
        raise ValueError(
            "'gae' is token-level and needs a critic: call "
            "compute_gae(token_rewards, values, mask, gamma, lam) instead of compute_advantages"
        )
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    check_options(fn, opts, what=f"advantage estimator {estimator!r}", extra=COMMON_OPTIONS)
    if adv_clip_max is not None and not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max must be > 0 or None, got {adv_clip_max!r}")
    _validate(rewards, group_ids)

    r = rewards.detach().to(torch.float64)
    if r.numel() == 0:
        return torch.zeros(0, dtype=torch.float32, device=rewards.device)
    groups = group_stats(r, group_ids)
    adv = fn(r, groups, **opts)
    if adv.shape != r.shape:
        raise ValueError(
            f"advantage estimator {estimator!r} returned shape {tuple(adv.shape)}, expected {tuple(r.shape)}"
        )
    zero = groups.degenerate
    if reward_threshold is not None:
        zero = zero | (groups.mean < reward_threshold)
    adv = torch.where(zero, 0.0, adv)
    if adv_clip_max is not None:
        adv = adv.clamp(-adv_clip_max, adv_clip_max)
    return adv.to(torch.float32)


def _masked_whiten(x: Tensor, mask: Tensor, eps: float) -> Tensor:
    """(x - mean) / sqrt(var + eps) over valid tokens with unbiased var (verl masked_whiten)."""
    n = mask.sum()
    mean = (x * mask).sum() / n.clamp(min=1)
    var = (((x - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def compute_gae(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    *,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens (verl compute_gae_advantage_return).

    Args:
        token_rewards, values, mask: [B, T]; mask is 1 on tokens the policy produced.
        gamma, lam: discount and GAE lambda, in [0, 1].
        whiten: whiten the advantages over all valid tokens of the batch (mean/unbiased var, with
            `eps` inside the square root as in verl).

    Masked positions (padding, or tool/observation tokens between turns) are skipped: the
    recursion carries the next valid token's value and GAE across them, so their rewards and
    values never leak into any advantage. This is verl's multi-turn convention
    (``compute_gae_advantage_return`` with ``response_mask``): a gap is not a time step, so the
    model tokens either side of it are one γ step apart and a gapped row gives exactly the result
    of the same row with the gap columns removed. returns = advantages + values, taken before
    whitening. Both outputs are 0 at masked positions. Computed without gradient.

    Returns:
        (advantages [B, T], returns [B, T]).
    """
    for name, t in (("token_rewards", token_rewards), ("values", values), ("mask", mask)):
        if not isinstance(t, Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor [B, T], got {getattr(t, 'shape', t)!r}")
    if not token_rewards.shape == values.shape == mask.shape:
        raise ValueError(
            f"token_rewards, values and mask must have the same shape, got "
            f"{tuple(token_rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    for name, v in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {v!r}")
    with torch.no_grad():
        dtype = torch.promote_types(values.dtype, torch.float32)
        rewards = token_rewards.to(dtype)
        vals = values.to(dtype)
        m = (mask != 0).to(dtype)
        next_value = torch.zeros(vals.shape[0], dtype=dtype, device=vals.device)
        last_gae = torch.zeros_like(next_value)
        steps = []
        # A loop over time (not samples): each step is vectorised over the batch.
        for t in reversed(range(vals.shape[1])):
            delta = rewards[:, t] + gamma * next_value - vals[:, t]
            gae = delta + gamma * lam * last_gae
            keep = m[:, t]
            next_value = torch.where(keep > 0, vals[:, t], next_value)
            last_gae = torch.where(keep > 0, gae, last_gae)
            steps.append(gae * keep)
        advantages = torch.stack(steps[::-1], dim=1)
        returns = (advantages + vals) * m
        if whiten:
            advantages = _masked_whiten(advantages, m, eps)
    return advantages, returns
