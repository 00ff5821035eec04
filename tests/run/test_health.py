import math

import pytest
import torch

from groupflow.run.health import CollapseMonitor

ADV = torch.tensor([0.5, -0.5])
FLAT = torch.zeros(2)


def test_warns_once_after_the_collapse_lasts_three_steps(caplog):
    monitor = CollapseMonitor(1e6, max_entropy=math.log(34))
    dead = {"actor/grad_norm": 0.0, "actor/entropy": math.log(34)}
    assert monitor.observe(dead, ADV) is None
    assert monitor.observe(dead, ADV) is None
    message = monitor.observe(dead, ADV)
    assert "for 3 steps in a row the gradient norm was 0" in message
    assert (
        "entropy is 3.526 nats, the maximum log |V| = 3.526: the model outputs a uniform" in message
    )
    assert "actor.lr=1e+06" in message and message in caplog.text
    assert monitor.observe(dead, ADV) is None  # once per run
    assert caplog.text.count("stopped learning") == 1


def test_a_healthy_or_idle_step_resets_the_count():
    monitor = CollapseMonitor(1e-3, max_entropy=math.log(34))
    dead = {"actor/grad_norm": 0.0, "actor/entropy": 0.4}
    monitor.observe(dead, ADV)
    monitor.observe(dead, ADV)
    monitor.observe({"actor/grad_norm": 0.7}, ADV)  # learning again
    monitor.observe(dead, FLAT)  # every group tied: a zero gradient is expected
    assert monitor.observe(dead, ADV) is None and monitor.in_a_row == 1
    monitor.observe(dead, ADV)
    message = monitor.observe(dead, ADV)
    assert "(entropy 0.400 nats)" in message and "uniform" not in message


@pytest.mark.parametrize("metrics", [{}, {"actor/grad_norm": float("nan")}])
def test_steps_without_a_finite_gradient_norm_are_not_counted(metrics):
    monitor = CollapseMonitor(1.0, steps=1)
    assert monitor.observe(metrics, ADV) is None  # the non-finite guard handles NaN steps


def test_without_a_vocabulary_the_entropy_is_left_out():
    message = CollapseMonitor(2.0, steps=1).observe({"actor/grad_norm": 0.0}, ADV)
    assert "advantages were not. Its weights" in message and "actor.lr=2" in message
