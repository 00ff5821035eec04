"""The shifted sigma schedule of rectified-flow samplers (SD3 / FLUX / Wan conventions).

Design decision: one pure function. Sampling runs sigma from 1 (pure noise) to 0 (data) over N
steps; the shift s bends the uniform grid towards high noise, σ ↦ s·σ / (1 + (s − 1)·σ), which is
what diffusers' FlowMatchEulerDiscreteScheduler does with ``shift`` (s = 3 is typical; s = 1 is the
uniform grid). The schedule is float64 internally so the last step lands exactly on 0.
"""

from __future__ import annotations

import math

import torch

__all__ = ["sigma_schedule", "shift_sigmas", "flux_shift", "flux2_shift"]


def flux_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """FLUX's image-size-dependent shift: exp(μ), μ linear in the packed token count from
    ``base_shift`` at ``base_seq_len`` to ``max_shift`` at ``max_seq_len`` (FluxPipeline's
    ``calculate_shift`` with its scheduler's defaults). The scheduler's exponential time shift
    e^μ / (e^μ + 1/σ − 1) is :func:`shift_sigmas` with s = e^μ."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return math.exp(slope * image_seq_len + base_shift - slope * base_seq_len)


def flux2_shift(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's shift: exp(μ) of Flux2Pipeline's ``compute_empirical_mu`` — μ fitted as linear in
    the token count at 10 and at 200 steps and interpolated linearly in the step count between
    them (above 4300 tokens the 200-step line alone)."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    m_200 = a2 * image_seq_len + b2
    if image_seq_len > 4300:
        return math.exp(m_200)
    m_10 = a1 * image_seq_len + b1
    slope = (m_200 - m_10) / 190.0
    return math.exp(slope * num_steps + m_200 - 200.0 * slope)


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """σ ↦ s·σ / (1 + (s − 1)·σ); keeps 0 and 1 fixed and is monotone for s > 0."""
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def sigma_schedule(num_steps: int, shift: float = 3.0) -> torch.Tensor:
    """[num_steps + 1] float32 sigmas from exactly 1 down to exactly 0 (step i goes σ_i → σ_{i+1})."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    grid = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return shift_sigmas(grid, shift).to(torch.float32)
