"""Training objectives beside Flow-GRPO's: GRPO-Guard, DiffusionNFT, Flow-DPPO and AWM.

Design decision: each objective is a few pure tensor functions here, and the worker only decides
which to call, so every formula is checked against hand-computed values in isolation.

- **GRPO-Guard** (Wang et al. 2025, arXiv 2510.22319; as verl-omni ships it): for a Gaussian step
  with std s, log r = (‖x'−μ_old‖² − ‖x'−μ_θ‖²)/(2s²) has mean −‖μ_θ−μ_old‖²/(2s²) < 0, so ratios
  sit below 1 and the upper clip never stops an over-confident positive update. RatioNorm adds that
  bias back and scales by s: ρ = exp((log r + ‖μ_θ−μ_old‖²/(2s²))·s); each step's loss is then
  weighted by 1/|dt| (gradient reweighting across noise levels). With the PPO clip loss the weight
  is applied to the advantage, which is the same as weighting the clipped term (it is linear in A
  for a positive weight).
- **DiffusionNFT** (Zheng et al. 2025, arXiv 2509.16117): no likelihood. A clean sample x0 is
  re-noised, x_t = (1−t)·x0 + t·ε; the trained velocity v_θ and the old (sampling) policy's v_old
  define an implicit positive policy v⁺ = β·v_θ + (1−β)·v_old and negative v⁻ = (1+β)·v_old −
  β·v_θ; with r = clip(A/A_max, −1, 1)/2 + 1/2 the loss is
  A_max·[r·‖x̂0(v⁺) − x0‖²/w⁺ + (1−r)·‖x̂0(v⁻) − x0‖²/w⁻]/β, x̂0(v) = x_t − t·v, each term
  divided by its own detached mean absolute error w (adaptive weighting, floored).
- **Flow-DPPO** (Ping et al. 2026, arXiv 2606.11025; verl-omni ``docs/algo/flowdppo.md``, the
  UniRL reference code): the per-step policy is Gaussian, so the divergence between the old and
  the current step is exact, KL = ‖μ_θ−μ_old‖²/(2s²) averaged over the latent (``guard_bias``'s
  value). The loss is the unclipped −A·ρ, masked where the step is outside the trust region
  (KL ≥ threshold) AND the update moves it further away (ρ > 1 with A > 0, or ρ < 1 with A < 0);
  corrective updates are always kept.
- **AWM**, Advantage Weighted Matching (arXiv 2509.25050, 2025; as Flow-Factory ships
  it): the flow-matching loss itself as the log-likelihood surrogate. A clean sample is re-noised
  (x_t = (1−t)·x0 + t·ε, as DiffusionNFT) and log p = −w(t)·mean‖v_θ(x_t) − (ε − x0)‖², with
  w = 1, t or t²; the policy loss on it (PPO clip, old = the sampling policy at the same x_t, ε)
  at ratio 1 is A·∇‖v_θ − (ε − x0)‖²: pretraining's loss, weighted by the advantage.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "AWM_WEIGHTINGS",
    "awm_logprob",
    "dppo_keep_mask",
    "flow_dppo_loss",
    "guard_bias",
    "guard_logprobs",
    "guard_step_weights",
    "nft_reward_weight",
    "nft_noised",
    "nft_loss",
    "ema_decay",
]


def _flat_mean(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0], -1).mean(1)


def _b(t: Tensor, like: Tensor) -> Tensor:
    return t.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


def guard_bias(mean: Tensor, old_mean: Tensor, std: Tensor) -> Tensor:
    """‖μ_θ − μ_old‖² (averaged over the latent) / (2·std²): [B]; differentiable in ``mean``."""
    return _flat_mean((mean - old_mean.detach()) ** 2) / (2 * std**2)


def guard_logprobs(logp: Tensor, old: Tensor, bias: Tensor, std: Tensor) -> Tensor:
    """Log-probs whose ratio to ``old`` is GRPO-Guard's: (logp − old + bias)·std + old."""
    return (logp - old.detach() + bias) * std + old.detach()


def guard_step_weights(sigmas: Tensor, sigmas_next: Tensor) -> Tensor:
    """GRPO-Guard's per-step loss weight 1/|dt| (= 1/(√−dt)²)."""
    return 1.0 / (sigmas - sigmas_next).abs()


