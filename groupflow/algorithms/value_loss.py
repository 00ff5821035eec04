"""Clipped value loss for the critic (PPO), aggregated like the policy loss.

Design decision: the critic's loss uses the same ``aggregate`` modes and the same mini-batch-global
denominators as the policy loss, so its gradient is also independent of the micro-batch size and
the number of ranks. Formula (verl ``compute_value_loss``):
    v_clip = old_v + clip(v − old_v, −c, c)
    L_t    = ½ · max((v − R)², (v_clip − R)²)
where R are the GAE returns and old_v the values recorded before the update. c = None disables
clipping (L_t = ½ (v − R)²).
"""

from __future__ import annotations

import torch
from torch import Tensor

from groupflow.algorithms.aggregation import Number, aggregate
from groupflow.algorithms.policy_loss import masked_mean

__all__ = ["value_loss"]


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip_range: float | None = 0.5,
    agg: str = "token_mean",
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    max_len: Number | None = None,
    num_micro_batches: Number | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Aggregated clipped value loss and metrics.

    Args:
        values: [B, T] current critic predictions (with grad).
        old_values, returns: [B, T] (detached here).
        mask: [B, T] bool or 0/1.
        clip_range: c > 0, or None for no clipping.
        agg, num_tokens, num_seqs, max_len, num_micro_batches: see
            ``groupflow.algorithms.aggregation``.

    Returns:
        (scalar loss, {"vf_clipfrac": fraction of valid tokens where the clipped term is larger,
        "vpred_mean": mean prediction}) with metrics as 0-dim detached tensors.
    """
    for name, t in (("values", values), ("old_values", old_values), ("returns", returns)):
        if not isinstance(t, Tensor) or t.shape != mask.shape or t.dim() != 2:
            raise ValueError(
                f"{name} must be a [B, T] tensor shaped like mask {tuple(mask.shape)}, "
                f"got {getattr(t, 'shape', t)!r}"
            )
    if clip_range is not None and not clip_range > 0:
        raise ValueError(f"value clip range must be > 0 or None, got {clip_range!r}")
    valid = mask != 0
    old = torch.where(valid, old_values.detach().to(values.dtype), 0.0)
    ret = torch.where(valid, returns.detach().to(values.dtype), 0.0)
    v = torch.where(valid, values, 0.0)
    unclipped = (v - ret).square()
    if clip_range is None:
        per_token = 0.5 * unclipped
        clipped_more = torch.zeros_like(valid)
    else:
        v_clip = old + (v - old).clamp(-clip_range, clip_range)
        clipped = (v_clip - ret).square()
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clipped_more = clipped > unclipped
    loss = aggregate(
        per_token,
        valid,
        agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        max_len=max_len,
        num_micro_batches=num_micro_batches,
    )
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": masked_mean(clipped_more.float(), valid),
            "vpred_mean": masked_mean(v.detach(), valid),
        }
    return loss, metrics
