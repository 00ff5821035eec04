import math

import pytest
import torch

from groupflow.algorithms.registry import UnknownNameError
from groupflow.diffusion.samplers import (
    dance_sde_step,
    flow_kl,
    flow_sde_step,
    gaussian_logprob,
    get_sampler,
    guided_velocity,
    ode_step,
    sample_trajectory,
)
from groupflow.diffusion.schedule import sigma_schedule


def _xv(b=3, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, d, generator=g), torch.randn(b, d, generator=g)


@pytest.mark.parametrize("step", [flow_sde_step, dance_sde_step])
def test_noise_level_zero_is_euler(step):
    x, v = _xv()
    s, s2 = torch.full((3,), 0.6), torch.full((3,), 0.4)
    mean, std = step(x, v, s, s2, noise_level=0.0)
    euler, _ = ode_step(x, v, s, s2)
    assert torch.allclose(mean, euler, atol=1e-7)
    assert torch.allclose(euler, x - 0.2 * v)
    assert bool((std == 0).all())


def test_flow_sde_step_matches_hand_formula_and_sigma_one_is_finite():
    x, v = _xv(1, 1)
    s, s2 = torch.tensor([0.5]), torch.tensor([0.3])
    a = 0.7
    g = a * math.sqrt(0.5 / 0.5)
    dt = -0.2
    expect = x * (1 + g**2 / (2 * 0.5) * dt) + v * (1 + g**2 * 0.5 / (2 * 0.5)) * dt
    mean, std = flow_sde_step(x, v, s, s2, noise_level=a)
    assert torch.allclose(mean, expect)
    assert std.item() == pytest.approx(g * math.sqrt(0.2))
    # σ = 1: the next σ replaces σ in the denominator, so g = a·sqrt(1 / (1 − 0.8)), finite
    mean1, std1 = flow_sde_step(x, v, torch.tensor([1.0]), torch.tensor([0.8]), noise_level=a)
    assert torch.isfinite(mean1).all() and torch.isfinite(std1).all()
    assert std1.item() == pytest.approx(a * math.sqrt(1 / 0.2) * math.sqrt(0.2))


def test_gaussian_logprob_is_the_mean_density_over_elements():
    mean = torch.zeros(2, 4)
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    std = torch.tensor([1.0, 2.0])
    lp = gaussian_logprob(x, mean, std)
    c = -0.5 * math.log(2 * math.pi)
    assert lp[0].item() == pytest.approx(c)
    assert lp[1].item() == pytest.approx(c - math.log(2) - 1 / 8)
    with pytest.raises(ValueError, match="std > 0"):
        gaussian_logprob(x, mean, torch.tensor([1.0, 0.0]))


def test_flow_kl_is_exact_gaussian_kl_times_dt():
    g = torch.Generator().manual_seed(1)
    m1, m2 = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    dt = torch.tensor([-0.1, -0.2, -0.05])
    std = torch.tensor([0.3, 0.5, 0.2])
    exact = torch.distributions.kl_divergence(
        torch.distributions.Normal(m1, std[:, None, None]),
        torch.distributions.Normal(m2, std[:, None, None]),
    ).mean((1, 2))
    assert torch.allclose(flow_kl(m1, m2, std, dt), exact * dt.abs(), atol=1e-6)
    assert bool((flow_kl(m1, m1, std, dt) == 0).all())


def _gaussian_velocity(mu: float, s: float):
    """Exact v(x, σ) = E[ε − x0 | x_σ] for data x0 ~ N(mu, s²) (elementwise)."""

    def v(x, sigma):
        sg = sigma[:, None]
        var = (1 - sg) ** 2 * s**2 + sg**2
        r = x - (1 - sg) * mu
        return sg / var * r - (mu + (1 - sg) * s**2 / var * r)

    return v


@pytest.mark.parametrize("sampler", ["flow_sde", "dance_sde", "ode"])
def test_samplers_preserve_the_marginals_of_gaussian_data(sampler):
    # With the exact velocity, every sampler must end at the data distribution N(mu, s²):
    # the SDEs add noise but their Langevin term keeps the flow's marginals (algorithms.md §7).
    mu, s, n, d = 0.7, 0.5, 2000, 8
    noise = torch.randn(n, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sigmas = sigma_schedule(100, shift=1.0).double()
    traj = sample_trajectory(
        _gaussian_velocity(mu, s),
        noise,
        sigmas,
        sampler,
        generators=torch.Generator().manual_seed(1),
    )
    x = traj.next_latents[:, -1]
    assert x.mean().item() == pytest.approx(mu, abs=0.03)
    assert x.std().item() == pytest.approx(s, abs=0.03)
    # an intermediate marginal: x at σ = 0.5 ~ N(0.5·mu, 0.25·s² + 0.25)
    mid = traj.next_latents[:, 49]
    assert traj.sigmas_next[0, 49].item() == pytest.approx(0.5)
    assert mid.mean().item() == pytest.approx(0.5 * mu, abs=0.03)
    assert mid.std().item() == pytest.approx(math.sqrt(0.25 * s**2 + 0.25), abs=0.03)


def test_unknown_sampler_lists_the_valid_ones():
    with pytest.raises(
        UnknownNameError, match="unknown sampler 'flow'; valid names: cps, dance_sde, flow_sde, ode"
    ):
        get_sampler("flow")


def test_trajectory_shapes_and_generators_required():
    x = torch.randn(2, 3, 4, 4)
    sigmas = sigma_schedule(3)
    traj = sample_trajectory(lambda x, s: -x, x, sigmas, "ode")
    assert traj.latents.shape == (2, 3, 3, 4, 4) and traj.logprobs.shape == (2, 3)
    assert torch.equal(traj.latents[:, 1:], traj.next_latents[:, :-1])
    assert torch.equal(traj.sigmas[0], sigmas[:-1]) and bool((traj.logprobs == 0).all())
    with pytest.raises(ValueError, match="needs one torch.Generator per sample"):
        sample_trajectory(lambda x, s: -x, x, sigmas, "flow_sde")
    with pytest.raises(ValueError, match="sigmas needs at least 2 entries, got 1"):
        sample_trajectory(lambda x, s: -x, x, sigmas[:1], "ode")


def test_dance_sde_decodes_the_last_x0_prediction():
    x = torch.randn(2, 3)
    sigmas = sigma_schedule(2)
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    v = torch.ones(2, 3)
    traj = sample_trajectory(lambda x, s: v, x, sigmas, "dance_sde", generators=gens)
    last_x, last_s = traj.latents[:, -1], traj.sigmas[:, -1]
    assert torch.allclose(traj.final, last_x - last_s[:, None] * v)


def test_guided_velocity_combines_cond_and_uncond():
    def model(x, sigma, cond):
        return x * cond["w"][:, None]

    x = torch.ones(2, 3)
    cond, null = {"w": torch.tensor([2.0, 3.0])}, {"w": torch.tensor([1.0, 1.0])}
    assert torch.equal(
        guided_velocity(model, x, torch.ones(2), cond, null, 1.0), x * torch.tensor([[2.0], [3.0]])
    )
    # v_u + 4·(v_c − v_u) = 1 + 4·(2 − 1) = 5 and 1 + 4·(3 − 1) = 9
    out = guided_velocity(model, x, torch.ones(2), cond, null, 4.0)
    assert torch.equal(out, torch.tensor([[5.0] * 3, [9.0] * 3]))
