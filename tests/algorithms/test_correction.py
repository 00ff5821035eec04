import math

import pytest
import torch

from groupflow.algorithms import (
    decoupled_weights,
    logprob_mismatch,
    policy_loss,
    truncated_is_weights,
)


def test_tis_weights_hand_computed():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    rollout = torch.tensor([[-1.5, -1.0, -3.0]])
    w = truncated_is_weights(old, rollout, cap=2.0)
    # exp(0.5) = 1.6487 (< 2), exp(-1) = 0.3679, exp(2.5) = 12.18 -> capped at 2
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.5), math.exp(-1.0), 2.0]]))


def test_tis_weights_finite_when_engine_logprob_is_minus_inf():
    w = truncated_is_weights(torch.tensor([[-1.0]]), torch.tensor([[-math.inf]]), cap=5.0)
    assert w.item() == pytest.approx(5.0)


def test_tis_weights_carry_no_gradient():
    old = torch.zeros(1, 2, requires_grad=True)
    w = truncated_is_weights(old, torch.zeros(1, 2), cap=3.0)
    assert not w.requires_grad


@pytest.mark.parametrize("cap", [0, -1.0, math.inf, math.nan, "2"])
def test_tis_rejects_bad_cap(cap):
    with pytest.raises(ValueError, match="TIS cap"):
        truncated_is_weights(torch.zeros(1, 1), torch.zeros(1, 1), cap=cap)


def test_tis_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="rollout_logprobs must have the shape"):
        truncated_is_weights(torch.zeros(2, 3), torch.zeros(2, 2), cap=2.0)


def test_policy_loss_with_tis_scales_each_token_and_reports_weights():
    # ratio = 1 (logprobs == old), so ppo_clip's per-token loss is -A; TIS multiplies it by w.
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = logp.detach().clone()
    rollout = torch.tensor([[-1.0 - math.log(0.5), -2.0 - math.log(10.0)]])  # w = 0.5, 10 -> cap 4
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 2)
    loss, m = policy_loss(logp, old, adv, mask, rollout_logprobs=rollout, tis_cap=4.0)
    assert loss.item() == pytest.approx(-(0.5 + 4.0) / 2)
    assert m["tis_weight_mean"].item() == pytest.approx(2.25)
    assert m["tis_capped_frac"].item() == pytest.approx(0.5)
    loss.backward()
    # d/dlogp of -A * w * exp(logp - old) at ratio 1 = -A * w
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, -2.0]]))


def test_policy_loss_tis_ignores_masked_positions():
    logp = torch.tensor([[-1.0, -2.0]])
    rollout = torch.tensor([[-1.0, math.nan]])  # garbage at the masked position
    loss, m = policy_loss(
        logp,
        logp,
        torch.tensor([2.0]),
        torch.tensor([[1, 0]]),
        rollout_logprobs=rollout,
        tis_cap=2.0,
    )
    assert loss.item() == pytest.approx(-2.0)
    assert m["tis_weight_mean"].item() == pytest.approx(1.0)


def test_policy_loss_without_tis_is_unchanged_by_rollout_logprobs():
    logp = torch.tensor([[-1.0, -2.0]])
    a, _ = policy_loss(logp, logp, torch.tensor([1.0]), torch.ones(1, 2))
    b, m = policy_loss(logp, logp, torch.tensor([1.0]), torch.ones(1, 2), rollout_logprobs=logp - 5)
    assert a.item() == b.item()
    assert "tis_weight_mean" not in m


def test_policy_loss_tis_needs_rollout_logprobs():
    logp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="rollout_logprobs were not given"):
        policy_loss(logp, logp, torch.ones(1), torch.ones(1, 2), tis_cap=2.0)


def test_logprob_mismatch_over_masked_tokens_only():
    train = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    rollout = torch.tensor([[-1.1, -1.7, 9.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    m = logprob_mismatch(train, rollout, mask)
    assert m["max"] == pytest.approx(0.3)
    assert m["mean"] == pytest.approx((0.1 + 0.3 + 0.0) / 3)


def test_logprob_mismatch_empty_mask():
    assert logprob_mismatch(torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2)) == {
        "max": 0.0,
        "mean": 0.0,
    }


# ----- decoupled PPO (AReaL) ---------------------------------------------------------------------


def test_decoupled_weights_hand_computed_with_mask_above_cap():
    prox = torch.tensor([[-1.0, -2.0, -0.5]])
    behav = torch.tensor([[-1.5, -1.0, -3.0]])
    w = decoupled_weights(prox, behav, cap=2.0)
    # exp(0.5) = 1.6487 kept, exp(-1) = 0.3679 kept, exp(2.5) = 12.18 > 2 -> dropped (0, not 2)
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.5), math.exp(-1.0), 0.0]]))
    uncapped = decoupled_weights(prox, behav, cap=None)
    torch.testing.assert_close(uncapped[0, 2], torch.tensor(math.exp(2.5)))


def test_decoupled_weights_finite_when_behaviour_logprob_is_minus_inf():
    w = decoupled_weights(torch.tensor([[-1.0, -1.0]]), torch.tensor([[-math.inf, -1.0]]), None)
    assert w.tolist() == [[0.0, 1.0]]


@pytest.mark.parametrize("cap", [0, -1.0, math.inf, "2"])
def test_decoupled_rejects_bad_cap(cap):
    with pytest.raises(ValueError, match="decoupled PPO weight cap"):
        decoupled_weights(torch.zeros(1, 1), torch.zeros(1, 1), cap=cap)


def test_policy_loss_decoupled_clips_against_proximal_and_weights_by_behaviour():
    # proximal (old) = -1 for both tokens; current logp = -1 + 0.5: ratio e^0.5 = 1.6487 is
    # clipped at 1.2 for A = +1 (ppo_clip: max(-r A, -clip(r) A) = -1.2). Behaviour weights:
    # token 0 exp(-1 - (-1.5)) = e^0.5; token 1 exp(-1 - (-4)) = e^3 = 20.1 > cap 5 -> dropped.
    logp = torch.tensor([[-0.5, -0.5]], requires_grad=True)
    prox = torch.tensor([[-1.0, -1.0]])
    behav = torch.tensor([[-1.5, -4.0]])
    loss, m = policy_loss(
        logp, prox, torch.tensor([1.0]), torch.ones(1, 2), rollout_logprobs=behav,
        decoupled=True, behav_weight_cap=5.0, clip_eps_low=0.2,
    )  # fmt: skip
    assert loss.item() == pytest.approx(-(1.2 * math.exp(0.5) + 0.0) / 2)
    assert m["behav_weight_mean"].item() == pytest.approx(math.exp(0.5) / 2)
    assert m["behav_masked_frac"].item() == pytest.approx(0.5)
    # naive PPO (anchor = behaviour, no weight) gives a different value: the switch matters
    naive, _ = policy_loss(logp, behav, torch.tensor([1.0]), torch.ones(1, 2), clip_eps_low=0.2)
    assert naive.item() == pytest.approx(-1.2)


def test_policy_loss_decoupled_needs_behaviour_and_excludes_tis():
    logp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="needs the behaviour"):
        policy_loss(logp, logp, torch.ones(1), torch.ones(1, 2), decoupled=True)
    with pytest.raises(ValueError, match="exclusive"):
        policy_loss(logp, logp, torch.ones(1), torch.ones(1, 2), rollout_logprobs=logp,
                    decoupled=True, tis_cap=2.0)  # fmt: skip
