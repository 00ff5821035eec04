"""Length rewards from token counts: DAPO's soft overlong punishment and a linear length penalty.

Design decision: these read ``completion_lengths`` (response token counts the trainer supplies),
never re-tokenise the text, so they agree with the lengths the loss sees. Options are validated
when the reward is built, so a bad config fails at load, not at step 1000.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from groupflow.rewards.base import RewardConfigError


def _check_length(value: Any) -> float:
    if isinstance(value, bool) or not hasattr(value, "__float__"):
        raise TypeError(f"completion length must be a number, got {value!r}")
    length = float(value)
    if not math.isfinite(length) or length < 0:
        raise ValueError(f"completion length must be a finite number >= 0, got {value!r}")
    return length


def _positive_int(reward: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RewardConfigError(f"{reward}: {key} must be a positive integer, got {value!r}")
    return value


def _non_negative(reward: str, key: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise RewardConfigError(f"{reward}: {key} must be a finite number >= 0, got {value!r}")
    return float(value)


def _per_completion(name: str, score: Callable[[float], float]) -> Callable[..., list[float]]:
    """A batched reward ``name``: ``score`` of each checked completion length. The trainer passes
    the lengths by name, so the returned function's parameter is ``completion_lengths``."""

    def batched(completion_lengths: Sequence[Any]) -> list[float]:
        return [score(_check_length(n)) for n in completion_lengths]

    batched.__name__ = batched.__qualname__ = name  # error messages name the reward, not this
    return batched


def overlong_penalty(
    length: float, max_tokens: int, buffer_tokens: int, penalty_factor: float = 1.0
) -> float:
    """DAPO soft overlong punishment (arXiv:2503.14476, eq. 13) for one completion.

    0 up to ``max_tokens - buffer_tokens``; then linear down to ``-penalty_factor`` at
    ``max_tokens``; ``-penalty_factor`` beyond.
    """
    expected = max_tokens - buffer_tokens
    if length <= expected:
        return 0.0
    if length > max_tokens:
        return -penalty_factor
    return (expected - length) / buffer_tokens * penalty_factor


def make_overlong_penalty(
    max_tokens: int, buffer_tokens: int, penalty_factor: float = 1.0
) -> Callable[..., list[float]]:
    """Batched :func:`overlong_penalty`; ``max_tokens`` is usually the response length limit."""
    max_tokens = _positive_int("overlong_penalty", "max_tokens", max_tokens)
    buffer_tokens = _positive_int("overlong_penalty", "buffer_tokens", buffer_tokens)
    if buffer_tokens > max_tokens:
        raise RewardConfigError(
            f"overlong_penalty: buffer_tokens ({buffer_tokens}) must be <= max_tokens ({max_tokens})"
        )
    penalty_factor = _non_negative("overlong_penalty", "penalty_factor", penalty_factor)
    return _per_completion(
        "overlong_penalty", lambda n: overlong_penalty(n, max_tokens, buffer_tokens, penalty_factor)
    )


def length_penalty(
    length: float, free_tokens: int, penalty_per_token: float, max_penalty: float | None
) -> float:
    """``-penalty_per_token`` for every token beyond ``free_tokens``, capped at ``-max_penalty``."""
    penalty = penalty_per_token * max(0.0, length - free_tokens)
    if max_penalty is not None:
        penalty = min(penalty, max_penalty)
    return -penalty


def make_length_penalty(
    penalty_per_token: float = 0.001, free_tokens: int = 0, max_penalty: float | None = None
) -> Callable[..., list[float]]:
    """Batched :func:`length_penalty`: a linear push toward shorter answers."""
    penalty_per_token = _non_negative("length_penalty", "penalty_per_token", penalty_per_token)
    if isinstance(free_tokens, bool) or not isinstance(free_tokens, int) or free_tokens < 0:
        raise RewardConfigError(
            f"length_penalty: free_tokens must be an integer >= 0, got {free_tokens!r}"
        )
    if max_penalty is not None:
        max_penalty = _non_negative("length_penalty", "max_penalty", max_penalty)
    return _per_completion(
        "length_penalty", lambda n: length_penalty(n, free_tokens, penalty_per_token, max_penalty)
    )
