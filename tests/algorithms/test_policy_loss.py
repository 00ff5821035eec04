import math

import pytest
import torch

from groupflow.algorithms import (
    POLICY_LOSSES,
    UnknownNameError,
    UnknownOptionError,
    policy_loss,
)

LN2 = math.log(2.0)
# Five one-token samples; log-ratios give ratios [2, 2, 4, 0.5, 0.5].
LOG_RATIO = torch.tensor([[LN2], [LN2], [2 * LN2], [-LN2], [-LN2]])
ADV = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0])
OLD = torch.full((5, 1), -1.0)
MASK = torch.ones(5, 1)


def per_token(logp=None, adv=ADV, mask=MASK, **opts):
    """Per-token losses from the registered ppo_clip (before aggregation)."""
    logp = OLD + LOG_RATIO if logp is None else logp
    adv2 = adv.unsqueeze(-1).expand_as(logp) if adv.dim() == 1 else adv
    loss, _ = POLICY_LOSSES.get("ppo_clip")(logp, OLD, adv2, mask != 0, **opts)
    return loss.flatten().tolist()


def test_clip_both_sides_and_dual_clip():
    # ratio 2, A=+1:  max(-2, -1.2)       = -1.2  (clipped high)
    # ratio 2, A=-1:  max(2, 1.2) = 2, dual min(2, 3) = 2
    # ratio 4, A=-1:  max(4, 1.2) = 4, dual min(4, 3) = 3
    # ratio .5, A=-1: max(.5, .8)         = 0.8   (clipped low)
    # ratio .5, A=+1: max(-.5, -.8)       = -0.5
    assert per_token() == pytest.approx([-1.2, 2.0, 3.0, 0.8, -0.5])


def test_dual_clip_disabled():
    assert per_token(clip_ratio_c=None) == pytest.approx([-1.2, 2.0, 4.0, 0.8, -0.5])
    assert per_token(clip_ratio_c=2.5) == pytest.approx([-1.2, 2.0, 2.5, 0.8, -0.5])


def test_clip_higher_asymmetric():
    # DAPO clip-higher: eps_high 0.28 -> ratio 2 with A>0 gives -1.28; low side unchanged
    assert per_token(clip_eps_high=0.28) == pytest.approx([-1.28, 2.0, 3.0, 0.8, -0.5])
    # eps_high None -> same as eps_low
    assert per_token(clip_eps_low=0.1, clip_eps_high=None) == pytest.approx(
        [-1.1, 2.0, 3.0, 0.9, -0.5]
    )


def test_delta_caps_unclipped_ratio():
    # delta 1.5: ratio 2, A=-1 -> max(1.5, 1.2) = 1.5; ratio 4, A=-1 -> 1.5 (< dual bound 3)
    assert per_token(delta=1.5) == pytest.approx([-1.2, 1.5, 1.5, 0.8, -0.5])


def test_aggregated_loss_metrics_and_gradient():
    logp = (OLD + LOG_RATIO).requires_grad_(True)
    loss, metrics = policy_loss(logp, OLD, ADV, MASK)
    assert loss.item() == pytest.approx((-1.2 + 2.0 + 3.0 + 0.8 - 0.5) / 5)
    assert metrics["clipfrac_high"].item() == pytest.approx(0.2)
    assert metrics["clipfrac_low"].item() == pytest.approx(0.2)
    assert metrics["clipfrac_dual"].item() == pytest.approx(0.2)
    assert metrics["ratio_mean"].item() == pytest.approx(1.8)
    assert metrics["ratio_max"].item() == pytest.approx(4.0)
    assert metrics["ratio_min"].item() == pytest.approx(0.5)
    assert metrics["approx_kl"].item() == pytest.approx(-2 * LN2 / 5)
    assert all(not v.requires_grad for v in metrics.values())
    loss.backward()
    # clipped tokens get no gradient; unclipped: -A * ratio / 5
    torch.testing.assert_close(logp.grad.flatten(), torch.tensor([0.0, 0.4, 0.0, 0.0, -0.1]))


def test_ratio_exactly_one_when_on_policy():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, -9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([1.0, -0.5])
    loss, metrics = policy_loss(logp, logp.detach(), adv, mask, agg="token_mean")
    # token_mean of -A over valid tokens: -(3 * 1 - 0.5) / 4
    assert loss.item() == pytest.approx(-0.625)
    assert metrics["ratio_min"].item() == 1.0 and metrics["ratio_max"].item() == 1.0
    assert metrics["approx_kl"].item() == 0.0
    assert metrics["clipfrac_low"].item() == 0.0 and metrics["clipfrac_high"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, -0.25, -0.25], [0.125, 0.0, 0.0]]))


