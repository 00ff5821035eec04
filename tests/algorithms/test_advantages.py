import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from groupflow.algorithms import (
    ADVANTAGE_ESTIMATORS,
    UnknownNameError,
    UnknownOptionError,
    compute_advantages,
    compute_gae,
)

# Shuffled, non-contiguous group ids with unequal sizes:
#   group 7  -> samples 0, 2, 5 with rewards 1.0, 0.0, 0.5  (mean 0.5, unbiased std 0.5)
#   group 3  -> samples 1, 4    with rewards 2.0, 0.0       (mean 1.0, unbiased std sqrt(2))
#   group 5  -> samples 3, 7    with rewards 0.3, 0.3       (constant -> 0)
#   group -2 -> sample 6        with reward 4.0             (singleton -> 0)
REWARDS = torch.tensor([1.0, 2.0, 0.0, 0.3, 0.0, 0.5, 4.0, 0.3])
GROUPS = torch.tensor([7, 3, 7, 5, 3, 7, -2, 5])
INV_SQRT2 = 0.7071067811865476


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(
        actual, torch.tensor(expected, dtype=torch.float32), atol=tol, rtol=0
    )


def test_grpo_group_scale_hand_computed():
    adv = compute_advantages(REWARDS, GROUPS, "grpo", eps=0.0)
    assert adv.dtype == torch.float32
    close(adv, [1.0, INV_SQRT2, -1.0, 0.0, -INV_SQRT2, 0.0, 0.0, 0.0])


def test_grpo_default_eps_is_verl_1e_6():
    adv = compute_advantages(REWARDS, GROUPS)
    # 0.5 / (0.5 + 1e-6) and 1 / (sqrt(2) + 1e-6)
    close(adv[:2], [0.999998000004, 0.7071062811870476])


def test_grpo_trl_eps_1e_4():
    adv = compute_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), eps=1e-4)
    # 0.5 / (sqrt(0.5) + 1e-4) = 0.5 / 0.7072067811865476
    close(adv, [0.7070068033, -0.7070068033])


def test_constant_and_singleton_groups_are_exactly_zero():
    for name in ADVANTAGE_ESTIMATORS.names():
        adv = compute_advantages(REWARDS, GROUPS, name)
        assert adv[3].item() == 0.0 and adv[7].item() == 0.0, name  # constant 0.3 group
        assert adv[6].item() == 0.0, name  # singleton


def test_grpo_scale_batch():
    # unbiased std of all 8 rewards: sqrt(13.22875 / 7) = 1.3747077611519578
    adv = compute_advantages(REWARDS, GROUPS, "grpo", scale="batch", eps=0.0)
    s = 1.3747077611519578
    close(adv, [0.5 / s, 1.0 / s, -0.5 / s, 0.0, -1.0 / s, 0.0, 0.0, 0.0])


def test_grpo_scale_none_equals_dr_grpo():
    expected = [0.5, 1.0, -0.5, 0.0, -1.0, 0.0, 0.0, 0.0]
    close(compute_advantages(REWARDS, GROUPS, "grpo", scale="none"), expected)
    close(compute_advantages(REWARDS, GROUPS, "dr_grpo"), expected)


def test_rloo_is_leave_one_out_baseline():
    # group 7: 3/2 * (r - 0.5); group 3: 2/1 * (r - 1)
    adv = compute_advantages(REWARDS, GROUPS, "rloo")
    close(adv, [0.75, 2.0, -0.75, 0.0, -2.0, 0.0, 0.0, 0.0])
    # explicitly: r_0 - mean(r_2, r_5) = 1.0 - 0.25
    assert adv[0].item() == pytest.approx(1.0 - (0.0 + 0.5) / 2)


def test_reinforce_pp_baseline_whitens_over_batch():
    # centred: [0.5, 1, -0.5, 0, -1, 0, 0, 0]; batch mean 0; unbiased std sqrt(2.5 / 7)
    s = math.sqrt(2.5 / 7)
    adv = compute_advantages(REWARDS, GROUPS, "reinforce_pp_baseline", eps=0.0)
    close(adv, [0.5 / s, 1.0 / s, -0.5 / s, 0.0, -1.0 / s, 0.0, 0.0, 0.0])
    close(adv[:2], [0.8366600265, 1.6733200531])


def test_adv_clip_max():
    adv = compute_advantages(REWARDS, GROUPS, "rloo", adv_clip_max=0.8)
    close(adv, [0.75, 0.8, -0.75, 0.0, -0.8, 0.0, 0.0, 0.0])


def test_reward_threshold_zeroes_groups_with_low_mean():
    # group 7 has mean 0.5 < 0.6 -> zeroed; group 3 has mean 1.0 -> kept
    adv = compute_advantages(REWARDS, GROUPS, "grpo", eps=0.0, reward_threshold=0.6)
    close(adv, [0.0, INV_SQRT2, 0.0, 0.0, -INV_SQRT2, 0.0, 0.0, 0.0])


def test_int32_group_ids_and_float64_rewards():
    adv = compute_advantages(REWARDS.double(), GROUPS.int(), "dr_grpo")
    close(adv, [0.5, 1.0, -0.5, 0.0, -1.0, 0.0, 0.0, 0.0])


def test_empty_batch():
    adv = compute_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert adv.shape == (0,)


