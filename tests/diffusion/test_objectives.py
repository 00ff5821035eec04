"""CPS, MixGRPO's window, GRPO-Guard and DiffusionNFT against hand-computed values."""

import math

import pytest
import torch

from groupflow.diffusion import objectives as obj
from groupflow.diffusion.samplers import (
    cps_step,
    gaussian_logprob,
    sample_trajectory,
    sde_window,
    squared_error_logprob,
)
from groupflow.diffusion.schedule import sigma_schedule


def test_cps_step_hand_computed():
    x, v = torch.tensor([[1.0]]), torch.tensor([[0.5]])
    mean, std = cps_step(x, v, torch.tensor([0.8]), torch.tensor([0.6]), noise_level=0.5)
    # std = 0.6·sin(π/4); x̂0 = 0.6, x̂1 = 1.1; mean = 0.4·0.6 + sqrt(0.36 − 0.18)·1.1
    assert std.item() == pytest.approx(0.6 * math.sqrt(0.5), abs=1e-7)
    assert mean.item() == pytest.approx(0.24 + math.sqrt(0.18) * 1.1, abs=1e-6)


def test_cps_preserves_the_flow_coefficients():
    # x_σ = (1−σ)·x0 + σ·x1 with the exact velocity x1 − x0: after the step the data coefficient
    # is (1 − σ') and the noise power σ'² (split between x1 and the fresh noise).
    x0, x1 = torch.randn(4, 6), torch.randn(4, 6)
    s, sn = torch.full((4,), 0.7), torch.full((4,), 0.4)
    x = (1 - s[:, None]) * x0 + s[:, None] * x1
    mean, std = cps_step(x, x1 - x0, s, sn, noise_level=0.7)
    keep = math.sqrt(0.4**2 - std[0].item() ** 2)
    assert torch.allclose(mean, 0.6 * x0 + keep * x1, atol=1e-6)
    assert keep**2 + std[0].item() ** 2 == pytest.approx(0.4**2)


def test_cps_last_step_is_deterministic_and_its_logprob_constant_free():
    x, v = torch.randn(2, 3), torch.randn(2, 3)
    mean, std = cps_step(x, v, torch.full((2,), 0.3), torch.zeros(2), noise_level=0.7)
    assert torch.equal(std, torch.zeros(2)) and torch.allclose(mean, x - 0.3 * v)
    lp = squared_error_logprob(torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 2.5]]), std[:1])
    assert lp.item() == pytest.approx(-0.25)


@pytest.mark.parametrize(
    "step, stride, roll_back, window",
    [
        (0, 1, False, (0, 4)), (24, 1, False, (0, 4)), (25, 1, False, (1, 5)),
        (150, 1, False, (6, 10)), (175, 1, False, (6, 10)),  # stays at the last start
        (150, 1, True, (6, 10)), (175, 1, True, (0, 4)),  # 7 starts, then over again
        (75, 2, True, (6, 10)), (100, 2, True, (0, 4)), (999, 0, False, (0, 4)),
    ],
)  # fmt: skip
def test_sde_window_slides_every_interval(step, stride, roll_back, window):
    assert sde_window(step, 10, 4, 25, stride, roll_back) == window


def test_sde_window_rejects_a_window_larger_than_the_schedule():
    with pytest.raises(ValueError, match="window size 5 must be in \\[1, num_steps=4\\]"):
        sde_window(0, 4, 5, 1, 1, False)


def test_mixed_sampling_is_ode_outside_the_window():
    sigmas = sigma_schedule(4, 1.0)
    sde = torch.tensor([False, True, True, False])
    noise = torch.randn(2, 3)
    velocity = lambda x, s: 0.5 * x  # noqa: E731
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    t = sample_trajectory(velocity, noise, sigmas, "flow_sde", generators=gens, sde_steps=sde)
    for i in (0, 3):  # Euler steps: x' = x + dt·v, log-prob 0
        dt = float(sigmas[i + 1] - sigmas[i])
        assert torch.allclose(t.next_latents[:, i], t.latents[:, i] * (1 + 0.5 * dt))
        assert bool((t.logprobs[:, i] == 0).all())
    assert bool((t.logprobs[:, 1:3] != 0).all())


