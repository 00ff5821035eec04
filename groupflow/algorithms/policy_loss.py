"""Clipped policy-gradient losses per action, selected by name, aggregated by `aggregate`.

Design decision: a policy loss is a registered function from (logprobs, old_logprobs,
advantages, mask) to a per-action loss [B, T] plus metrics; `policy_loss` validates inputs,
broadcasts advantages, calls it, and reduces the result with the same aggregation modes and
global denominators as every other loss term. A new loss (e.g. CISPO) is one function and one
`@register_policy_loss` line; the trainer only passes `loss_fn=<name>`. Built in: ppo_clip
(token or sequence ratio, i.e. PPO/GRPO/DAPO/GSPO), cispo, sapo, vespo -- the last three written
to equal TRL 1.16's ``GRPOTrainer._compute_loss`` (tests/algorithms/test_policy_loss_trl.py).

old_logprobs and advantages are detached here: gradients flow through `logprobs` only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from groupflow.algorithms.aggregation import Number, aggregate
from groupflow.algorithms.correction import decoupled_weights, truncated_is_weights
from groupflow.algorithms.registry import Registry, check_options

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]
"""Signature: fn(logprobs [B,T], old_logprobs [B,T], advantages [B,T], valid [B,T] bool, *, <options>)
-> (per-action loss [B,T], metrics {name: 0-dim detached tensor}). old_logprobs and advantages
arrive detached and zeroed at invalid positions; options must be keyword-only."""

POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")

RATIO_LEVELS = ("token", "sequence")


# Losses whose per-action loss is A·f(ratio, ...): an action with advantage 0 has zero loss and
# zero gradient, so a trainer may leave such samples out of the forward/backward pass and get
# the same gradient (workers/actor.py does, with global denominators). Opt-in per loss, because
# a registered loss with an advantage-independent term (an entropy or KL term of its own) would
# silently lose it.
_ZERO_ADVANTAGE_INERT: set[str] = set()


def register_policy_loss(name: str, *, zero_advantage_inert: bool = False, **kwargs):
    """Decorator registering a policy loss; ``zero_advantage_inert=True`` declares that an action
    with advantage 0 contributes neither loss nor gradient (true of every A·f(ratio) loss)."""
    register = POLICY_LOSSES.register(name, **kwargs)

    def decorator(fn: PolicyLoss) -> PolicyLoss:
        register(fn)
        if zero_advantage_inert:
            _ZERO_ADVANTAGE_INERT.add(name)
        else:
            _ZERO_ADVANTAGE_INERT.discard(name)  # an override must declare it again
        return fn

    return decorator


def zero_advantage_inert(loss_fn: str) -> bool:
    """Whether samples whose advantages are all 0 can be skipped exactly under ``loss_fn``."""
    return POLICY_LOSSES.canonical(loss_fn) in _ZERO_ADVANTAGE_INERT


def masked_mean(x: Tensor, valid: Tensor) -> Tensor:
    """Mean of x over valid positions; 0 when there are none (no NaN, no host sync)."""
    n = valid.sum()
    return torch.where(valid, x, 0.0).sum() / n.clamp(min=1)


def _masked_extreme(x: Tensor, valid: Tensor, largest: bool, empty: float) -> Tensor:
    fill = -torch.inf if largest else torch.inf
    filled = torch.where(valid, x, fill)
    value = filled.max() if largest else filled.min()
    return torch.where(valid.any(), value, torch.full_like(value, empty))


def importance_ratio(
    logprobs: Tensor, old_logprobs: Tensor, valid: Tensor, ratio_level: str, log_ratio_clamp: float
) -> Tensor:
    """pi/pi_old [B, T]: per token, or (GSPO, "sequence") exp of the row's mean log-ratio over
    valid tokens, shared by its tokens (1 for a row without any). The log-ratio is clamped to
    +-log_ratio_clamp before exp; invalid positions are never read."""
    _check_level(ratio_level, log_ratio_clamp)
    log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0)
    if ratio_level == "sequence":
        count = valid.sum(dim=-1, keepdim=True).clamp(min=1)
        log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / count).expand_as(logprobs)
    return log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp).exp()


def _validate_ppo_options(eps_low, eps_high, clip_ratio_c, delta):
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"clip_eps_low must be in [0, 1), got {eps_low!r}")
    if not eps_high >= 0.0:
        raise ValueError(f"clip_eps_high must be >= 0 (or None = clip_eps_low), got {eps_high!r}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1 or None, got {clip_ratio_c!r}")
    if delta is not None and not delta > 1.0 + eps_high:
        raise ValueError(f"delta must be > 1 + clip_eps_high = {1.0 + eps_high}, got {delta!r}")


@register_policy_loss("ppo_clip", zero_advantage_inert=True)
def ppo_clip(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    valid: Tensor,
    *,
    ratio_level: str = "token",
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = 0.2,
    clip_ratio_c: float | None = 3.0,
    delta: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate, token- or sequence-level ratio, with dual clip and TRL's delta.

    L = max(-A * min(rho, delta), -A * clip(rho, 1 - eps_low, 1 + eps_high)); for A < 0 also
    L = min(L, -c * A) (verl dual clip, c = clip_ratio_c). The log-ratio is clamped to
    +-log_ratio_clamp before exp (verl: 20).

    ratio_level="sequence" (GSPO): rho_i = exp(sum_t m (logp - old) / sum_t m), shared by every
    token of sample i (a sample without valid tokens gets rho = 1). We differentiate this ratio
    directly (as TRL does); verl's stop-gradient "GSPO-token" form has the same value and, with
    per-sample advantages and any of our aggregation modes, the same gradient.

    Clip fractions (over valid tokens): clipfrac_low = rho < 1 - eps_low with A < 0,
    clipfrac_high = rho > 1 + eps_high with A > 0 (the regions where clipping zeroes the
    gradient, TRL's definition), clipfrac_dual = the dual clip is active (A < 0, -c*A < L).
    """
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    _validate_ppo_options(clip_eps_low, eps_high, clip_ratio_c, delta)

    ratio = importance_ratio(logprobs, old_logprobs, valid, ratio_level, log_ratio_clamp)

    unclipped_ratio = ratio if delta is None else ratio.clamp(max=delta)
    loss_unclipped = -advantages * unclipped_ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_eps_low, 1.0 + eps_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    negative = advantages < 0
    dual_active = torch.zeros_like(valid)
    if clip_ratio_c is not None:
        dual_bound = -clip_ratio_c * advantages
        dual_active = negative & (loss > dual_bound)
        loss = torch.where(negative, torch.minimum(loss, dual_bound), loss)

    with torch.no_grad():
        r = ratio.detach()
        metrics = {
            "clipfrac_low": masked_mean(((r < 1.0 - clip_eps_low) & negative).float(), valid),
            "clipfrac_high": masked_mean(((r > 1.0 + eps_high) & (advantages > 0)).float(), valid),
            "clipfrac_dual": masked_mean(dual_active.float(), valid),
            **_ratio_stats(r, valid),
        }
    return loss, metrics


