"""On-policy distillation: the teacher's per-token reverse KL as a per-token advantage.

Design decision: the student samples, a frozen teacher scores every sampled token, and the signal
is the sampled estimate of the per-token reverse KL, KL(pi_S || pi_T) ~ log pi_S(y_t) -
log pi_T(y_t) (k1). Its negative is the token's reward; with no discounting (each token's own
term, as in tinker-cookbook's and verl's on-policy distillation) it is the token's advantage, added
to the outcome advantage of the verifiable rewards with a weight (0: distillation alone). The
policy-gradient loss then takes these [B, T] advantages unchanged, so any registered loss works.
The student log-probs are the sampling policy's (``old_logprobs``), detached: the reverse-KL
gradient comes through the policy-gradient estimator, not through this term.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["distillation_advantages", "reverse_kl_per_token"]


def reverse_kl_per_token(
    student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor
) -> Tensor:
    """k1 estimate of KL(student || teacher) per sampled token, [B, T]; 0 where mask is 0."""
    if student_logprobs.shape != teacher_logprobs.shape or mask.shape != student_logprobs.shape:
        raise ValueError(
            f"student_logprobs {tuple(student_logprobs.shape)}, teacher_logprobs "
            f"{tuple(teacher_logprobs.shape)} and mask {tuple(mask.shape)} must have one shape [B, T]"
        )
    valid = mask != 0
    diff = student_logprobs.detach() - teacher_logprobs.detach()
    return diff.masked_fill(~valid, 0.0)


def distillation_advantages(
    outcome_advantages: Tensor | None,
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    *,
    coef: float = 1.0,
    reward_weight: float = 1.0,
) -> Tensor:
    """A_{i,t} = reward_weight * A_i - coef * (log pi_S(y_t) - log pi_T(y_t)), 0 where masked.

    Args:
        outcome_advantages: [B] (or [B, T]) advantages of the verifiable rewards, or None
            (distillation alone; the same as reward_weight = 0).
        student_logprobs, teacher_logprobs: [B, T] log-probs of the sampled tokens.
        mask: [B, T] 1 on the student's own tokens.
        coef: weight of the distillation term (>= 0); reward_weight: of the outcome term (>= 0).
    Returns: [B, T] advantages.
    """
    if not coef >= 0 or not reward_weight >= 0:
        raise ValueError(f"coef and reward_weight must be >= 0, got {coef!r}, {reward_weight!r}")
    kl = reverse_kl_per_token(student_logprobs, teacher_logprobs, mask)
    adv = -coef * kl
    if outcome_advantages is not None and reward_weight != 0:
        outcome = outcome_advantages.detach().to(adv.dtype)
        if outcome.dim() == 1:
            outcome = outcome[:, None]
        adv = adv + reward_weight * outcome
    return adv.masked_fill(mask == 0, 0.0)
