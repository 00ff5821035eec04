"""On-policy distillation for flow-matching policies: the teacher's step means on the student's states.

Design decision: the diffusion counterpart of ``groupflow.algorithms.distillation`` (verl-omni's
``diffusion_opd`` with its ``distill_kl`` loss; DiffusionOPD, ali-vilab). The student samples its
SDE trajectory as in Flow-GRPO; a frozen teacher predicts the velocity on the student's own
stored states (x_t, σ, condition); the sampler's step turns each velocity into the mean of that
step's transition Gaussian. Both Gaussians share the student's std σ_t (the noise level is the
student's: a teacher-owned one would make the quantity something other than a KL), so the
per-step reverse KL has a closed form,

    KL(p_student || p_teacher) = ‖μ_student − μ_teacher‖² / (2 σ_t²),

averaged over the latent (as the step log-probs are). Unlike the LLM form, where the full-vocab
KL is unaffordable and its sampled k1 estimate enters as a per-token advantage, this KL is exact
and differentiable in μ_student, so it is a loss term: its gradient is the exact gradient of the
step KL at the student's state, with none of a policy-gradient estimator's variance. (As a
per-step *advantage* it would also credit the wrong action: the closed-form KL at step t is a
function of the state x_t, which earlier steps chose, not of the step-t action.) It combines with
the policy-gradient loss through the teacher section's two keys, as on the LLM side:
``loss = reward_weight · L_pg + coef · L_kl`` (reward_weight 0: distillation alone). The KL of a
step with std 0 (an ODE step) is undefined; there the unit-variance surrogate ½‖Δμ‖² is used, as
verl-omni does (GRPO training masks such steps out; the surrogate keeps a stray one finite).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["teacher_step_kl", "distillation_loss"]


def teacher_step_kl(mean: Tensor, teacher_mean: Tensor, std: Tensor) -> Tensor:
    """Per-sample KL between N(mean, std²) and N(teacher_mean, std²), averaged over the latent.

    Args:
        mean: [B, ...] the student's step means (differentiable).
        teacher_mean: [B, ...] the teacher's step means at the same states (detached here).
        std: [B] the step's std (>= 0; 0: the surrogate ½‖Δμ‖²).
    Returns: [B], ‖mean − teacher_mean‖² averaged over non-batch dims / (2 std²).
    """
    if mean.shape != teacher_mean.shape:
        raise ValueError(
            f"student step means {list(mean.shape)} and teacher step means "
            f"{list(teacher_mean.shape)} must have one shape [B, ...] (the same latent shape)"
        )
    if mean.dim() < 2 or std.shape != mean.shape[:1]:
        raise ValueError(
            f"std must be [B] for means [B, ...]; got std {list(std.shape)}, means {list(mean.shape)}"
        )
    if not bool((std >= 0).all()):
        raise ValueError(f"a step std must be >= 0, got {std.tolist()}")
    sq = (mean - teacher_mean.detach()) ** 2
    sq = sq.reshape(sq.shape[0], -1).mean(1)
    var = std.detach().to(sq.dtype) ** 2
    # std 0 (an ODE step): unit variance, else the division would be 0/0 or x/0
    return sq / (2 * torch.where(var > 0, var, torch.ones_like(var)))


def distillation_loss(
    pg_loss: Tensor, kl_loss: Tensor, *, coef: float = 1.0, reward_weight: float = 1.0
) -> Tensor:
    """reward_weight · pg_loss + coef · kl_loss (scalars; both already aggregated over the steps).

    reward_weight 0 keeps only the distillation term (the rewards are still computed and logged);
    coef 0 would be plain GRPO, so at least one weight must be > 0.
    """
    if not coef >= 0 or not reward_weight >= 0:
        raise ValueError(f"coef and reward_weight must be >= 0, got {coef!r}, {reward_weight!r}")
    if coef == 0 and reward_weight == 0:
        raise ValueError("coef and reward_weight are both 0: the loss would have no term")
    if pg_loss.dim() != 0 or kl_loss.dim() != 0:
        raise ValueError(
            f"pg_loss and kl_loss must be scalars, got {list(pg_loss.shape)}, {list(kl_loss.shape)}"
        )
    return reward_weight * pg_loss + coef * kl_loss