def test_guard_bias_and_normalised_ratio_hand_computed():
    mean, old_mean = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.8, 2.2]])
    bias = obj.guard_bias(mean, old_mean, torch.tensor([0.5]))
    assert bias.item() == pytest.approx(0.04 / (2 * 0.25))  # 0.08
    lp = obj.guard_logprobs(torch.tensor([-1.0]), torch.tensor([-0.9]), bias, torch.tensor([0.5]))
    assert lp.item() == pytest.approx(-0.9 + (-0.1 + 0.08) * 0.5)  # ratio exp(−0.01)
    w = obj.guard_step_weights(torch.tensor([0.8]), torch.tensor([0.6]))
    assert w.item() == pytest.approx(5.0)


def test_guard_recentres_the_log_ratio_that_the_plain_one_shifts_left():
    g = torch.Generator().manual_seed(0)
    mu_old, std = torch.zeros(1, 64), torch.tensor([0.3])
    mu = mu_old + 0.1
    x = mu_old + std * torch.randn(20000, 64, generator=g)
    lr = gaussian_logprob(x, mu.expand_as(x), std.expand(20000)) - gaussian_logprob(
        x, mu_old.expand_as(x), std.expand(20000)
    )
    bias = obj.guard_bias(mu, mu_old, std)
    assert lr.mean().item() == pytest.approx(-bias.item(), rel=0.02)  # E[log r] = −b
    assert abs(((lr + bias) * std).mean().item()) < 2e-4


def test_nft_reward_weight_maps_clipped_advantages_to_unit_interval():
    a = torch.tensor([-10.0, -2.5, 0.0, 2.5, 10.0])
    assert obj.nft_reward_weight(a, 5.0).tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_nft_loss_hand_computed():
    x0, eps, t = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 2.0]]), torch.tensor([0.5])
    x_t = obj.nft_noised(x0, eps, t)
    assert x_t.tolist() == [[0.5, 1.0]]
    v, v_old = torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 1.0]])
    loss = obj.nft_loss(v, v_old, x_t, x0, t, torch.tensor([0.75]), beta=0.5, adv_clip_max=5.0)
    # v⁺ = (0.5, 1): x̂0 = (0.25, 0.5), mse 0.40625 / mean|err| 0.625 = 0.65
    # v⁻ = (1.5, 1): x̂0 = (−0.25, 0.5), mse 0.90625 / mean|err| 0.875
    expected = 5.0 * (0.75 * 0.65 + 0.25 * 0.90625 / 0.875) / 0.5
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_nft_gradient_pulls_towards_the_target_for_good_samples_and_away_for_bad():
    x0, eps, t = torch.randn(1, 8), torch.randn(1, 8), torch.tensor([0.6])
    x_t, target = obj.nft_noised(x0, eps, t), eps - x0
    v_old = target + 0.3 * torch.randn(1, 8)

    def step(r):
        v = v_old.clone().requires_grad_(True)
        obj.nft_loss(v, v_old, x_t, x0, t, torch.tensor([r]), beta=1.0, adv_clip_max=5.0).backward()
        return ((v - 1e-3 * v.grad - target) ** 2).sum() - ((v_old - target) ** 2).sum()

    assert step(1.0) < 0 < step(0.0)


def test_ema_decay_ramps_then_holds():
    assert [obj.ema_decay(k, 0.001, 0.5) for k in (0, 100, 1000)] == [0.0, 0.1, 0.5]


# ----- Flow-DPPO ------------------------------------------------------------------------------


def test_dppo_mask_drops_only_widening_updates_outside_the_trust_region():
    # columns: (ratio, A, KL) -> keep?
    ratio = torch.tensor([[1.5, 1.5, 0.5, 0.5, 1.5, 0.5, 1.0]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 1.0]])
    kl = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1e-6, 1e-6, 1.0]])
    keep = obj.dppo_keep_mask(ratio, adv, kl, threshold=1e-5)
    # widening & outside: (1.5, +) and (0.5, -) with KL 1 -> dropped; corrective ones, those
    # inside the region and ratio exactly 1 are kept
    assert keep.tolist() == [[False, True, False, True, True, True, True]]


