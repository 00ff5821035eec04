"""Trajectory rewards: the environment's per-turn rewards reduced, and tool use."""

from __future__ import annotations

import pytest

from groupflow.rewards import RewardConfigError, build_reward_runner


def test_env_reward_reductions():
    env_rewards = [[1.0, 0.0, 2.0], [], [0.5]]
    for reduce, expected in (("sum", [3.0, 0.0, 0.5]), ("last", [2.0, 0.0, 0.5]),
                             ("max", [2.0, 0.0, 0.5]), ("mean", [1.0, 0.0, 0.5])):  # fmt: skip
        runner = build_reward_runner([{"name": "env_reward", "kwargs": {"reduce": reduce}}])
        out = runner(["p"] * 3, ["c"] * 3, env_rewards=env_rewards)
        assert out.total.tolist() == expected


def test_tool_use_reward():
    runner = build_reward_runner([{"name": "tool_use", "kwargs": {"max_calls": 2}}])
    assert runner(["p"] * 4, ["c"] * 4, tool_calls=[0, 1, 2, 3]).total.tolist() == [0, 1, 1, 0]


def test_bad_options():
    with pytest.raises(RewardConfigError, match="reduce must be one of"):
        build_reward_runner([{"name": "env_reward", "kwargs": {"reduce": "median"}}])
    with pytest.raises(RewardConfigError, match="max_calls must be a positive int"):
        build_reward_runner([{"name": "tool_use", "kwargs": {"max_calls": 0}}])
