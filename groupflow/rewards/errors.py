"""The reward errors, and how a reward callable is named in messages.

Design decision: errors say which kind of problem stopped a step — a configuration the user must
fix (:class:`RewardConfigError`, never isolated per sample), or a function that failed on a whole
batch or returned malformed output (:class:`RewardError`) — and live apart from the runner so the
scoring helpers and the built-in rewards can raise them without importing the runner.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = [
    "FailedScore",
    "MissingRewardFieldError",
    "RewardConfigError",
    "RewardError",
    "RewardOutputError",
    "describe_callable",
]


class RewardError(RuntimeError):
    """A reward function failed on every sample of a batch, or returned malformed output."""


class RewardOutputError(RewardError, TypeError):
    """A reward function returned the wrong number of values or a non-numeric value."""


class RewardConfigError(ValueError):
    """A reward is misconfigured: bad option, unknown name, missing field, unresolvable path.

    Raised inside a reward function it is not isolated per sample: it stops the step, because it
    says the configuration is wrong rather than that one sample is odd.
    """


class MissingRewardFieldError(RewardConfigError):
    """A reward function requires a field that the batch does not provide."""


class FailedScore(float):
    """A NaN that says why: what a reward returns for a sample it could not score, so that the
    runner's log line and its error when every sample fails name the real cause (a judge's reply
    outside its scale, an HTTP 401) instead of "non-finite value nan"."""

    reason: str

    def __new__(cls, reason: Any = "") -> FailedScore:
        obj = super().__new__(cls, "nan")
        obj.reason = str(reason)
        return obj

    def __getnewargs__(self) -> tuple[str]:  # pickled (a Ray rollout side) with its reason
        return (self.reason,)

    def __repr__(self) -> str:
        return f"FailedScore({self.reason!r})"


def describe_callable(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a callable, for error messages."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    module = getattr(target, "__module__", None) or "?"
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}:{qualname}"
