"""SDE/ODE samplers for rectified-flow generators, with per-step Gaussian log-probs.

Design decision: a denoising step is a pure function ``(x, v, σ, σ') -> (mean, std)``; the
sampler draws ``x' = mean + std·z`` and the policy's "action log-prob" is the Gaussian density of
x' given (mean, std), **averaged** over all non-batch dimensions (algorithms.md §7). Training
recomputes ``mean`` from the stored (x, σ, σ') with the current model — the same function, so a
stored step's log-prob is reproduced exactly and the first on-policy ratio is 1. Gradients flow
through ``mean`` only; x' is data.

Conventions (SD3 / FLUX / Wan): x_σ = (1−σ)·x0 + σ·ε, the model predicts v = ε − x0, sampling runs
σ from 1 to 0, dt = σ' − σ < 0.

- ``flow_sde`` (Flow-GRPO, noise level a = 0.7): g = a·sqrt(σ/(1−σ)) (at σ = 1 the next σ is used
  in the denominator), mean = x·(1 + g²/(2σ)·dt) + v·(1 + g²(1−σ)/(2σ))·dt, std = g·sqrt(−dt).
- ``dance_sde`` (DanceGRPO, constant g = η = 0.3): mean = x + dt·v − ½η²·score·dt with
  score = −(x − (1−σ)·x0)/σ², std = η·sqrt(−dt); the image is the last step's x0 prediction.
- ``cps`` (coefficients-preserving sampling, Wang & Yu 2025; Flow-GRPO-Fast's sampler): with
  x̂0 = x − σ·v, x̂1 = x + (1−σ)·v and std = σ'·sin(aπ/2), mean = (1−σ')·x̂0 +
  sqrt(σ'² − std²)·x̂1, so x' keeps the flow's coefficients exactly ((1−σ') on data, σ' on noise,
  noise power split between x̂1 and fresh noise). Its log-prob is the reference's constant-free
  −‖x' − mean‖² (averaged), not a normalised Gaussian: the 1/(2·std²) factor, which explodes as
  σ' → 0, is dropped. The last step (σ' = 0) is deterministic (std 0) and never trained.
- ``ode`` (Euler, evaluation): mean = x + dt·v, std = 0; no log-probs.

MixGRPO (and Flow-GRPO-Fast's few stochastic steps) sample with the SDE on a window of steps and
with the ODE elsewhere: ``sample_trajectory(sde_steps=...)``, with the sliding window's position a
pure function of the training step (:func:`sde_window`).

Both SDEs are the reverse-time SDE whose marginals equal the flow's (the Langevin term ½g²·score
is what keeps them): tests check this on Gaussian data with the exact velocity. Classifier-free
guidance is one function used by sampling and training alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from groupflow.algorithms.registry import Registry

__all__ = [
    "SamplerSpec",
    "SAMPLERS",
    "get_sampler",
    "flow_sde_step",
    "dance_sde_step",
    "ode_step",
    "cps_step",
    "squared_error_logprob",
    "sde_window",
    "sde_step_mask",
    "gaussian_logprob",
    "flow_kl",
    "guided_velocity",
    "Trajectory",
    "sample_trajectory",
    "step_noise",
]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _b(t: Tensor, like: Tensor) -> Tensor:
    """[B] -> [B, 1, ..., 1] so per-sample scalars broadcast over a latent."""
    return t.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


def flow_sde_step(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, *, noise_level: float):
    """Flow-GRPO step. x, v: [B, ...]; sigma, sigma_next: [B]. Returns (mean [B, ...], std [B])."""
    dt = sigma_next - sigma
    # σ = 1 would divide by zero: Flow-GRPO uses the next σ there.
    denom = 1 - torch.where(sigma >= 1, sigma_next, sigma)
    g = noise_level * torch.sqrt(sigma / denom)
    s, d, gb = _b(sigma, x), _b(dt, x), _b(g, x)
    mean = x * (1 + gb**2 / (2 * s) * d) + v * (1 + gb**2 * (1 - s) / (2 * s)) * d
    return mean, g * torch.sqrt(-dt)


def dance_sde_step(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, *, noise_level: float):
    """DanceGRPO step with constant g = η = ``noise_level``. Returns (mean, std [B])."""
    dt = sigma_next - sigma
    s, d = _b(sigma, x), _b(dt, x)
    x0 = x - s * v
    score = -(x - (1 - s) * x0) / s**2
    mean = x + d * v - 0.5 * noise_level**2 * score * d
    return mean, noise_level * torch.sqrt(-dt)


def ode_step(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, *, noise_level: float = 0.0):
    """Euler step x' = x + (σ' − σ)·v (deterministic; std 0)."""
    return x + _b(sigma_next - sigma, x) * v, torch.zeros_like(sigma)


def cps_step(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, *, noise_level: float):
    """Coefficients-preserving step: std = σ'·sin(aπ/2); returns (mean, std [B])."""
    std = sigma_next * math.sin(noise_level * math.pi / 2)
    s, sn = _b(sigma, x), _b(sigma_next, x)
    x0, x1 = x - s * v, x + (1 - s) * v
    # clamp: σ'² − std² is ≥ 0 exactly but may round below 0 when sin(aπ/2) = 1
    keep = torch.sqrt((sn**2 - _b(std, x) ** 2).clamp_min(0))
    return (1 - sn) * x0 + keep * x1, std