def test_flow_dppo_loss_and_gradient_by_hand():
    logp = torch.tensor([[math.log(2.0), math.log(0.5)], [math.log(2.0), 0.0]], requires_grad=True)
    old = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -2.0])
    kl = torch.tensor([[1.0, 1.0], [1e-9, 1.0]])
    loss, parts = obj.flow_dppo_loss(logp, old, adv, kl, threshold=1e-5)
    # row 0 (A=+1): ratio 2 outside -> masked; ratio 0.5 -> kept, -A*rho = -0.5
    # row 1 (A=-2): ratio 2 inside -> kept, 4; ratio 1 -> kept (not widening), 2
    torch.testing.assert_close(loss, torch.tensor([[0.0, -0.5], [4.0, 2.0]]))
    assert parts["keep"].tolist() == [[False, True], [True, True]]
    loss.sum().backward()
    # d(-A rho)/dlogp = -A rho on kept entries, 0 on masked ones
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5], [4.0, 2.0]]))


def test_flow_dppo_on_policy_is_the_plain_policy_gradient_and_overflow_is_safe():
    logp = torch.tensor([[-1.0, 80.0]], requires_grad=True)
    loss, parts = obj.flow_dppo_loss(logp, torch.tensor([[-1.0, 0.0]]), torch.tensor([1.0]),
                                     torch.tensor([[0.0, 5.0]]), threshold=1e-5)  # fmt: skip
    assert loss[0, 0].item() == -1.0 and loss[0, 1].item() == 0.0  # e^80 masked: no inf*0 NaN
    loss.sum().backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 0].item() == -1.0
    with pytest.raises(ValueError, match="kl_mask_threshold"):
        obj.flow_dppo_loss(logp, logp.detach(), torch.ones(1), torch.zeros(1, 2), threshold=0.0)


def test_the_exact_step_kl_is_the_gaussian_kl_of_the_two_step_distributions():
    # KL(N(m_old, s²I) || N(m, s²I)) per element = (m - m_old)² / (2 s²); averaged over the latent
    mean, old_mean, std = (
        torch.tensor([[1.0, 3.0]]),
        torch.tensor([[0.0, 1.0]]),
        torch.tensor([2.0]),
    )
    kl = obj.guard_bias(mean, old_mean, std)
    assert kl.item() == pytest.approx(((1 + 4) / 2) / (2 * 4))
    p = torch.distributions.Normal(old_mean, std[:, None])
    q = torch.distributions.Normal(mean, std[:, None])
    assert kl.item() == pytest.approx(torch.distributions.kl_divergence(p, q).mean().item())


# ----- AWM ------------------------------------------------------------------------------------


@pytest.mark.parametrize("weighting, w", [("uniform", 1.0), ("t", 0.5), ("t2", 0.25)])
def test_awm_logprob_is_the_weighted_negative_flow_matching_error(weighting, w):
    x0, noise = torch.tensor([[1.0, -1.0]]), torch.tensor([[0.0, 1.0]])
    v = torch.tensor([[-1.0, 1.0]])  # target ε - x0 = [-1, 2]: errors [0, 1] -> mean 0.5
    lp = obj.awm_logprob(v, x0, noise, torch.tensor([0.5]), weighting)
    assert lp.item() == pytest.approx(-0.5 * w)


def test_awm_on_policy_gradient_is_the_advantage_weighted_matching_gradient():
    from groupflow.algorithms import policy_loss

    x0, noise, t = torch.randn(3, 4), torch.randn(3, 4), torch.tensor([0.2, 0.5, 0.9])
    v = torch.randn(3, 4, requires_grad=True)
    adv = torch.tensor([1.0, -0.5, 2.0])
    lp = obj.awm_logprob(v, x0, noise, t)
    loss, _ = policy_loss(
        lp[:, None], lp.detach()[:, None], adv, torch.ones(3, 1), clip_eps_low=1e-4
    )
    (g,) = torch.autograd.grad(loss, v)
    # ratio 1: d(-A·rho)/dv = -A·d(logp)/dv = A·2(v - (ε - x0))/D, over 3 samples (token_mean)
    expected = adv[:, None] * 2 * (v.detach() - (noise - x0)) / 4 / 3
    torch.testing.assert_close(g, expected)
    with pytest.raises(ValueError, match="unknown AWM weighting"):
        obj.awm_logprob(v, x0, noise, t, "sqrt")


def test_the_sde_step_mask_is_the_window_or_none():
    from groupflow.diffusion.samplers import sde_step_mask

    window = {"size": 2, "shift_interval": 1, "stride": 1, "roll_back": False}
    assert sde_step_mask(3, 6, None) is None
    assert sde_step_mask(3, 6, window).tolist() == [False, False, False, True, True, False]
