"""Reward placement on the last valid token and the KL penalty in the reward (hand-computed)."""

import math

import pytest
import torch

from groupflow.algorithms import compute_gae, kl_in_reward, place_outcome_reward, sequence_mean_kl


def test_outcome_reward_goes_on_last_valid_token():
    rewards = torch.tensor([2.0, -1.0, 0.5])
    # row 1 has a masked token inside its response; row 2 has no valid token at all
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    out = place_outcome_reward(rewards, mask)
    expected = torch.tensor([[0.0, 0.0, 2.0, 0.0], [0.0, 0.0, -1.0, 0.0], [0.0] * 4])
    torch.testing.assert_close(out, expected)


def test_outcome_reward_on_full_width_row():
    out = place_outcome_reward(torch.tensor([3.0]), torch.ones(1, 3, dtype=torch.bool))
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 3.0]]))


def test_placement_bad_input():
    with pytest.raises(ValueError, match="rewards must be a 1-D"):
        place_outcome_reward(torch.zeros(2, 2), torch.ones(2, 2))
    with pytest.raises(ValueError, match="3 samples but mask has 2 rows"):
        place_outcome_reward(torch.zeros(3), torch.ones(2, 2))


def test_kl_in_reward_k1_and_masked_token_untouched():
    token_rewards = torch.tensor([[0.0, 1.0, 7.0]])
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    ref = torch.tensor([[-1.5, -1.0, -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    out, kl = kl_in_reward(token_rewards, logp, ref, mask, coef=0.1, kind="k1")
    # k1 = logp - ref = [0.5, -1.0]; rewards - 0.1 * k1
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0, 0.0]]))
    torch.testing.assert_close(out, torch.tensor([[-0.05, 1.1, 7.0]]))
    # batch mean of per-sample token-mean KL: (0.5 - 1.0) / 2
    assert float(sequence_mean_kl(kl, mask)) == pytest.approx(-0.25)


def test_kl_in_reward_k3_and_k2():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2)
    _, kl3 = kl_in_reward(torch.zeros(1, 2), logp, ref, mask, coef=1.0, kind="low_var_kl")
    # delta = ref - logp = [-0.5, 1.0]; k3 = e^delta - delta - 1
    expected = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 2.0]
    torch.testing.assert_close(kl3, torch.tensor([expected]))
    out, kl2 = kl_in_reward(torch.zeros(1, 2), logp, ref, mask, coef=2.0, kind="k2")
    torch.testing.assert_close(kl2, torch.tensor([[0.125, 0.5]]))
    torch.testing.assert_close(out, torch.tensor([[-0.25, -1.0]]))


def test_kl_in_reward_bad_input():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="KL coefficient must be >= 0"):
        kl_in_reward(z, z, z, z, coef=-1.0)
    with pytest.raises(ValueError, match="logprobs has shape"):
        kl_in_reward(z, torch.zeros(1, 3), z, z, coef=0.1)
    with pytest.raises(Exception, match="k4"):
        kl_in_reward(z, z, z, z, coef=0.1, kind="k4")


def test_placed_reward_with_kl_through_gae():
    # One sample, 3 valid tokens + 1 padding, outcome reward 1 and k1 KL penalty 0.1 * [0.2, 0, -0.1]:
    # token rewards = [-0.02, 0, 1.01, 0]. gamma = 1, lam = 1, values 0: advantages = reward to go.
    mask = torch.tensor([[1, 1, 1, 0]])
    placed = place_outcome_reward(torch.tensor([1.0]), mask)
    logp = torch.tensor([[-1.0, -1.0, -1.0, 0.0]])
    ref = torch.tensor([[-1.2, -1.0, -0.9, 0.0]])
    rewards, _ = kl_in_reward(placed, logp, ref, mask, coef=0.1, kind="k1")
    adv, ret = compute_gae(rewards, torch.zeros(1, 4), mask, gamma=1.0, lam=1.0, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.99, 1.01, 1.01, 0.0]]))
    torch.testing.assert_close(ret, adv)