def squared_error_logprob(x_next: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """CPS's log-prob up to a per-step constant: −‖x' − mean‖² averaged over non-batch dims [B]."""
    sq = -((x_next.detach() - mean) ** 2)
    return sq.reshape(sq.shape[0], -1).mean(1)


def sde_window(
    step: int, num_steps: int, size: int, shift_interval: int, stride: int, roll_back: bool
) -> tuple[int, int]:
    """MixGRPO's sliding window [start, start + size) of SDE steps at training step ``step``.

    The window starts at step 0 and moves ``stride`` steps every ``shift_interval`` training
    steps until it reaches the last start that still holds ``size`` steps (num_steps − size);
    there it stays, or with ``roll_back`` it starts over from 0. stride 0: a fixed window.
    """
    if not 1 <= size <= num_steps:
        raise ValueError(f"sde window size {size} must be in [1, num_steps={num_steps}]")
    last = num_steps - size
    moves = step // shift_interval
    if roll_back and stride > 0:
        start = (moves % (last // stride + 1)) * stride
    else:
        start = min(moves * stride, last)
    return start, start + size


def sde_step_mask(updates: int, num_steps: int, window: dict | None) -> Tensor | None:
    """[num_steps] bool: the steps sampled with the SDE after ``updates`` updates (MixGRPO's
    ``window``, :func:`sde_window`'s arguments), or None without a window (every step)."""
    if window is None:
        return None
    start, end = sde_window(updates, num_steps, **window)
    steps = torch.zeros(num_steps, dtype=torch.bool)
    steps[start:end] = True
    return steps


@dataclass(frozen=True)
class SamplerSpec:
    """A sampler: its step function, default noise level, and how the final image is read."""

    name: str
    step: Callable[..., tuple[Tensor, Tensor]]
    default_noise_level: float
    stochastic: bool
    image_from_x0_pred: bool  # DanceGRPO decodes the last step's x0 prediction
    logprob: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None  # None: Gaussian

    def step_logprob(self, x_next: Tensor, mean: Tensor, std: Tensor) -> Tensor:
        return (self.logprob or gaussian_logprob)(x_next, mean, std)

    def __call__(
        self, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, *, noise_level: float
    ):
        return self.step(x, v, sigma, sigma_next, noise_level=noise_level)


SAMPLERS: Registry[SamplerSpec] = Registry("sampler")
SAMPLERS.add("flow_sde", SamplerSpec("flow_sde", flow_sde_step, 0.7, True, False))
SAMPLERS.add("dance_sde", SamplerSpec("dance_sde", dance_sde_step, 0.3, True, True))
SAMPLERS.add("ode", SamplerSpec("ode", ode_step, 0.0, False, False))
SAMPLERS.add("cps", SamplerSpec("cps", cps_step, 0.7, True, False, squared_error_logprob))


def get_sampler(name: str) -> SamplerSpec:
    """The sampler ``name``; an unknown name raises listing the valid ones."""
    return SAMPLERS.get(name)


def gaussian_logprob(x_next: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """log N(x' | mean, std²) averaged over non-batch dims: [B]. std: [B] (> 0)."""
    if not bool((std > 0).all()):
        raise ValueError(
            "a step log-prob needs std > 0 (the ODE sampler and noise level 0 have none)"
        )
    sb = _b(std, mean)
    lp = -((x_next.detach() - mean) ** 2) / (2 * sb**2) - torch.log(sb) - _HALF_LOG_2PI
    return lp.reshape(lp.shape[0], -1).mean(1)


def flow_kl(mean: Tensor, ref_mean: Tensor, std: Tensor, dt: Tensor) -> Tensor:
    """Flow-GRPO's KL to the reference: ‖mean − mean_ref‖² / (2g²), averaged over non-batch dims.

    With std = g·sqrt(|dt|) this is the exact KL between the two step Gaussians times |dt|. [B]
    """
    sq = (mean - ref_mean.detach()) ** 2 / (2 * _b(std, mean) ** 2)
    return sq.reshape(sq.shape[0], -1).mean(1) * dt.abs()


def _cat_cond(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: torch.cat([a[k], b[k]]) for k in a}


def guided_velocity(
    model: Callable[..., Tensor],
    x: Tensor,
    sigma: Tensor,
    cond: Mapping[str, Tensor],
    null_cond: Mapping[str, Tensor] | None,
    scale: float,
) -> Tensor:
    """v = v_u + s·(v_c − v_u) with one batched forward; scale 1 (or no null condition) is plain v.

    Used by rollout and training alike, so the training forward reproduces the sampling one.
    """
    if scale == 1.0 or null_cond is None:
        return model(x, sigma, cond)
    v = model(torch.cat([x, x]), torch.cat([sigma, sigma]), _cat_cond(null_cond, cond))
    v_u, v_c = v.chunk(2)
    return v_u + scale * (v_c - v_u)


def step_noise(
    generators: list[torch.Generator] | torch.Generator, shape: tuple[int, ...], n: int
) -> Tensor:
    """[n, *shape] standard normal: one latent per sample from its own generator (so a sample's
    noise does not depend on its batch-mates), or all at once from a single generator."""
    if isinstance(generators, torch.Generator):
        return torch.randn((n, *shape), generator=generators)
    return torch.stack([torch.randn(shape, generator=g) for g in generators])


@dataclass
class Trajectory:
    """A sampled trajectory. latents / next_latents: [B, N, ...]; sigmas / sigmas_next / logprobs:
    [B, N]; final: [B, ...] the generated latent (x at σ = 0, or the last x0 prediction)."""

    latents: Tensor
    next_latents: Tensor
    sigmas: Tensor
    sigmas_next: Tensor
    logprobs: Tensor
    final: Tensor


def sample_trajectory(
    velocity: Callable[[Tensor, Tensor], Tensor],
    noise: Tensor,
    sigmas: Tensor,
    sampler: str,
    *,
    noise_level: float | None = None,
    generators: list[torch.Generator] | torch.Generator | None = None,
    sde_steps: Tensor | None = None,
) -> Trajectory:
    """Run ``sampler`` from ``noise`` [B, ...] over ``sigmas`` [N + 1]; ``velocity(x, σ[B])`` -> v.

    ``generators``: one per sample for the SDE noise (required for stochastic samplers), or one
    generator for the whole batch. ``sde_steps`` [N] bool: the steps sampled with ``sampler``;
    the others take a deterministic Euler (ODE) step with log-prob 0 (MixGRPO). None: all.
    """
    spec = get_sampler(sampler)
    level = spec.default_noise_level if noise_level is None else noise_level
    b, n = noise.shape[0], sigmas.numel() - 1
    if n < 1:
        raise ValueError(f"sample_trajectory: sigmas needs at least 2 entries, got {n + 1}")
    per_sample_ok = isinstance(generators, torch.Generator) or (
        generators is not None and len(generators) == b
    )
    if spec.stochastic and not per_sample_ok:
        raise ValueError(f"sampler '{sampler}' needs one torch.Generator per sample ({b})")
    x = noise
    xs, nexts, lps = [], [], []
    final = None
    for i in range(n):
        s = sigmas[i].expand(b).to(noise.device)
        s_next = sigmas[i + 1].expand(b).to(noise.device)
        v = velocity(x, s)
        sde = sde_steps is None or bool(sde_steps[i])
        step = spec.step if sde else ode_step
        mean, std = step(x, v, s, s_next, noise_level=level)
        if sde and spec.stochastic and level > 0:
            assert generators is not None  # per_sample_ok above
            z = step_noise(generators, tuple(x.shape[1:]), b).to(x.device, x.dtype)
            x_next = mean + _b(std, mean) * z
            lps.append(spec.step_logprob(x_next, mean, std))
        else:
            x_next = mean
            lps.append(torch.zeros(b, device=x.device))
        xs.append(x)
        nexts.append(x_next)
        if i == n - 1:
            final = x - _b(s, x) * v if spec.image_from_x0_pred else x_next
        x = x_next
    assert final is not None  # set at the last of n >= 1 steps
    return Trajectory(
        latents=torch.stack(xs, 1),
        next_latents=torch.stack(nexts, 1),
        sigmas=sigmas[:-1].expand(b, n).clone(),
        sigmas_next=sigmas[1:].expand(b, n).clone(),
        logprobs=torch.stack(lps, 1),
        final=final,
    )
