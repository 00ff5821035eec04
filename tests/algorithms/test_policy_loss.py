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


# --- CISPO, SAPO, VESPO by hand (the TRL comparison is test_policy_loss_trl.py) -------------


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_cispo_weights_logp_by_the_capped_detached_ratio():
    # ratios [2, 2, 4, .5, .5], cap 3 -> weights [2, 2, 3, .5, .5]; L = -w A logp, dL/dlogp = -w A
    logp = (OLD + LOG_RATIO).requires_grad_(True)
    w = torch.tensor([2.0, 2.0, 3.0, 0.5, 0.5])
    loss, metrics = policy_loss(logp, OLD, ADV, MASK, loss_fn="cispo", clip_ratio_max=3.0)
    lp = [-1 + LN2, -1 + LN2, -1 + 2 * LN2, -1 - LN2, -1 - LN2]
    expected = [-wi * a * li for wi, a, li in zip(w.tolist(), ADV.tolist(), lp)]
    assert loss.item() == pytest.approx(sum(expected) / 5)
    loss.backward()
    # every token keeps a gradient, the capped one at the cap (PPO would zero 3 of these 5)
    torch.testing.assert_close(logp.grad.flatten(), torch.tensor([-2.0, 2.0, 3.0, 0.5, -0.5]) / 5)
    assert metrics["cispo_clipfrac"].item() == 0.0  # the capped ratio 4 has A < 0
    _, m = policy_loss(logp, OLD, -ADV, MASK, loss_fn="cispo", clip_ratio_max=3.0)
    assert m["cispo_clipfrac"].item() == pytest.approx(0.2)
    assert m["ratio_max"].item() == pytest.approx(4.0)


def test_cispo_sequence_level_shares_one_capped_weight():
    # log-ratios [ln 4, 0] -> GSPO rho = 2, cap 1.5 -> weight 1.5 on both tokens, A = 1
    logp = torch.tensor([[-1.0 + 2 * LN2, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0]])
    loss, _ = policy_loss(
        logp, old, torch.tensor([1.0]), torch.ones(1, 2), loss_fn="cispo", ratio_level="sequence",
        clip_ratio_max=1.5,
    )  # fmt: skip
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.75, -0.75]]))


def test_sapo_soft_gate_by_hand():
    # L = -A (4/tau) sigmoid(tau (rho - 1)); tau = 1 where A > 0, 1.05 where A <= 0
    logp = (OLD + LOG_RATIO).requires_grad_(True)
    loss, metrics = policy_loss(logp, OLD, ADV, MASK, loss_fn="sapo")
    rho, adv = [2.0, 2.0, 4.0, 0.5, 0.5], ADV.tolist()
    tau = [1.0 if a > 0 else 1.05 for a in adv]
    gates = [4 / t * _sigmoid(t * (r - 1)) for r, t in zip(rho, tau)]
    assert loss.item() == pytest.approx(sum(-a * g for a, g in zip(adv, gates)) / 5)
    assert metrics["sapo_gate_mean"].item() == pytest.approx(sum(gates) / 5)
    loss.backward()
    # dL/dlogp = -A * 4 s (1 - s) * rho, s = sigmoid(tau (rho - 1))
    grads = []
    for r, t, a in zip(rho, tau, adv):
        s = _sigmoid(t * (r - 1))
        grads.append(-a * 4 * s * (1 - s) * r / 5)
    torch.testing.assert_close(logp.grad.flatten(), torch.tensor(grads))


def test_sapo_on_policy_is_the_plain_policy_gradient():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    adv = torch.tensor([1.5, -0.5])
    loss, _ = policy_loss(logp, logp.detach(), adv, torch.ones(2, 2), loss_fn="sapo")
    # value: -A 2/tau (sigmoid(0) = 1/2), gradient -A (4 * 1/4 * 1)
    assert loss.item() == pytest.approx((2 * -1.5 * 2 + 2 * 0.5 * 2 / 1.05) / 4)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.5, -1.5], [0.5, 0.5]]) / 4)


