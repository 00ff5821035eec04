"""Rollout/training mismatch: its size, and the truncated importance-sampling (TIS) correction.

Design decision: an inference engine (vLLM) samples with kernels whose log-probs differ slightly
from the training forward, so the "old" policy of the PPO ratio (recomputed by the trainer) is not
exactly the policy that sampled. TIS reweights each token's policy-gradient term by
``w = min(exp(old − rollout), C)`` (Yao et al., "Your efficient RL framework secretly brings you
off-policy RL training", as in verl's ``tis_imp_ratio_cap``): the weight is a constant (no
gradient), truncated at C so that one token the engine found unlikely cannot dominate the update.

Stale samples (asynchronous rollout, ``rollout.max_staleness``) are the same problem, larger: the
behaviour policy that sampled is k updates old. ``actor.off_policy`` chooses the correction:
``none`` (naive PPO: the behaviour log-probs are the ratio's anchor), ``tis`` (the weights above,
against the recomputed old log-probs) or ``decoupled`` — AReaL's decoupled PPO (Fu et al., 2025):
the *proximal* policy π_prox (old log-probs recomputed with the weights before this update) is
the clipping anchor, and each token's loss is weighted by π_prox/π_behav, with tokens whose
weight exceeds a cap masked out (weight 0, as AReaL's ``behav_imp_weight_cap``) rather than
truncated. All functions are pure; ``policy_loss`` applies the weights, the trainer logs the
mismatch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["truncated_is_weights", "decoupled_weights", "logprob_mismatch"]


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


def decoupled_weights(proximal_logprobs: Tensor, behaviour_logprobs: Tensor,
                      cap: float | None) -> Tensor:  # fmt: skip
    """Decoupled PPO's behaviour weights ``exp(prox − behav)`` per token, detached; 0 where the
    weight exceeds ``cap`` (those tokens are dropped from the update). ``cap`` None: no mask.

    Computed in log space: a weight is compared with the cap as ``prox − behav > log(cap)``, and
    dropped log-ratios are zeroed before exp, so a -inf behaviour log-prob never makes inf or NaN.
    """
    if cap is not None and not (isinstance(cap, (int, float)) and cap > 0 and math.isfinite(cap)):
        raise ValueError(f"decoupled PPO weight cap must be a finite number > 0, got {cap!r}")
    if proximal_logprobs.shape != behaviour_logprobs.shape:
        raise ValueError(
            f"behaviour log-probs must have the shape of the proximal ones "
            f"{tuple(proximal_logprobs.shape)}, got {tuple(behaviour_logprobs.shape)}"
        )
    log_w = proximal_logprobs.detach() - behaviour_logprobs.detach()
    keep = torch.isfinite(log_w) if cap is None else log_w <= math.log(cap)
    return torch.where(keep, torch.where(keep, log_w, 0.0).exp(), 0.0)


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