def _ratio_stats(ratio: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """ratio_mean/max/min over valid tokens (1 when there are none), as ppo_clip reports them."""
    r = ratio.detach()
    return {
        "ratio_mean": _mean_or_one(r, valid),
        "ratio_max": _masked_extreme(r, valid, largest=True, empty=1.0),
        "ratio_min": _masked_extreme(r, valid, largest=False, empty=1.0),
    }


def _mean_or_one(x: Tensor, valid: Tensor) -> Tensor:
    """Mean of a ratio or weight over valid tokens; 1 (the neutral value) when there are none."""
    return torch.where(valid.any(), masked_mean(x, valid), 1.0)


def _check_level(ratio_level: str, log_ratio_clamp: float) -> None:
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; valid: {', '.join(RATIO_LEVELS)}")
    if not log_ratio_clamp > 0:
        raise ValueError(f"log_ratio_clamp must be > 0, got {log_ratio_clamp!r}")


@register_policy_loss("cispo", zero_advantage_inert=True)
def cispo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    valid: Tensor,
    *,
    ratio_level: str = "token",
    clip_ratio_max: float = 5.0,
    log_ratio_clamp: float = 20.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update.

    L = -sg(min(rho, clip_ratio_max)) * A * logp: REINFORCE weighted by the capped, detached
    ratio, so every token keeps a gradient (PPO's clip zeroes it outside the trust region).
    clip_ratio_max is the cap on rho itself (TRL's ``epsilon_high`` under ``loss_type="cispo"``,
    ScaleRL's eps_max; both recommend 5.0, our default). TRL's own default leaves epsilon_high
    unset, which makes the cap its ``epsilon`` = 0.2: every on-policy token's weight is then 0.2.
    Pass clip_ratio_max=0.2 to reproduce that. ratio_level "sequence" shares the GSPO ratio.

    Metric cispo_clipfrac: share of valid tokens with rho > clip_ratio_max and A > 0 (TRL's).
    """
    if not clip_ratio_max > 0:
        raise ValueError(f"clip_ratio_max must be > 0, got {clip_ratio_max!r}")
    ratio = importance_ratio(logprobs, old_logprobs, valid, ratio_level, log_ratio_clamp)
    weight = ratio.clamp(max=clip_ratio_max).detach()
    loss = -weight * advantages * logprobs
    with torch.no_grad():
        capped = (ratio > clip_ratio_max) & (advantages > 0)
        metrics = {
            "cispo_clipfrac": masked_mean(capped.float(), valid),
            **_ratio_stats(ratio, valid),
        }
    return loss, metrics


@register_policy_loss("sapo", zero_advantage_inert=True)
def sapo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    valid: Tensor,
    *,
    ratio_level: str = "token",
    temperature_pos: float = 1.0,
    temperature_neg: float = 1.05,
    log_ratio_clamp: float = 20.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347): a smooth gate instead of a clip.

    L = -A * (4 / tau) * sigmoid(tau * (rho - 1)), tau = temperature_pos where A > 0, else
    temperature_neg (TRL's defaults 1.0 / 1.05). The gradient is -A * 4 s(1 - s) * rho * dlogp
    with s the sigmoid: exactly the policy gradient at rho = 1, decaying smoothly away from it.
    TRL pairs it with its "grpo" aggregation (our seq_mean_token_mean); any agg works here.
    """
    if not (temperature_pos > 0 and temperature_neg > 0):
        raise ValueError(
            f"temperature_pos and temperature_neg must be > 0, got {temperature_pos!r}, "
            f"{temperature_neg!r}"
        )
    ratio = importance_ratio(logprobs, old_logprobs, valid, ratio_level, log_ratio_clamp)
    tau = torch.where(advantages > 0, temperature_pos, temperature_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    loss = -gate * advantages
    with torch.no_grad():
        metrics = {
            "sapo_gate_mean": masked_mean(gate.detach(), valid),
            **_ratio_stats(ratio, valid),
        }
    return loss, metrics


_VESPO_LOG_W_MIN = math.log(1e-8)  # the reference implementation clamps w at 1e-8


@register_policy_loss("vespo", zero_advantage_inert=True)
def vespo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    valid: Tensor,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """VESPO: REINFORCE weighted by a gamma-shaped function of the SEQUENCE importance weight.

    w_i = exp(clamp(sum_t m (clamp(logp - old, +-20)), log 1e-8, 20)) (a product, not GSPO's
    geometric mean), phi(w) = exp(lambda + k log w - lambda w) = e^lambda w^k e^(-lambda w)
    (phi(1) = 1; (k, lambda) = (k_pos, lambda_pos) where A >= 0, else (k_neg, lambda_neg); TRL's
    defaults 2, 3, 3, 2; lambda floored at 1e-4), detached; L = -phi * A * logp. Small w (k) and
    large w (lambda) are both damped smoothly. The weight is sequence-level by construction, so
    there is no ratio_level; with per-token advantages the (k, lambda) choice follows each
    token's sign. As in TRL, non-finite phi becomes 0.

    Metric vespo_phi_mean: phi averaged over valid tokens.
    """
    for name, v in (("k_pos", k_pos), ("k_neg", k_neg)):
        if not v >= 0:
            raise ValueError(f"{name} must be >= 0, got {v!r}")
    for name, v in (("lambda_pos", lambda_pos), ("lambda_neg", lambda_neg)):
        if not v > 0:
            raise ValueError(f"{name} must be > 0, got {v!r}")
    with torch.no_grad():
        log_ratio = torch.where(valid, (logprobs - old_logprobs).clamp(-20.0, 20.0), 0.0)
        log_w = log_ratio.sum(dim=-1, keepdim=True).clamp(_VESPO_LOG_W_MIN, 20.0)
        nonneg = advantages >= 0
        k = torch.where(nonneg, k_pos, k_neg).to(log_w.dtype)
        lam = torch.where(nonneg, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(0.0, 0.0, 0.0)
    loss = -phi * advantages * logprobs
    with torch.no_grad():
        ratio = torch.where(valid, (logprobs - old_logprobs).exp(), 1.0)
        metrics = {"vespo_phi_mean": masked_mean(phi, valid), **_ratio_stats(ratio, valid)}
    return loss, metrics


def _validate_inputs(logprobs, old_logprobs, advantages, mask) -> None:
    named = (
        ("logprobs", logprobs),
        ("old_logprobs", old_logprobs),
        ("advantages", advantages),
        ("mask", mask),
    )
    for name, t in named:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("mask", mask)):
        if t.shape != logprobs.shape:
            raise ValueError(
                f"{name} must have the shape of logprobs {tuple(logprobs.shape)}, got {tuple(t.shape)}"
            )
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages must be [B] = {tuple(logprobs.shape[:1])} or [B, T] = "
            f"{tuple(logprobs.shape)}, got {tuple(advantages.shape)}"
        )


def _off_policy_weights(
    old: Tensor,
    rollout_logprobs: Tensor | None,
    valid: Tensor,
    tis_cap: float | None,
    decoupled: bool,
    behav_weight_cap: float | None,
) -> tuple[Tensor, dict[str, Tensor]] | None:
    """Per-action loss weights [B, T] of the off-policy correction and their metrics: truncated IS
    (``tis_cap``) or decoupled PPO (``decoupled``), both from the behaviour log-probs; None for
    neither. No gradient flows through them: ``old`` and the behaviour log-probs are detached."""
    if tis_cap is None and not decoupled:
        return None
    if rollout_logprobs is None:
        raise ValueError(
            "tis_cap is set but rollout_logprobs were not given"
            if tis_cap is not None
            else "decoupled PPO needs the behaviour (rollout) log-probs"
        )
    if decoupled and tis_cap is not None:
        raise ValueError("decoupled PPO and truncated IS (tis_cap) are exclusive corrections")
    behaviour = torch.where(valid, rollout_logprobs.detach().to(old.dtype), 0.0)
    if tis_cap is not None:
        weights = truncated_is_weights(old, behaviour, tis_cap)
        names, dropped = ("tis_weight_mean", "tis_capped_frac"), weights >= tis_cap
    else:
        weights = decoupled_weights(old, behaviour, behav_weight_cap)
        names, dropped = ("behav_weight_mean", "behav_masked_frac"), weights == 0
    with torch.no_grad():
        metrics = {
            names[0]: _mean_or_one(weights, valid),
            names[1]: masked_mean(dropped.float(), valid),
        }
    return weights, metrics


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_fn: str = "ppo_clip",
    agg: str = "token_mean",
    num_tokens: Number | None = None,
    num_seqs: Number | None = None,
    max_len: Number | None = None,
    num_micro_batches: Number | None = None,
    rollout_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
    decoupled: bool = False,
    behav_weight_cap: float | None = None,
    **opts,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Aggregated policy-gradient loss and metrics.

    Args:
        logprobs: [B, T] current policy log-probs of the taken actions (with grad).
        old_logprobs: [B, T] sampling policy's log-probs (detached here).
        advantages: [B] (broadcast over actions) or [B, T] (detached here).
        mask: [B, T] bool or 0/1; 1 on actions that count.
        loss_fn: a name in POLICY_LOSSES ("ppo_clip" or a registered one).
        agg, num_tokens, num_seqs, max_len, num_micro_batches: aggregation mode and the
            mini-batch-global denominators, see `groupflow.algorithms.aggregation` (pass the same
            for every micro-batch and SUM the micro-batch losses).
        rollout_logprobs, tis_cap: truncated importance sampling (``groupflow.algorithms.
            correction``): with ``tis_cap`` set, each action's loss is multiplied by
            ``min(exp(old_logprobs - rollout_logprobs), tis_cap)`` (no gradient through it), for
            engines whose sampling log-probs differ from the training forward (vLLM).
        decoupled, behav_weight_cap: decoupled PPO (AReaL; ``correction.decoupled_weights``):
            ``old_logprobs`` are the proximal policy's, ``rollout_logprobs`` the behaviour
            policy's; each action's loss is multiplied by ``exp(old - rollout)``, 0 above the cap.
        **opts: options of the loss function (ppo_clip: ratio_level, clip_eps_low, clip_eps_high,
            clip_ratio_c, delta, log_ratio_clamp; cispo: ratio_level, clip_ratio_max; sapo:
            ratio_level, temperature_pos, temperature_neg; vespo: k_pos, lambda_pos, k_neg,
            lambda_neg); unknown ones raise.

    Returns:
        (scalar loss, metrics) with metrics as 0-dim detached tensors averaged over the valid
        tokens of THIS call: clipfrac_low/high/dual, approx_kl (= mean of old - logp),
        ratio_mean/max/min (ratio stats are 1 when there are no valid tokens); with TIS also
        tis_weight_mean and tis_capped_frac (share of tokens whose weight hit the cap).

    Note (TRL's "the loss is ~0" surprise): with one optimizer step per rollout batch (mu = 1,
    one mini-batch) `old_logprobs` may be `logprobs.detach()`; then ratio == 1 exactly, the
    gradient is the plain policy gradient, and the loss VALUE equals -aggregate(A), which is ~0
    because group-normalised advantages average to zero. A near-zero logged loss is therefore
    expected and does not mean nothing is learned; watch rewards, KL and clip fractions instead.
    """
    fn = POLICY_LOSSES.get(loss_fn)
    check_options(fn, opts, what=f"policy loss {loss_fn!r}")
    _validate_inputs(logprobs, old_logprobs, advantages, mask)
    valid = mask != 0
    old = old_logprobs.detach().to(logprobs.dtype)
    adv = advantages.detach().to(logprobs.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand_as(logprobs)
    # Zero the inputs at invalid positions: a NaN/inf there (padding) would otherwise poison the
    # backward pass through torch.where.
    old = torch.where(valid, old, 0.0)
    adv = torch.where(valid, adv, 0.0)
    safe_logprobs = torch.where(valid, logprobs, 0.0)

    per_token, metrics = fn(safe_logprobs, old, adv, valid, **opts)
    correction = _off_policy_weights(
        old, rollout_logprobs, valid, tis_cap, decoupled, behav_weight_cap
    )
    if correction is not None:
        weights, weight_metrics = correction
        per_token = per_token * weights
        metrics = {**metrics, **weight_metrics}
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
        metrics = {**metrics, "approx_kl": masked_mean(old - safe_logprobs.detach(), valid)}
    return loss, metrics
