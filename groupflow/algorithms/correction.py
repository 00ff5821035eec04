"""Rollout/training mismatch: its size, and the truncated importance-sampling (TIS) correction.

Design decision: an inference engine (vLLM) samples with kernels whose log-probs differ slightly
from the training forward, so the "old" policy of the PPO ratio (recomputed by the trainer) is not
exactly the policy that sampled. TIS reweights each token's policy-gradient term by
``w = min(exp(old − rollout), C)`` (Yao et al., "Your efficient RL framework secretly brings you
off-policy RL training", as in verl's ``tis_imp_ratio_cap``): the weight is a constant (no
gradient), truncated at C so that one token the engine found unlikely cannot dominate the update.
Both functions are pure; ``policy_loss`` applies the weights, the trainer logs the mismatch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["truncated_is_weights", "logprob_mismatch"]


def truncated_is_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float) -> Tensor:
    """``min(exp(old − rollout), cap)`` per token, detached; [B, T] like its inputs.

    The log-ratio is clamped at log(cap) *before* exp, which gives the same value without
    overflowing to inf (and inf·0 = NaN at masked positions) when the engine's log-prob is -inf.
    """
    if not (isinstance(cap, (int, float)) and cap > 0 and math.isfinite(cap)):
        raise ValueError(f"TIS cap must be a finite number > 0, got {cap!r}")
    if old_logprobs.shape != rollout_logprobs.shape:
        raise ValueError(
            f"rollout_logprobs must have the shape of old_logprobs {tuple(old_logprobs.shape)}, "
            f"got {tuple(rollout_logprobs.shape)}"
        )
    log_w = (old_logprobs.detach() - rollout_logprobs.detach()).clamp(max=math.log(cap))
    return log_w.exp()


def logprob_mismatch(
    train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor
) -> dict[str, float]:
    """Max and mean |train − rollout| over the tokens where ``mask`` is set (0 and 0 if none)."""
    valid = mask != 0
    diff = (train_logprobs.detach().float() - rollout_logprobs.detach().float()).abs()
    diff = torch.where(valid, diff, 0.0)
    n = int(valid.sum())
    return {
        "max": float(diff.max()) if n else 0.0,
        "mean": float(diff.sum() / n) if n else 0.0,
    }
