"""Token-level rewards for PPO: the outcome reward on the last valid token, minus a KL penalty.

Design decision: PPO with a critic needs a reward per action, while rewards arrive as one scalar
per sample. Placement puts that scalar on the sample's last valid response token (verl's
``token_level_scores``) and everything else at 0; the KL penalty to the reference policy is then
subtracted from every valid token (verl ``apply_kl_penalty``). Both are pure [B, T] functions so
that the same token rewards feed GAE, or are summed back into a per-sample score for the outcome
estimators (GRPO with KL in the reward, as verl does).
"""

from __future__ import annotations

import torch
from torch import Tensor

from groupflow.algorithms.kl import kl_penalty
from groupflow.algorithms.masks import check_2d as _check_2d
from groupflow.algorithms.masks import last_valid_index

__all__ = ["place_outcome_reward", "kl_in_reward", "last_valid_index", "sequence_mean_kl"]


def place_outcome_reward(rewards: Tensor, mask: Tensor) -> Tensor:
    """Outcome rewards [B] -> token rewards [B, T]: r_i on the last valid token of row i, 0 elsewhere.

    With masked tokens inside a response (tool/observation tokens) the last *valid* token still
    gets the reward. A row without valid tokens gets no reward anywhere (nothing to credit).
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        raise ValueError(
            f"rewards must be a 1-D tensor [B], got {getattr(rewards, 'shape', rewards)!r}"
        )
    _check_2d("mask", mask)
    if rewards.shape[0] != mask.shape[0]:
        raise ValueError(
            f"rewards has {rewards.shape[0]} samples but mask has {mask.shape[0]} rows"
        )
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    last = last_valid_index(mask)
    rows = (last >= 0).nonzero().flatten()
    out[rows, last[rows]] = rewards.to(dtype)[rows]
    return out


def kl_in_reward(
    token_rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    coef: float,
    kind: str = "k1",
) -> tuple[Tensor, Tensor]:
    """token_rewards - coef * KL_t on valid tokens (verl ``apply_kl_penalty``).

    Args:
        token_rewards, logprobs, ref_logprobs, mask: [B, T]; logprobs are the sampling policy's
            (old) log-probs of the taken tokens, ref_logprobs the reference policy's.
        coef: β >= 0 (fixed, or the adaptive controller's current value).
        kind: KL estimator name (k1/kl, k2/mse, k3/low_var_kl), see ``groupflow.algorithms.kl``.

    Returns:
        (penalised token rewards [B, T], per-token KL [B, T], 0 where masked). The caller feeds
        the batch mean of the per-sample token-mean KL to the KL controller, as verl does.
    """
    for name, t in (("token_rewards", token_rewards), ("logprobs", logprobs),
                    ("ref_logprobs", ref_logprobs), ("mask", mask)):  # fmt: skip
        _check_2d(name, t)
        if t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(mask.shape)}")
    if not coef >= 0:
        raise ValueError(f"KL coefficient must be >= 0, got {coef!r}")
    valid = mask != 0
    kl = torch.where(valid, kl_penalty(logprobs, ref_logprobs, kind), 0.0).detach()
    return token_rewards - coef * kl, kl


def sequence_mean_kl(kl: Tensor, mask: Tensor) -> Tensor:
    """Batch mean of each sample's token-mean KL (the value verl's controller is updated with)."""
    valid = (mask != 0).to(kl.dtype)
    per_seq = (kl * valid).sum(1) / valid.sum(1).clamp(min=1)
    return per_seq.mean() if per_seq.numel() else per_seq.sum()
