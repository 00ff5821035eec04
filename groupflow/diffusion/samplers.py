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
- ``ode`` (Euler, evaluation): mean = x + dt·v, std = 0; no log-probs.

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


@dataclass(frozen=True)
class SamplerSpec:
    """A sampler: its step function, default noise level, and how the final image is read."""

    name: str
    step: Callable[..., tuple[Tensor, Tensor]]
    default_noise_level: float
    stochastic: bool
    image_from_x0_pred: bool  # DanceGRPO decodes the last step's x0 prediction

    def __call__(
        self, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, *, noise_level: float
    ):
        return self.step(x, v, sigma, sigma_next, noise_level=noise_level)


SAMPLERS: Registry[SamplerSpec] = Registry("sampler")
SAMPLERS.add("flow_sde", SamplerSpec("flow_sde", flow_sde_step, 0.7, True, False))
SAMPLERS.add("dance_sde", SamplerSpec("dance_sde", dance_sde_step, 0.3, True, True))
SAMPLERS.add("ode", SamplerSpec("ode", ode_step, 0.0, False, False))


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
) -> Trajectory:
    """Run ``sampler`` from ``noise`` [B, ...] over ``sigmas`` [N + 1]; ``velocity(x, σ[B])`` -> v.

    ``generators``: one per sample for the SDE noise (required for stochastic samplers), or one
    generator for the whole batch.
    """
    spec = get_sampler(sampler)
    level = spec.default_noise_level if noise_level is None else noise_level
    b, n = noise.shape[0], sigmas.numel() - 1
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
        mean, std = spec.step(x, v, s, s_next, noise_level=level)
        if spec.stochastic and level > 0:
            z = step_noise(generators, tuple(x.shape[1:]), b).to(x.device, x.dtype)
            x_next = mean + _b(std, mean) * z
            lps.append(gaussian_logprob(x_next, mean, std))
        else:
            x_next = mean
            lps.append(torch.zeros(b, device=x.device))
        xs.append(x)
        nexts.append(x_next)
        if i == n - 1:
            final = x - _b(s, x) * v if spec.image_from_x0_pred else x_next
        x = x_next
    return Trajectory(
        latents=torch.stack(xs, 1),
        next_latents=torch.stack(nexts, 1),
        sigmas=sigmas[:-1].expand(b, n).clone(),
        sigmas_next=sigmas[1:].expand(b, n).clone(),
        logprobs=torch.stack(lps, 1),
        final=final,
    )