def nft_reward_weight(advantages: Tensor, adv_clip_max: float) -> Tensor:
    """The optimality probability r ∈ [0, 1]: clip(A, ±A_max)/A_max/2 + 1/2."""
    a = advantages.clamp(-adv_clip_max, adv_clip_max)
    return (a / adv_clip_max / 2 + 0.5).clamp(0, 1)


def nft_noised(x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
    """The forward process x_t = (1 − t)·x0 + t·ε (t: [B])."""
    tb = _b(t, x0)
    return (1 - tb) * x0 + tb * noise


def _weighted_x0_error(x0_pred: Tensor, x0: Tensor, floor: float) -> Tensor:
    with torch.no_grad():
        w = (x0_pred.double() - x0.double()).abs().reshape(x0.shape[0], -1).mean(1)
        w = w.clamp_min(floor).to(x0_pred.dtype)
    return _flat_mean((x0_pred - x0) ** 2) / w


def nft_loss(
    v: Tensor,
    v_old: Tensor,
    x_t: Tensor,
    x0: Tensor,
    t: Tensor,
    r: Tensor,
    *,
    beta: float,
    adv_clip_max: float,
    weight_min: float = 1e-5,
) -> Tensor:
    """DiffusionNFT's per-sample loss [B] (see the module docstring); gradients flow through v."""
    v_old = v_old.detach()
    tb = _b(t, x_t)
    positive = beta * v + (1 - beta) * v_old
    negative = (1 + beta) * v_old - beta * v
    pos = _weighted_x0_error(x_t - tb * positive, x0, weight_min)
    neg = _weighted_x0_error(x_t - tb * negative, x0, weight_min)
    return adv_clip_max * (r * pos + (1 - r) * neg) / beta


def dppo_keep_mask(ratio: Tensor, advantages: Tensor, kl: Tensor, threshold: float) -> Tensor:
    """Flow-DPPO's asymmetric divergence mask (bool, same shape): False only where KL ≥ threshold
    and the update widens the gap (ρ > 1 with A > 0, or ρ < 1 with A < 0)."""
    outside = kl >= threshold
    widening = ((ratio > 1) & (advantages > 0)) | ((ratio < 1) & (advantages < 0))
    return ~(outside & widening)


def flow_dppo_loss(
    logp: Tensor, old: Tensor, advantages: Tensor, kl: Tensor, threshold: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-step Flow-DPPO loss [B, N]: −A·ρ where ``dppo_keep_mask`` keeps it, else 0, and
    metrics (shares over all entries; the caller's mask and aggregation decide what counts).

    logp [B, N] with grad, old [B, N], advantages [B] or [B, N], kl [B, N] (exact step KL)."""
    if not threshold > 0:
        raise ValueError(f"Flow-DPPO's kl_mask_threshold must be > 0, got {threshold!r}")
    adv = advantages.detach()
    adv = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    ratio = torch.exp(logp - old.detach())
    keep = dppo_keep_mask(ratio.detach(), adv, kl.detach(), threshold)
    # where, not a product: an overflowing ratio times 0 would be NaN
    loss = torch.where(keep, -adv * ratio, torch.zeros((), dtype=ratio.dtype))
    return loss, {"keep": keep, "ratio": ratio.detach()}


AWM_WEIGHTINGS = ("uniform", "t", "t2")


def awm_logprob(
    v: Tensor, x0: Tensor, noise: Tensor, t: Tensor, weighting: str = "uniform"
) -> Tensor:
    """AWM's log-likelihood surrogate [B]: −w(t)·mean‖v − (ε − x0)‖² over the latent (t: [B])."""
    if weighting not in AWM_WEIGHTINGS:
        raise ValueError(f"unknown AWM weighting {weighting!r}; valid: {', '.join(AWM_WEIGHTINGS)}")
    err = _flat_mean((v - (noise - x0)) ** 2)
    w = {"uniform": torch.ones_like(t), "t": t, "t2": t**2}[weighting].to(err.dtype)
    return -w * err


def ema_decay(updates: int, rate: float, maximum: float) -> float:
    """The old model's EMA decay after ``updates`` updates: min(rate·updates, maximum)."""
    return min(rate * updates, maximum)