def test_sequence_level_ratio_gspo():
    # sample 0: log-ratios [ln2, 0] -> rho = sqrt(2) > 1.2, A=+1 -> -1.2 on both tokens
    # sample 1: same ratios, A=-1 -> sqrt(2) on both tokens; masked 3rd token (log-ratio 100) ignored
    # sample 2: all masked, logp = -inf there -> must not produce NaN
    old = torch.zeros(3, 3)
    logp = torch.tensor([[LN2, 0.0, 100.0], [LN2, 0.0, 100.0], [-torch.inf] * 3])
    logp.requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [0, 0, 0]])
    adv = torch.tensor([1.0, -1.0, 0.5])
    loss, metrics = policy_loss(logp, old, adv, mask, ratio_level="sequence")
    s2 = math.sqrt(2.0)
    assert loss.item() == pytest.approx((2 * -1.2 + 2 * s2) / 4)
    assert metrics["ratio_max"].item() == pytest.approx(s2)
    assert metrics["clipfrac_high"].item() == pytest.approx(0.5)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    # d/dlogp_t of (2 tokens * rho) / 4 with rho = exp(mean of 2 log-ratios): rho / 4
    torch.testing.assert_close(
        logp.grad, torch.tensor([[0.0, 0.0, 0.0], [s2 / 4, s2 / 4, 0.0], [0.0, 0.0, 0.0]])
    )


def test_sequence_ratio_gradient_equals_verl_stop_gradient_form():
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 5, generator=g)
    logp = (old + 0.05 * torch.randn(4, 5, generator=g)).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    adv = torch.tensor([0.7, -1.1, 0.3, -0.2])
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        loss, _ = policy_loss(logp, old, adv, mask, ratio_level="sequence", agg=agg)
        (g_direct,) = torch.autograd.grad(loss, logp)
        # verl GSPO-token: log s_it = logp - sg(logp) + sg(mean log-ratio); token-level clipping
        m = mask.float()
        seq = ((logp - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)
        token_form = logp - logp.detach() + seq.detach()
        loss2, _ = policy_loss(token_form, torch.zeros_like(old), adv, mask, agg=agg)
        (g_verl,) = torch.autograd.grad(loss2, logp)
        torch.testing.assert_close(loss, loss2)
        torch.testing.assert_close(g_direct, g_verl)


def test_per_token_advantages():
    logp = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    loss, _ = policy_loss(logp, logp, adv, torch.ones(1, 3))
    assert loss.item() == pytest.approx(-(1.0 - 2.0 + 0.5) / 3)


def test_all_masked_batch_gives_zero_loss_and_neutral_metrics():
    logp = torch.full((2, 3), -torch.inf, requires_grad=True)
    loss, metrics = policy_loss(logp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3))
    assert loss.item() == 0.0
    assert metrics["ratio_mean"].item() == 1.0 and metrics["approx_kl"].item() == 0.0
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 3))


def test_global_denominators_pass_through():
    logp = torch.zeros(2, 2)
    loss, _ = policy_loss(logp, logp, torch.tensor([1.0, 1.0]), torch.ones(2, 2), num_tokens=8)
    assert loss.item() == pytest.approx(-4 / 8)


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "opts, match",
    [
        ({"clip_eps_low": 1.0}, "clip_eps_low"),
        ({"clip_eps_low": -0.1}, "clip_eps_low"),
        ({"clip_eps_high": -0.1}, "clip_eps_high"),
        ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
        ({"delta": 1.1}, "delta"),
        ({"ratio_level": "seq"}, "ratio_level"),
        ({"log_ratio_clamp": 0.0}, "log_ratio_clamp"),
    ],
)
def test_invalid_clip_options(opts, match):
    with pytest.raises(ValueError, match=match):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), **opts)


def test_unknown_option_and_names():
    x = torch.zeros(1, 2)
    with pytest.raises(UnknownOptionError, match="'clip_eps_hgih'.*did you mean 'clip_eps_high'"):
        policy_loss(x, x, torch.ones(1), torch.ones(1, 2), clip_eps_hgih=0.28)
    with pytest.raises(UnknownNameError, match="ppo_clip"):
        policy_loss(x, x, torch.ones(1), torch.ones(1, 2), loss_fn="ppo")
    with pytest.raises(UnknownNameError, match="seq_mean_token_mean"):
        policy_loss(x, x, torch.ones(1), torch.ones(1, 2), agg="seq-mean")


def test_mismatched_shapes():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(x, torch.zeros(2, 4), torch.ones(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        policy_loss(x, x, torch.ones(2), torch.ones(3, 3))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.ones(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        policy_loss(torch.zeros(3), torch.zeros(3), torch.ones(3), torch.ones(3))
