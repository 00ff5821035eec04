"""Rewards of multi-turn trajectories: the environment's own rewards, and tool use.

Design decision: an environment's ``step`` returns a reward per turn; the multi-turn workflow hands
them to the reward functions as ``env_rewards`` (one list per sample) next to ``turns``,
``tool_calls`` and ``messages``, so how per-turn rewards become the sample's outcome is an
ordinary, weighted, configurable reward like any other — summed, the last one, or the best —
and can be combined with answer-checking rewards by weight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from groupflow.rewards.base import RewardConfigError

__all__ = ["make_env_reward", "make_tool_use_reward"]

_REDUCE: dict[str, Callable[[Sequence[float]], float]] = {
    "sum": lambda r: float(sum(r)),
    "last": lambda r: float(r[-1]) if r else 0.0,
    "max": lambda r: float(max(r)) if r else 0.0,
    "mean": lambda r: float(sum(r)) / len(r) if r else 0.0,
}


def make_env_reward(reduce: str = "sum") -> Callable[..., list[float]]:
    """``env_reward``: the environment's per-turn rewards reduced to one number per sample
    (``sum`` by default; ``last``, ``max`` or ``mean``). A sample whose environment never stepped
    scores 0 (``sum``/``last``/``max``/``mean`` of nothing)."""
    if reduce not in _REDUCE:
        raise RewardConfigError(
            f"env_reward: reduce must be one of {sorted(_REDUCE)}, got {reduce!r}"
        )
    fold = _REDUCE[reduce]

    def env_reward(prompts: Sequence[Any], completions: Sequence[Any], env_rewards) -> list[float]:
        return [fold(r) for r in env_rewards]

    return env_reward


def make_tool_use_reward(max_calls: int | None = None) -> Callable[..., list[float]]:
    """``tool_use``: 1 for a sample that called a tool at least once (and, with ``max_calls``, at
    most that many times), else 0 — a shaping term to weight lightly next to the task reward."""
    if max_calls is not None and (
        isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1
    ):
        raise RewardConfigError(f"tool_use: max_calls must be a positive int, got {max_calls!r}")

    def tool_use(prompts: Sequence[Any], completions: Sequence[Any], tool_calls) -> list[float]:
        return [float(c >= 1 and (max_calls is None or c <= max_calls)) for c in tool_calls]

    return tool_use