def test_vespo_gamma_weight_of_the_sequence_ratio_by_hand():
    # row 0: log-ratios [ln2, 0] + a masked 100 -> w = 2, A = +1: phi = e^3 2^2 e^-6 = 4 e^-3
    # row 1: log-ratios [ln2, -ln2] -> w = 1, A = -1: phi = e^2 1 e^-2 = 1
    # row 2: log-ratio [-ln2] -> w = 1/2, A = -1: phi = e^2 (1/2)^3 e^-1 = e / 8
    # row 3: A = 0 -> (k_pos, lambda_pos) chosen, but the loss is 0 anyway
    old = torch.full((4, 3), -1.0)
    lr = torch.tensor([[LN2, 0.0, 100.0], [LN2, -LN2, 0.0], [-LN2, 0.0, 0.0], [LN2, 0.0, 0.0]])
    logp = (old + lr).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -1.0, -1.0, 0.0])
    loss, metrics = policy_loss(logp, old, adv, mask, loss_fn="vespo")
    phi = [4 * math.exp(-3), 1.0, math.e / 8, 4 * math.exp(-3)]
    loss.backward()
    expected = torch.tensor(
        [[-phi[0], -phi[0], 0.0], [phi[1], phi[1], 0.0], [phi[2], 0.0, 0.0], [0.0, 0.0, 0.0]]
    )
    torch.testing.assert_close(logp.grad, expected / 8)  # token_mean over 8 valid tokens
    value = -phi[0] * (2 * -1 + LN2) + phi[1] * (-1 + LN2 - 1 - LN2) + phi[2] * (-1 - LN2)
    assert loss.item() == pytest.approx(value / 8)
    mean_phi = (2 * phi[0] + 2 * phi[1] + phi[2] + 3 * phi[3]) / 8
    assert metrics["vespo_phi_mean"].item() == pytest.approx(mean_phi)


def test_vespo_extreme_ratio_gives_zero_weight_not_nan():
    # w = e^20 (clamped): phi = exp(3 + 2*20 - 3 e^20) underflows to 0, no NaN, no gradient
    logp = torch.tensor([[30.0]], requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), loss_fn="vespo")
    loss.backward()
    assert loss.item() == 0.0 and logp.grad.item() == 0.0


@pytest.mark.parametrize("loss_fn", ["cispo", "sapo", "vespo"])
def test_new_losses_are_zero_advantage_inert_and_mask_safe(loss_fn):
    from groupflow.algorithms import zero_advantage_inert

    assert zero_advantage_inert(loss_fn)
    logp = torch.tensor([[-1.0, -torch.inf], [-0.5, -2.0]], requires_grad=True)
    mask = torch.tensor([[1, 0], [1, 1]])
    loss, _ = policy_loss(logp, torch.full((2, 2), -1.2), torch.tensor([0.0, 0.0]), mask,
                          loss_fn=loss_fn)  # fmt: skip
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(2, 2))


@pytest.mark.parametrize(
    "loss_fn, opts, match",
    [
        ("cispo", {"clip_ratio_max": 0.0}, "clip_ratio_max"),
        ("cispo", {"ratio_level": "seq"}, "ratio_level"),
        ("sapo", {"temperature_neg": 0.0}, "temperature"),
        ("vespo", {"lambda_pos": 0.0}, "lambda_pos"),
        ("vespo", {"k_neg": -1.0}, "k_neg"),
    ],
)
def test_invalid_new_loss_options(loss_fn, opts, match):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=match):
        policy_loss(x, x, torch.ones(1), torch.ones(1, 2), loss_fn=loss_fn, **opts)


def test_vespo_has_no_ratio_level_option():
    x = torch.zeros(1, 2)
    with pytest.raises(UnknownOptionError, match="ratio_level"):
        policy_loss(x, x, torch.ones(1), torch.ones(1, 2), loss_fn="vespo", ratio_level="sequence")


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
