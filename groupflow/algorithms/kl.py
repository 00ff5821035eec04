"""Per-action KL estimators to a reference policy, and entropy from logits.

Design decision: the KL estimators are per-token functions of the sampled action's log-probs only
(Schulman's k1/k2/k3 with delta = ref - logp), registered by name with verl's names as aliases; the
result is [B, T] and is aggregated by the caller exactly like the policy loss (same mode, same
global denominators), or subtracted from token rewards. Two conventions exist for the KL loss term
when the samples come from an older policy: verl (and groupflow by default) uses the estimate as
it is; TRL's ``use_bias_correction_kl`` (DeepSeek-V3.2) multiplies it by the importance ratio
pi/pi_old first (``importance_weighted_kl``; ``actor.kl_bias_correction``).

Entropy works on full logits, so it is computed in row chunks (with activation checkpointing under
autograd) to keep the float32 working set at chunk_size x V instead of B x T x V.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from groupflow.algorithms.policy_loss import importance_ratio
from groupflow.algorithms.registry import Registry

KLEstimator = Callable[[Tensor, Tensor], Tensor]
"""Signature: fn(logprobs [B,T], ref_logprobs [B,T]) -> per-token KL [B,T]."""

KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")

# verl clamps the log-ratio before exp and the k3 value afterwards; we follow it.
_K3_LOG_RATIO_CLAMP = 20.0
_K3_VALUE_CLAMP = 10.0


def register_kl_estimator(name: str, **kwargs):
    return KL_ESTIMATORS.register(name, **kwargs)


@register_kl_estimator("k1", aliases=("kl",))
def k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = -delta = logp - ref: unbiased, high variance, can be negative (verl 'kl')."""
    return logprobs - ref_logprobs


@register_kl_estimator("k2", aliases=("mse",))
def k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = delta^2 / 2 (verl 'mse')."""
    return 0.5 * (ref_logprobs - logprobs).square()


@register_kl_estimator("k3", aliases=("low_var_kl",))
def k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(delta) - delta - 1 >= 0 (verl 'low_var_kl', TRL's only form).

    delta is clamped to [-20, 20] before exp and the result to [-10, 10], as verl does.
    """
    delta = (ref_logprobs - logprobs).clamp(-_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)
    return (delta.exp() - delta - 1).clamp(-_K3_VALUE_CLAMP, _K3_VALUE_CLAMP)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL estimate [B, T] from the sampled actions' log-probs.

    kind: "k1" (alias "kl"), "k2" (alias "mse"), "k3" (alias "low_var_kl"), or a registered name.
    ref_logprobs is detached: the reference policy is never trained. Masked positions are not
    special here; aggregate with the mask.
    """
    fn = KL_ESTIMATORS.get(kind)
    if not isinstance(logprobs, Tensor) or not isinstance(ref_logprobs, Tensor):
        raise TypeError("logprobs and ref_logprobs must be torch.Tensor")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs and ref_logprobs must have the same shape, got "
            f"{tuple(logprobs.shape)} and {tuple(ref_logprobs.shape)}"
        )
    return fn(logprobs, ref_logprobs.detach())


def importance_weighted_kl(
    kl: Tensor,
    logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    *,
    ratio_level: str = "token",
    log_ratio_clamp: float = 20.0,
) -> Tensor:
    """``kl`` [B, T] times the importance ratio pi/pi_old (TRL ``use_bias_correction_kl``).

    The samples come from pi_old, so E_old[rho * k] is an unbiased estimate of E_pi[k] = KL(pi ||
    ref) for k3. The ratio carries gradient, as in TRL: d(rho k) = rho (dk + k dlog pi), i.e. even
    on-policy (rho = 1) the gradient gains the score-function term k dlog pi; for k3 the per-token
    gradient w.r.t. log pi becomes rho * (log pi - ref) instead of 1 - exp(ref - log pi).

    ratio_level: "token" (rho_t = exp(logp_t - old_t)) or "sequence" (GSPO: exp of the row's mean
    log-ratio over valid tokens, shared by its tokens), the policy loss's level. The log-ratio is
    clamped to +-log_ratio_clamp before exp; masked positions are never read.
    """
    for name, t in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("mask", mask)):
        if not isinstance(t, Tensor) or t.shape != kl.shape:
            raise ValueError(
                f"{name} must be a tensor shaped like kl {tuple(kl.shape)}, "
                f"got {getattr(t, 'shape', t)!r}"
            )
    ratio = importance_ratio(
        logprobs, old_logprobs.detach(), mask != 0, ratio_level, log_ratio_clamp
    )
    return kl * ratio


def upcast(x: Tensor) -> Tensor:
    """At least float32 (bf16/fp16 logits lose too much in log-softmax)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def map_row_chunks(fn: Callable[..., Tensor], *tensors: Tensor, chunk_size: int | None) -> Tensor:
    """Apply fn to row chunks of the 2-D `tensors[0]` (and matching rows of the others); concat.

    Under autograd each chunk is checkpointed, so backward recomputes the chunk's float32
    intermediates instead of storing them for all rows at once.
    """
    if chunk_size is None:
        return fn(*tensors)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    use_ckpt = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    outs = []
    for start in range(0, tensors[0].shape[0], chunk_size):
        parts = [t[start : start + chunk_size] for t in tensors]
        outs.append(checkpoint(fn, *parts, use_reentrant=False) if use_ckpt else fn(*parts))
    if not outs:
        return fn(*tensors)
    return torch.cat(outs, dim=0)


def _entropy_rows(logits: Tensor) -> Tensor:
    logp = torch.log_softmax(upcast(logits), dim=-1)
    # -sum p log p from log-probs directly (no lse - sum p z cancellation for large logits).
    # Tokens with p = 0 (logit -inf) must contribute 0, not 0 * -inf = NaN; zeroing log p
    # before the product (not after) keeps NaN out of the backward pass as well.
    finite_logp = torch.where(torch.isfinite(logp), logp, 0.0)
    return -(logp.exp() * finite_logp).sum(dim=-1)


def entropy_from_logits(logits: Tensor, chunk_size: int | None = None) -> Tensor:
    """Entropy of softmax(logits) over the last dim: logits [..., V] -> [...] (>= float32).

    chunk_size: process this many rows (positions) at a time; None = all at once.
    """
    if not isinstance(logits, Tensor) or logits.dim() < 1:
        raise ValueError("logits must be a tensor [..., V]")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    return map_row_chunks(_entropy_rows, flat, chunk_size=chunk_size).reshape(lead)
