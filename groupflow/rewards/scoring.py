"""Scoring one reward component on a batch: output validation, failure and timeout isolation.

Design decision: the batched call comes first (one call per step is what rewards are written
for); only when it raises or runs out of time are the samples scored one by one, so one bad
sample costs that sample, not the step. A sample that raised, returned NaN/inf or had no value by
the deadline gets the failure value and is counted; a function that fails on *every* sample, or
returns malformed output, points at a bug or a misconfiguration and stops with an error naming it.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from groupflow.rewards.calls import TIMED_OUT, CallGuard
from groupflow.rewards.errors import (
    FailedScore,
    RewardConfigError,
    RewardError,
    RewardOutputError,
    describe_callable,
)


class Scorable(Protocol):
    """What scoring needs of a reward (a :class:`~groupflow.rewards.base.RewardFunction`)."""

    @property
    def name(self) -> str: ...

    @property
    def fn(self) -> Callable[..., Any]: ...

    def start(self, fields: Mapping[str, Any]) -> Any: ...


__all__ = ["score_component", "take_rows", "validate_output"]

logger = logging.getLogger("groupflow.rewards")


def _per_frame_hint(n: int, expected: int, rows: bool) -> str:
    """The likely cause when a reward scored frames, not samples (a video batch)."""
    if rows and n == expected:
        return "; a row per completion: reduce each video's frame scores to one value"
    if expected and n > expected and n % expected == 0:
        return (
            f" ({n // expected} per completion: scoring every video frame? reduce them to one "
            "value per sample, e.g. their mean)"
        )
    return ""


def validate_output(name: str, fn: Callable[..., Any], output: Any, expected: int) -> list[Any]:
    """Turn a reward's return value into ``list[float | None]`` (NaN/inf kept for the caller).

    Raises :class:`RewardOutputError` for anything other than a flat sequence of ``expected``
    numbers or ``None``.
    """
    where = f"reward {name!r} ({describe_callable(fn)})"
    if isinstance(output, torch.Tensor) or type(output).__module__ == "numpy":
        if getattr(output, "ndim", None) != 1:
            shape = tuple(getattr(output, "shape", ()))
            hint = _per_frame_hint(shape[0] if shape else 0, expected, len(shape) > 1)
            raise RewardOutputError(
                f"{where} returned a {type(output).__name__} of shape {shape}; expected one value "
                f"per completion ({expected}){hint}"
            )
        output = output.tolist()
    if not isinstance(output, (list, tuple)):
        raise RewardOutputError(
            f"{where} returned {type(output).__name__} {_short(output)}; expected a list of "
            f"{expected} floats (or None), one per completion"
        )
    if len(output) != expected:
        hint = _per_frame_hint(len(output), expected, False)
        raise RewardOutputError(
            f"{where} returned {len(output)} values for {expected} completions: "
            f"{_short(output)}{hint}"
        )
    values: list[Any] = []
    for i, value in enumerate(output):
        if value is None:
            values.append(None)
        elif isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
            raise RewardOutputError(
                f"{where} returned a non-numeric value at position {i}: {value!r} "
                f"({type(value).__name__}); expected float or None"
            )
        else:
            values.append(value if isinstance(value, FailedScore) else float(value))
    return values


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class _Scored:
    values: list[float | None]
    failures: int
    timeouts: int = 0


def _is_bad(value: float | None) -> bool:
    return value is not None and not math.isfinite(value)


def take_rows(fields: Mapping[str, Sequence[Any]], rows: Sequence[int]) -> dict[str, list[Any]]:
    return {k: [v[i] for i in rows] for k, v in fields.items()}


class _DeadlineExceeded(TimeoutError):
    """A sample with no value within the time limit (a user's own TimeoutError is a failure)."""


def _raise_config_errors(name: str, results: Sequence[Any]) -> None:
    for r in results:
        if isinstance(r, RewardConfigError):
            message = str(r)
            if not message.startswith(f"reward {name!r}"):  # say which reward stopped the step
                r.args = (f"reward {name!r}: {message}",)
            raise r


def _per_sample(
    spec: Scorable, fields: Mapping[str, Sequence[Any]], size: int, guard: CallGuard
) -> tuple[list[float | None], list[BaseException | None]]:
    """Each sample on its own: (values, per-sample error or None); a timeout is a TimeoutError."""
    starts = [functools.partial(spec.start, take_rows(fields, [i])) for i in range(size)]
    results = guard.per_sample(spec.name, starts)
    _raise_config_errors(spec.name, results)
    values: list[float | None] = []
    errors: list[BaseException | None] = [None] * size
    for i, result in enumerate(results):
        if result is TIMED_OUT:
            values.append(None)
            errors[i] = _DeadlineExceeded(f"no value within reward.timeout_s={guard.timeout_s:g} s")
        elif isinstance(result, Exception):
            values.append(None)
            errors[i] = result
        else:
            values.extend(validate_output(spec.name, spec.fn, result, 1))
    return values, errors


def score_component(
    spec: Scorable,
    fields: Mapping[str, Sequence[Any]],
    size: int,
    failure_value: float,
    sample_ids: Sequence[int] | None = None,
    guard: CallGuard | None = None,
) -> _Scored:
    """Score ``size`` samples with one reward, isolating per-sample failures and timeouts.

    ``sample_ids`` are the samples' indices in the caller's batch (for the log line); ``guard``
    runs the calls with their time limit (None: no limit, in this thread).
    """
    guard = guard if guard is not None else CallGuard(None)
    sample_ids = list(range(size)) if sample_ids is None else list(sample_ids)
    batched = guard.batched(spec.name, functools.partial(spec.start, fields))
    _raise_config_errors(spec.name, [batched])
    if batched is TIMED_OUT or isinstance(batched, Exception):
        values, errors = _per_sample(spec, fields, size, guard)
        if batched is not TIMED_OUT and all(e is None for e in errors):
            logger.warning(
                "reward %r: the batched call raised %s: %s, but every per-sample call succeeded; "
                "the function probably mishandles batches",
                spec.name,
                type(batched).__name__,
                batched,
            )
    else:
        values = validate_output(spec.name, spec.fn, batched, size)
        errors: list[BaseException | None] = [None] * size
    for i, value in enumerate(values):
        if isinstance(value, FailedScore):  # the reward said why
            errors[i] = ValueError(value.reason or "returned NaN")
        elif _is_bad(value):
            errors[i] = ValueError(f"returned non-finite value {value}")
    failed = [i for i, e in enumerate(errors) if e is not None]
    timeouts = sum(isinstance(errors[i], _DeadlineExceeded) for i in failed)
    if not failed:
        return _Scored(values, 0)
    first = errors[failed[0]]
    if len(failed) == size:
        cause = "timed out" if timeouts == size else "failed"
        raise RewardError(
            f"reward {spec.name!r} ({describe_callable(spec.fn)}) {cause} on every sample "
            f"({size}); first error (sample {sample_ids[failed[0]]}): "
            f"{type(first).__name__}: {first}"
            + ("; raise reward.timeout_s if the function is just slow" if timeouts else "")
        ) from first
    logger.warning(
        "reward %r failed on %d of %d samples (%d timed out; they get failure value %s); "
        "first failure at sample %d: %s: %s",
        spec.name,
        len(failed),
        size,
        timeouts,
        failure_value,
        sample_ids[failed[0]],
        type(first).__name__,
        first,
    )
    logger.debug("traceback of reward %r's first failure", spec.name, exc_info=first)
    for i in failed:
        values[i] = failure_value
    return _Scored(values, len(failed), timeouts)
