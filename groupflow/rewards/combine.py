"""Several rewards into one: the weighted sum, or the weighted sum of per-reward group z-scores.

Design decision: combining is one small pure function shared by every reward path (the rule-based
runner, the runner with a reward model, LLM and diffusion alike), so ``reward.normalize`` means the
same everywhere. Under a plain weighted sum a reward whose values spread widely inside a group
decides the sign of every advantage and a reward with a narrow spread is drowned (flow_grpo #142).
``normalize: group`` first turns each reward into its z-score inside each prompt's group,
``(r - mean_g) / (std_g + eps)`` (unbiased std, 0 for a singleton or constant group, as the GRPO
estimator computes it), and only then weighs and sums: each reward's weight is then its share of
the signal, whatever its scale (GDPO, arXiv 2601.05242; the advantage estimator normalises the
sum once more afterwards). Groups exist only in training batches; without ``group_ids``
(validation, eval) the combination is the plain weighted sum, so a logged total keeps its units.

``shares`` says who drives the advantage: reward k's mean |w_k · (x_k − mean_g x_k)| over the
batch (x_k its values, or its z-scores under ``normalize: group``) as a fraction of all rewards'.
``None`` values (NaN here) are skipped throughout, like the weighted sum's ``nansum``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["NORMALIZE_MODES", "CombinedRewards", "combine_rewards", "group_normalize"]

NORMALIZE_MODES = ("none", "group")


@dataclass(frozen=True)
class CombinedRewards:
    """total: [B] float32; all_none: [B] bool (no trained reward had a value: ``failure_value``);
    shares: name -> fraction of the within-group signal (empty without groups)."""

    total: Tensor
    all_none: Tensor
    shares: dict[str, float]


def _group_mean(values: Tensor, present: Tensor, index: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Per-sample mean of the present values of its group, and that group's count of them."""
    zeros = torch.zeros(n, dtype=values.dtype)
    count = zeros.index_add(0, index, present.to(values.dtype))
    total = zeros.index_add(0, index, torch.where(present, values, torch.zeros_like(values)))
    return (total / count.clamp(min=1))[index], count[index]


def group_normalize(values: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """[B] values, [B] integer group ids -> [B] ``(r − mean_g) / (std_g + eps)`` (float64).

    Statistics skip NaN (a ``None`` reward), which stays NaN; std is unbiased (n − 1) and 0 for a
    group with one present value; a sample of such a group, or of a constant one, gets 0 (no
    signal), never a division by zero.
    """
    if values.shape != group_ids.shape or values.dim() != 1:
        raise ValueError(
            f"group_normalize: values {list(values.shape)} and group_ids "
            f"{list(group_ids.shape)} must be the same 1-D shape"
        )
    if not eps >= 0:
        raise ValueError(f"group_normalize: eps must be >= 0, got {eps!r}")
    x = values.double()
    present = ~torch.isnan(x)
    _, index = torch.unique(group_ids, return_inverse=True)
    n = int(index.max()) + 1 if index.numel() else 0
    mean, count = _group_mean(x, present, index, n)
    centred = torch.where(present, x - mean, torch.zeros_like(x))
    sq = torch.zeros(n, dtype=x.dtype).index_add(0, index, centred * centred)[index]
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    # a singleton or constant group carries no signal: 0, also with eps = 0
    z = torch.where((count > 1) & (std > 0), centred / (std + eps), torch.zeros_like(centred))
    return torch.where(present, z, torch.full_like(z, float("nan")))


def _shares(parts: Mapping[str, Tensor], group_ids: Tensor) -> dict[str, float]:
    _, index = torch.unique(group_ids, return_inverse=True)
    n = int(index.max()) + 1 if index.numel() else 0
    spread = {}
    for name, x in parts.items():
        present = ~torch.isnan(x)
        mean, _ = _group_mean(x, present, index, n)
        spread[name] = float(torch.where(present, (x - mean).abs(), torch.zeros_like(x)).mean())
    whole = sum(spread.values())
    return {k: (v / whole if whole > 0 else 0.0) for k, v in spread.items()}


def combine_rewards(
    components: Mapping[str, Tensor],
    weights: Mapping[str, float],
    failure_value: float = 0.0,
    *,
    group_ids: Tensor | None = None,
    normalize: str = "none",
    eps: float = 1e-6,
) -> CombinedRewards:
    """Weighted, NaN-skipping sum of the components named in ``weights`` (others — held-out
    monitors — are ignored); with ``normalize="group"`` and ``group_ids``, of their group z-scores.

    components: name -> [B] values (NaN = no opinion); a sample where every weighted component
    is NaN gets ``failure_value`` and is flagged in ``all_none``.
    """
    if normalize not in NORMALIZE_MODES:
        raise ValueError(f"normalize must be one of {list(NORMALIZE_MODES)}, got {normalize!r}")
    missing = [k for k in weights if k not in components]
    if missing:
        raise ValueError(f"combine_rewards: no values for weighted reward(s) {missing}")
    size = next(iter(components.values())).numel() if components else 0
    if not weights:
        return CombinedRewards(torch.zeros(size), torch.zeros(size, dtype=torch.bool), {})
    parts = {k: components[k].double() for k in weights}
    if group_ids is not None:
        group_ids = torch.as_tensor(group_ids).reshape(-1)
        if normalize == "group":
            parts = {k: group_normalize(v, group_ids, eps) for k, v in parts.items()}
    weighted = {k: v * weights[k] for k, v in parts.items()}
    stacked = torch.stack(list(weighted.values()))  # [K, B]
    present = ~torch.isnan(stacked)
    total = torch.where(present, stacked, torch.zeros_like(stacked)).sum(0)
    all_none = ~present.any(0)
    total = torch.where(all_none, torch.full_like(total, failure_value), total).float()
    shares = _shares(weighted, group_ids) if group_ids is not None else {}
    return CombinedRewards(total, all_none, shares)
