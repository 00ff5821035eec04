"""Fixed and adaptive KL controllers (verl's AdaptiveKLController rule), including their state."""

import pytest

from groupflow.algorithms import AdaptiveKLController, FixedKLController, build_kl_controller


@pytest.mark.parametrize(
    "kl, expected",
    [
        (0.15, 0.1 * 1.02),  # error 0.5, clipped to 0.2: β · (1 + 0.2 · 10/100)
        (0.09, 0.1 * 0.99),  # error -0.1: β · (1 - 0.1 · 10/100)
        (0.0, 0.1 * 0.98),  # error -1, clipped to -0.2
        (0.1, 0.1),  # on target: unchanged
    ],
)
def test_adaptive_update(kl, expected):
    ctl = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    ctl.update(kl, n_steps=10)
    assert ctl.value == pytest.approx(expected)


def test_adaptive_compounds_and_state_roundtrips():
    ctl = AdaptiveKLController(0.2, target_kl=0.05, horizon=40)
    ctl.update(1.0, n_steps=8)  # error clipped to 0.2: × 1.04
    ctl.update(1.0, n_steps=8)
    assert ctl.value == pytest.approx(0.2 * 1.04 * 1.04)
    fresh = AdaptiveKLController(0.2, target_kl=0.05, horizon=40)
    fresh.load_state_dict(ctl.state_dict())
    assert fresh.value == ctl.value


def test_fixed_ignores_kl():
    ctl = FixedKLController(0.3)
    ctl.update(100.0, n_steps=64)
    assert ctl.value == 0.3
    assert ctl.state_dict() == {"type": "fixed", "value": 0.3}


def test_bad_controllers():
    with pytest.raises(ValueError, match="valid: fixed, adaptive"):
        build_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="needs target_kl and horizon"):
        build_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="target_kl must be > 0"):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)
    with pytest.raises(ValueError, match="not finite"):
        AdaptiveKLController(0.1, target_kl=0.1, horizon=10).update(float("nan"), 4)
