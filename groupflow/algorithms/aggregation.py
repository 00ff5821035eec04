"""Aggregation of per-action values (losses, KL, entropy) [B, T] into one scalar.

Design decision: every mode divides a masked sum by denominators that the caller may pass in
explicitly -- `num_tokens`, `num_seqs`, `max_len`, `num_micro_batches` -- and THE CONTRACT is that
these are the counts of the whole mini-batch (all gradient-accumulation micro-batches on all
data-parallel ranks). Then the loss of each micro-batch is its share of the full-batch loss, and

    sum over micro-batches and ranks of grad(aggregate(micro-batch))  ==  grad(full-batch loss)

exactly, whatever the micro-batch size (TRL issue 3021, verl issue 5625 are this bug).
Consequences for callers:
  * gradient accumulation must SUM the micro-batch losses (no division by the number of
    micro-batches);
  * a data-parallel engine must SUM gradients across ranks -- or, since DDP/FSDP all-reduce
    AVERAGES, multiply each rank's loss by the world size;
  * `num_tokens` / `num_seqs` / `num_micro_batches` must be all-reduced (summed) and `max_len`
    max-reduced across ranks before the first micro-batch (`loss_denominators` gives the local
    counts).
When a denominator is None it defaults to the local value of this call (num_tokens = local sum of
the mask, num_seqs = local B, max_len = local T, num_micro_batches = 1), which is only right for a
single micro-batch.

`local_token_mean` (TRL "bnpo", verl's old token-mean) is the one mode whose full-batch loss
depends on how the batch is cut: it is the MEAN over micro-batches of each micro-batch's own token
mean, i.e. sum(m v) / local sum(m) / num_micro_batches -- TRL divides it by the number of
gradient-accumulation steps and DDP averages it over ranks, which is the same thing when every rank
runs as many micro-batches (here the micro-batches of ranks with fewer count once each, so the
weights stay equal). Its gradient therefore changes with the micro-batch size (longer micro-batches
weigh each token less) but not its scale: it does not grow with the number of micro-batches or
ranks. Every other mode ignores `num_micro_batches`.

Values at masked positions are never read (they may be inf/NaN, e.g. log-probs of padding).
A zero denominator (no valid tokens anywhere) gives a loss of 0, not NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from groupflow.algorithms.registry import Registry, option_names

Number = int | float | Tensor
Aggregation = Callable[..., Tensor]
"""Signature: fn(masked_values [B,T], mask [B,T] float, *, num_tokens, num_seqs, max_len
[, num_micro_batches]) -> scalar. masked_values are already 0 at masked positions; denominators
are resolved (never None); num_micro_batches is passed only to functions that declare it."""

AGGREGATIONS: Registry[Aggregation] = Registry("aggregation mode")


def register_aggregation(name: str, **kwargs):
    return AGGREGATIONS.register(name, **kwargs)


def _safe_div(numerator: Tensor, denominator: Number) -> Tensor:
    """numerator / denominator, or 0 when the denominator is 0 (keeps the autograd graph)."""
    if isinstance(denominator, Tensor):
        den = denominator.to(numerator.dtype)
        return torch.where(den != 0, numerator / torch.where(den != 0, den, 1), 0.0)
    return numerator / denominator if denominator != 0 else numerator * 0.0


@register_aggregation("token_mean")
def token_mean(masked: Tensor, mask: Tensor, *, num_tokens, num_seqs, max_len) -> Tensor:
    """sum(m * v) / num_tokens  (verl token-mean, TRL dapo)."""
    return _safe_div(masked.sum(), num_tokens)


@register_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(masked: Tensor, mask: Tensor, *, num_tokens, num_seqs, max_len) -> Tensor:
    """sum_i (sum_t m v / sum_t m) / num_seqs  (verl seq-mean-token-mean, TRL grpo).

    A sample without valid tokens contributes 0 but still counts in num_seqs.
    """
    per_seq = _safe_div(masked.sum(dim=-1), mask.sum(dim=-1))
    return _safe_div(per_seq.sum(), num_seqs)


@register_aggregation("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    masked: Tensor, mask: Tensor, *, num_tokens, num_seqs, max_len
) -> Tensor:
    """sum(m * v) / (num_seqs * max_len)  (verl seq-mean-token-sum-norm, TRL dr_grpo).

    For invariance max_len must be the same for every micro-batch: a fixed constant such as the
    maximum response length (Dr. GRPO's choice) or the max padded width over the mini-batch.
    """
    return _safe_div(masked.sum(), num_seqs * max_len)


@register_aggregation("local_token_mean")
def local_token_mean(
    masked: Tensor, mask: Tensor, *, num_tokens, num_seqs, max_len, num_micro_batches
) -> Tensor:
    """sum(m * v) / local sum(m) / num_micro_batches  (TRL bnpo; verl's old token-mean).

    Summed over micro-batches, the mean of their token means (see the module docstring).
    """
    return _safe_div(_safe_div(masked.sum(), mask.sum()), num_micro_batches)


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str = "token_mean",
    *,
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    max_len: Number | None = None,
    num_micro_batches: Number | None = None,
) -> Tensor:
    """Reduce values [B, T] over valid positions of mask [B, T] (bool or 0/1) to a scalar.

    See the module docstring for the global-denominator contract.
    """
    fn = AGGREGATIONS.get(mode)
    if not isinstance(values, Tensor) or not isinstance(mask, Tensor):
        raise TypeError("values and mask must be torch.Tensor")
    if values.dim() != 2 or values.shape != mask.shape:
        raise ValueError(
            f"values and mask must both be [B, T] with the same shape, got "
            f"{tuple(values.shape)} and {tuple(mask.shape)}"
        )
    for name, den in (("num_tokens", num_tokens), ("num_seqs", num_seqs), ("max_len", max_len),
                      ("num_micro_batches", num_micro_batches)):  # fmt: skip
        if den is not None and not isinstance(den, Tensor) and den < 0:
            raise ValueError(f"{name} must be >= 0, got {den!r}")
    # Masks are 0/1 (bool or numeric); any non-zero entry counts as one valid token.
    valid = mask != 0
    m = valid.to(values.dtype)
    # where(), not multiply: 0 * inf (log-prob of a padding token) would be NaN.
    masked = torch.where(valid, values, 0.0)
    dens = {
        "num_tokens": m.sum() if num_tokens is None else num_tokens,
        "num_seqs": values.shape[0] if num_seqs is None else num_seqs,
        "max_len": values.shape[1] if max_len is None else max_len,
    }
    accepted = option_names(fn)
    if accepted is None or "num_micro_batches" in accepted:  # a registered mode may predate it
        dens["num_micro_batches"] = 1 if num_micro_batches is None else num_micro_batches
    return fn(masked, m, **dens)


def loss_denominators(masks: Tensor | Sequence[Tensor]) -> dict[str, int]:
    """Global denominators of a mini-batch given as one mask [B, T] or a list of micro-batch masks.

    Returns {"num_tokens": total valid tokens, "num_seqs": total samples, "max_len": max padded
    width, "num_micro_batches": number of masks given}, as python ints, to pass as `**kwargs` to
    `aggregate` / `policy_loss` for every micro-batch. Across data-parallel ranks, sum num_tokens,
    num_seqs and num_micro_batches and take the max of max_len (all-reduce) before use.
    """
    if isinstance(masks, Tensor):
        masks = [masks]
    if len(masks) == 0:
        raise ValueError("loss_denominators needs at least one mask")
    for i, m in enumerate(masks):
        if not isinstance(m, Tensor) or m.dim() != 2:
            raise ValueError(
                f"mask {i} must be a 2-D tensor [B, T], got {getattr(m, 'shape', m)!r}"
            )
    return {
        "num_tokens": int(sum(int((m != 0).sum().item()) for m in masks)),
        "num_seqs": int(sum(m.shape[0] for m in masks)),
        "max_len": int(max(m.shape[1] for m in masks)),
        "num_micro_batches": len(masks),
    }
