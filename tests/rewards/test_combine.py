import math

import pytest
import torch

from groupflow.rewards.combine import combine_rewards, group_normalize

R2 = 1 / math.sqrt(2)
GROUPS = torch.tensor([0, 0, 1, 1])
# a: wide spread in group 0, constant in group 1; b: a narrow spread in both groups
A = torch.tensor([1.0, 3.0, 10.0, 10.0])
B = torch.tensor([0.1, 0.0, 0.0, 0.2])


def test_group_normalize_hand_computed():
    # group 0: mean 2, unbiased std sqrt(2) -> -1/sqrt2, 1/sqrt2; group 1 constant -> 0
    z = group_normalize(A, GROUPS, eps=0.0)
    assert torch.allclose(z, torch.tensor([-R2, R2, 0.0, 0.0], dtype=torch.float64))
    # b: group 0 mean .05, std sqrt(.005); group 1 mean .1, std sqrt(.02)
    z = group_normalize(B, GROUPS, eps=0.0)
    assert torch.allclose(z, torch.tensor([R2, -R2, -R2, R2], dtype=torch.float64))


def test_group_normalize_eps_singletons_nan_and_unordered_ids():
    # eps joins the std: (3 - 2) / (sqrt2 + 1)
    z = group_normalize(torch.tensor([1.0, 3.0]), torch.tensor([7, 7]), eps=1.0)
    assert z[1].item() == pytest.approx(1 / (math.sqrt(2) + 1))
    # a singleton group, a group whose other member is None (NaN), ids in any order
    values = torch.tensor([5.0, float("nan"), 2.0, 0.0, 4.0])
    z = group_normalize(values, torch.tensor([3, 9, 9, 1, 1]), eps=0.0)
    assert z[0] == 0 and math.isnan(z[1]) and z[2] == 0  # one present value: no signal
    assert torch.allclose(z[3:], torch.tensor([-R2, R2], dtype=torch.float64))


def test_group_normalize_bad_input():
    with pytest.raises(ValueError, match="same 1-D shape"):
        group_normalize(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="eps must be >= 0"):
        group_normalize(torch.zeros(2), torch.zeros(2, dtype=torch.long), eps=-1.0)


def test_weighted_sum_drowns_the_narrow_reward_and_group_normalisation_does_not():
    parts = {"a": A, "b": B}
    plain = combine_rewards(parts, {"a": 1.0, "b": 1.0}, group_ids=GROUPS)
    assert torch.allclose(plain.total, torch.tensor([1.1, 3.0, 10.0, 10.2]))
    # within-group |deviation|: a [1, 1, 0, 0] mean .5; b [.05, .05, .1, .1] mean .075
    assert plain.shares["a"] == pytest.approx(0.5 / 0.575)
    assert plain.shares["b"] == pytest.approx(0.075 / 0.575)
    # in group 0 the sum ranks sample 1 first although b prefers sample 0: a decides alone

    normed = combine_rewards(
        parts, {"a": 1.0, "b": 1.0}, group_ids=GROUPS, normalize="group", eps=0.0
    )
    assert torch.allclose(normed.total, torch.tensor([0.0, 0.0, -R2, R2]), atol=1e-6)
    # |z|: a [r, r, 0, 0] mean r/2; b all r: b carries two thirds
    assert normed.shares["a"] == pytest.approx(1 / 3)
    assert normed.shares["b"] == pytest.approx(2 / 3)
    assert normed.total.dtype == torch.float32


def test_weights_scale_z_scores_and_unweighted_components_are_ignored():
    parts = {"a": A, "b": B, "held_out": torch.tensor([9.0, -9.0, 9.0, -9.0])}
    out = combine_rewards(parts, {"a": 2.0, "b": 0.5}, group_ids=GROUPS, normalize="group", eps=0)
    assert torch.allclose(out.total, torch.tensor([-2 * R2 + 0.5 * R2, 2 * R2 - 0.5 * R2,
                                                   -0.5 * R2, 0.5 * R2]), atol=1e-6)  # fmt: skip
    assert set(out.shares) == {"a", "b"}


def test_without_groups_group_mode_is_the_plain_weighted_sum():
    out = combine_rewards({"a": A, "b": B}, {"a": 1.0, "b": 2.0}, normalize="group")
    assert torch.allclose(out.total, A + 2 * B)
    assert out.shares == {}


def test_none_values_are_skipped_and_all_none_gets_the_failure_value():
    nan = float("nan")
    a = torch.tensor([nan, 1.0, 3.0, nan])
    b = torch.tensor([nan, 0.0, 0.0, 2.0])
    out = combine_rewards({"a": a, "b": b}, {"a": 1.0, "b": 1.0}, -1.0, group_ids=GROUPS)
    assert torch.allclose(out.total, torch.tensor([-1.0, 1.0, 3.0, 2.0]))
    assert out.all_none.tolist() == [True, False, False, False]
    normed = combine_rewards(
        {"a": a, "b": b}, {"a": 1.0, "b": 1.0}, -1.0, group_ids=GROUPS, normalize="group"
    )
    # group 0 has one value of each reward (no signal); group 1: a [-r, r], b one value
    assert torch.allclose(normed.total, torch.tensor([-1.0, 0.0, -R2, R2]), atol=1e-5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="normalize must be one of"):
        combine_rewards({"a": A}, {"a": 1.0}, normalize="batch")
    with pytest.raises(ValueError, match=r"no values for weighted reward\(s\) \['b'\]"):
        combine_rewards({"a": A}, {"a": 1.0, "b": 1.0})
