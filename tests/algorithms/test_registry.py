import pytest
import torch

from groupflow.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    Registry,
    UnknownNameError,
    UnknownOptionError,
    compute_advantages,
    policy_loss,
    register_advantage_estimator,
    register_policy_loss,
)
from groupflow.algorithms.registry import check_options


def test_register_get_names_and_aliases():
    reg = Registry("widget")

    @reg.register("b", aliases=("bee",))
    def b():
        return "b"

    reg.add("a", lambda: "a")
    assert reg.names() == ("a", "b")
    assert reg.get("bee") is b and reg.get("b") is b
    assert "bee" in reg and "c" not in reg and len(reg) == 2
    assert list(reg) == ["a", "b"]
    reg.unregister("bee")
    assert reg.names() == ("a",) and "bee" not in reg


def test_unknown_name_lists_valid_and_suggests():
    reg = Registry("widget")
    reg.add("token_mean", len)
    reg.add("seq_mean", len)
    with pytest.raises(UnknownNameError) as err:
        reg.get("tokn_mean")
    msg = str(err.value)
    assert "unknown widget 'tokn_mean'" in msg
    assert "seq_mean, token_mean" in msg
    assert "did you mean 'token_mean'" in msg
    assert isinstance(err.value, ValueError)


def test_duplicate_registration_needs_override():
    reg = Registry("widget")
    reg.add("x", len)
    with pytest.raises(ValueError, match="already registered"):
        reg.add("x", abs)
    reg.add("x", abs, override=True)
    assert reg.get("x") is abs


def test_bad_registrations():
    reg = Registry("widget")
    with pytest.raises(TypeError, match="callable"):
        reg.add("x", 3)
    with pytest.raises(TypeError, match="non-empty string"):
        reg.add("", len)
    with pytest.raises(TypeError, match="string"):
        reg.get(3)


def test_check_options():
    def fn(x, *, alpha=1, beta=2):
        return x

    check_options(fn, {"alpha": 3}, what="fn")
    with pytest.raises(UnknownOptionError, match="'alpah'.*valid options: alpha, beta.*'alpha'"):
        check_options(fn, {"alpah": 3}, what="fn")

    def anything(x, **kwargs):
        return x

    check_options(anything, {"whatever": 1}, what="anything")


def test_builtin_registries_contents():
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"} <= set(ADVANTAGE_ESTIMATORS)
    assert {"ppo_clip", "cispo", "sapo", "vespo"} <= set(POLICY_LOSSES)
    assert set(AGGREGATIONS.names()) == {
        "token_mean",
        "seq_mean_token_mean",
        "seq_mean_token_sum_norm",
        "local_token_mean",
    }
    assert set(KL_ESTIMATORS.names()) == {"k1", "k2", "k3"}


def test_custom_policy_loss_is_one_function_and_one_entry():
    # A CISPO-like loss: clipped, detached importance weight times the log-prob.
    @register_policy_loss("test_cispo")
    def cispo(logprobs, old_logprobs, advantages, valid, *, clip_max=2.0):
        weight = (logprobs - old_logprobs).exp().clamp(max=clip_max).detach()
        return -weight * advantages * logprobs, {}

    try:
        logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
        old = torch.tensor([[-3.0, 0.0]])  # ratios e^3 (clamped to 2) and 1
        loss, metrics = policy_loss(
            logp, old, torch.tensor([1.0]), torch.ones(1, 2), loss_fn="test_cispo"
        )
        loss.backward()
        torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -0.5]]))
        assert "approx_kl" in metrics
        with pytest.raises(UnknownOptionError, match="clip_max"):
            policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), loss_fn="test_cispo", c=1)
    finally:
        POLICY_LOSSES.unregister("test_cispo")
    assert "test_cispo" not in POLICY_LOSSES


def test_custom_advantage_estimator_gets_group_stats():
    @register_advantage_estimator("test_max_baseline")
    def max_baseline(rewards, groups, *, scale=1.0):
        group_max = torch.full((groups.num_groups,), -torch.inf, dtype=rewards.dtype)
        group_max = group_max.scatter_reduce(0, groups.index, rewards, "amax")
        return scale * (rewards - group_max[groups.index])

    try:
        adv = compute_advantages(
            torch.tensor([1.0, 3.0, 2.0, 5.0]),
            torch.tensor([10, 10, 20, 10]),
            "test_max_baseline",
            scale=2.0,
        )
        # group 10: max 5 -> 2*(1-5), 2*(3-5), 0; group 20 is a singleton -> 0
        assert adv.tolist() == [-8.0, -4.0, 0.0, 0.0]
    finally:
        ADVANTAGE_ESTIMATORS.unregister("test_max_baseline")