def test_gae_hand_computed_with_masked_middle_token():
    # gamma 0.9, lam 0.8; token 1 is masked (an observation token): its reward 5 and value 9
    # must not leak.  Backwards: t3 delta = 1 - 0.4 = 0.6; t2 delta = 0.9*0.4 - 0.2 = 0.16,
    # gae = 0.16 + 0.72*0.6 = 0.592; t1 skipped; t0 delta = 0.9*0.2 - 0.5 = -0.32,
    # gae = -0.32 + 0.72*0.592 = 0.10624.  Second sample: right padding after 2 tokens,
    # gamma*lam applied: t1 delta = 2 - 1 = 1; t0 delta = 0.9*1 - 0 = 0.9, gae = 0.9 + 0.72 = 1.62.
    rewards = torch.tensor([[0.0, 5.0, 0.0, 1.0], [0.0, 2.0, 7.0, 7.0]])
    values = torch.tensor([[0.5, 9.0, 0.2, 0.4], [0.0, 1.0, 3.0, 3.0]])
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    close(adv, [[0.10624, 0.0, 0.592, 0.6], [1.62, 1.0, 0.0, 0.0]])
    close(ret, [[0.60624, 0.0, 0.792, 1.0], [1.62, 2.0, 0.0, 0.0]])


def test_gae_whitening_over_valid_tokens():
    rewards = torch.tensor([[0.0, 5.0, 0.0, 1.0], [0.0, 2.0, 7.0, 7.0]])
    values = torch.tensor([[0.5, 9.0, 0.2, 0.4], [0.0, 1.0, 3.0, 3.0]])
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=True, eps=0.0)
    raw = torch.tensor([0.10624, 0.592, 0.6, 1.62, 1.0])  # valid tokens
    mean, std = raw.mean(), raw.std(unbiased=True)  # mean 0.783648, std 0.5587...
    expected = torch.zeros(2, 4)
    expected[mask.bool()] = (torch.tensor([0.10624, 0.592, 0.6, 1.62, 1.0]) - mean) / std
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    assert adv[0, 1] == 0 and adv[1, 2] == 0 and adv[1, 3] == 0
    close(ret[1], [1.62, 2.0, 0.0, 0.0])  # returns are not whitened


def test_gae_gamma_one_lam_one_is_reward_to_go_minus_value():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 0.25, 0.125]])
    adv, ret = compute_gae(rewards, values, torch.ones(1, 3), whiten=False)
    close(adv, [[6.0 - 0.5, 5.0 - 0.25, 3.0 - 0.125]])
    close(ret, [[6.0, 5.0, 3.0]])


# --- bad input -------------------------------------------------------------------------------


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(UnknownNameError) as err:
        compute_advantages(REWARDS, GROUPS, "grpoo")
    msg = str(err.value)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        assert name in msg
    assert "did you mean 'grpo'" in msg


def test_gae_name_points_to_compute_gae():
    with pytest.raises(ValueError, match="compute_gae"):
        compute_advantages(REWARDS, GROUPS, "gae")


def test_unknown_option_is_named():
    with pytest.raises(UnknownOptionError, match="'scael'.*did you mean 'scale'"):
        compute_advantages(REWARDS, GROUPS, "grpo", scael="batch")
    with pytest.raises(UnknownOptionError, match="'scale'"):
        compute_advantages(REWARDS, GROUPS, "rloo", scale="batch")


def test_invalid_scale_and_eps():
    with pytest.raises(ValueError, match="scale"):
        compute_advantages(REWARDS, GROUPS, "grpo", scale="global")
    with pytest.raises(ValueError, match="eps"):
        compute_advantages(REWARDS, GROUPS, "grpo", eps=-1.0)
    with pytest.raises(ValueError, match="adv_clip_max"):
        compute_advantages(REWARDS, GROUPS, adv_clip_max=0.0)


def test_nan_reward_names_the_sample():
    r = REWARDS.clone()
    r[4] = float("nan")
    with pytest.raises(ValueError, match=r"sample indices \[4\]"):
        compute_advantages(r, GROUPS)


def test_non_integer_group_ids():
    with pytest.raises(TypeError, match="integer"):
        compute_advantages(REWARDS, GROUPS.float())


def test_integer_rewards_and_lists_rejected():
    with pytest.raises(TypeError, match="floating"):
        compute_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]))
    with pytest.raises(TypeError, match="torch.Tensor"):
        compute_advantages([1.0, 0.0], torch.tensor([0, 0]))


def test_mismatched_shapes():
    with pytest.raises(ValueError, match="same length"):
        compute_advantages(REWARDS, GROUPS[:-1])
    with pytest.raises(ValueError, match="1-D"):
        compute_advantages(REWARDS.reshape(2, 4), GROUPS.reshape(2, 4))


def test_gae_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="same shape"):
        compute_gae(x, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="gamma"):
        compute_gae(x, x, torch.ones(2, 3), gamma=1.5)


# --- properties -----------------------------------------------------------------------------

_batch = st.lists(
    st.tuples(st.integers(0, 4), st.floats(-10, 10, allow_nan=False, width=32)),
    min_size=1,
    max_size=24,
)


@settings(max_examples=60, deadline=None)
@given(_batch)
def test_grpo_group_sums_vanish(samples):
    groups = torch.tensor([g for g, _ in samples])
    rewards = torch.tensor([r for _, r in samples])
    adv = compute_advantages(rewards, groups).double()
    sums = torch.zeros(5, dtype=torch.float64).index_add(0, groups, adv)
    assert torch.allclose(sums, torch.zeros(5, dtype=torch.float64), atol=1e-4)


@settings(max_examples=60, deadline=None)
@given(_batch, st.randoms(use_true_random=False))
def test_permutation_equivariance(samples, rnd):
    groups = torch.tensor([g for g, _ in samples])
    rewards = torch.tensor([r for _, r in samples])
    perm = list(range(len(samples)))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    for name in ("grpo", "rloo", "reinforce_pp_baseline"):
        adv = compute_advantages(rewards, groups, name)
        adv_perm = compute_advantages(rewards[perm], groups[perm], name)
        torch.testing.assert_close(adv_perm, adv[perm], atol=1e-5, rtol=1e-5)
