"""Reward functions as plain callables, and the runner that isolates their failures.

Design decision: a reward is any callable ``fn(prompts, completions, **fields) -> list[float | None]``
(sync or ``async def``). The callable never sees groupflow types; :class:`RewardFunction` wraps it
once, inspecting its signature so that each call passes only the dataset fields it declares (all of
them when it takes ``**kwargs``), like TRL. :class:`RewardRunner` calls every wrapped function on
the whole batch and combines the results with weights. A function that raises on the batch is
retried once per sample, so one bad sample costs one sample, not the step: the failed samples get
the failure value, are counted in ``reward/<name>/failures`` and the first one is logged. That is
the one deliberate "catch and continue" in groupflow; everything that points at a programming or
configuration error (wrong number of values, non-numeric values, a missing field, a
:class:`RewardConfigError` raised inside a reward, a function that fails on every sample) stops
with an error naming the function.

``None`` means "no opinion": the weighted sum skips it (TRL's ``nansum``) and a sample where every
component is ``None`` gets the failure value and is counted in ``reward/all_none``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

logger = logging.getLogger("groupflow.rewards")

# Field names every reward can receive; dataset fields come on top of these.
CORE_FIELDS = ("prompts", "completions")


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


@runtime_checkable
class RewardFn(Protocol):
    """The reward protocol: one float (or ``None`` = no opinion) per completion.

    ``fields`` are the dataset's extra per-sample fields by name, each a list of length B
    (e.g. ``ground_truth``, ``data_source``, ``extra_info``, ``completion_lengths``). The
    function may declare only the ones it needs. It may be ``async def``.
    """

    def __call__(
        self, prompts: list[str], completions: list[str], **fields: list[Any]
    ) -> Sequence[float | None] | Awaitable[Sequence[float | None]]: ...


def describe_callable(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a callable, for error messages."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    module = getattr(target, "__module__", None) or "?"
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}:{qualname}"


@dataclass(frozen=True)
class _Params:
    """What a reward callable accepts, read once from its signature."""

    accepted: frozenset[str]
    required: frozenset[str]
    var_keyword: bool


def _inspect_params(name: str, fn: Callable[..., Any]) -> _Params:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise RewardConfigError(
            f"reward {name!r}: cannot read the signature of {describe_callable(fn)} ({exc}); "
            "wrap it in a def with named parameters (prompts, completions, field names)"
        ) from exc
    accepted: set[str] = set()
    required: set[str] = set()
    var_keyword = False
    for param in signature.parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            var_keyword = True
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        elif param.kind is inspect.Parameter.POSITIONAL_ONLY:
            # Fields are passed by keyword, so a positional-only parameter can never be filled.
            if param.default is inspect.Parameter.empty:
                raise RewardConfigError(
                    f"reward {name!r}: {describe_callable(fn)} has positional-only parameter "
                    f"{param.name!r}; rewards receive fields by keyword, so make it a normal "
                    "parameter"
                )
        else:
            accepted.add(param.name)
            if param.default is inspect.Parameter.empty:
                required.add(param.name)
    return _Params(frozenset(accepted), frozenset(required), var_keyword)


@dataclass(frozen=True)
class RewardFunction:
    """A named, weighted reward callable.

    Args:
        name: component name; metrics are ``reward/<name>/...``.
        fn: the callable (see :class:`RewardFn`).
        weight: multiplier in the weighted sum.
        failure_value: value for a sample on which ``fn`` raised or returned NaN/inf;
            ``None`` takes the runner's ``failure_value`` (0.0 by default).
        options: fixed keyword arguments passed on every call (e.g. a user function's
            ``kwargs`` from the config); they are never filled from dataset fields.
    """

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    failure_value: float | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    _params: _Params = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise RewardConfigError(f"reward name must be a non-empty string, got {self.name!r}")
        if not callable(self.fn):
            raise RewardConfigError(
                f"reward {self.name!r}: fn must be callable, got {type(self.fn).__name__}"
            )
        object.__setattr__(self, "weight", _finite_float(self.name, "weight", self.weight))
        if self.failure_value is not None:
            object.__setattr__(
                self, "failure_value", _finite_float(self.name, "failure_value", self.failure_value)
            )
        params = _inspect_params(self.name, self.fn)
        unknown = [k for k in self.options if k not in params.accepted]
        if unknown and not params.var_keyword:
            raise RewardConfigError(
                f"reward {self.name!r}: {describe_callable(self.fn)} does not accept option(s) "
                f"{sorted(unknown)}; its parameters are {sorted(params.accepted)}"
            )
        object.__setattr__(self, "options", dict(self.options))
        object.__setattr__(self, "_params", params)

    def check_fields(self, available: Iterable[str]) -> None:
        """Raise :class:`MissingRewardFieldError` if a required parameter is not available."""
        available = set(available)
        missing = sorted(self._params.required - available - set(self.options))
        if missing:
            raise MissingRewardFieldError(
                f"reward {self.name!r} ({describe_callable(self.fn)}) requires field "
                f"{missing[0]!r}, which the batch lacks"
                + (f" (also missing: {missing[1:]})" if len(missing) > 1 else "")
                + f"; available fields: {sorted(available)}"
            )

    def select(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """The subset of ``fields`` this function accepts, plus its fixed options."""
        if self._params.var_keyword:
            chosen = {k: v for k, v in fields.items() if k not in self.options}
        else:
            accepted = self._params.accepted - set(self.options)
            chosen = {k: v for k, v in fields.items() if k in accepted}
        chosen.update(self.options)
        return chosen

    def start(self, fields: Mapping[str, Any]) -> Any:
        """Call ``fn`` on ``fields``; the result may be an awaitable (see :func:`resolve`)."""
        return self.fn(**self.select(fields))


def _finite_float(name: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardConfigError(f"reward {name!r}: {key} must be a finite number, got {value!r}")
    return float(value)


# --------------------------------------------------------------------------------------------
# Awaiting async rewards from synchronous code


async def _await_one(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


async def _await_all(awaitables: Sequence[Awaitable[Any]]) -> list[Any]:
    return await asyncio.gather(*awaitables, return_exceptions=True)


def _run_coroutine(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # A loop already runs in this thread (Jupyter, an async trainer): asyncio.run would refuse,
    # so run the coroutine on a fresh loop in a worker thread and block on it.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def resolve(result: Any) -> Any:
    """Await ``result`` if it is awaitable, from sync code, even inside a running loop."""
    return _run_coroutine(_await_one(result)) if inspect.isawaitable(result) else result


def resolve_many(results: Sequence[Any]) -> list[Any]:
    """Await every awaitable in ``results`` concurrently; exceptions are returned, not raised."""
    pending = [i for i, r in enumerate(results) if inspect.isawaitable(r)]
    if not pending:
        return list(results)
    done = _run_coroutine(_await_all([results[i] for i in pending]))
    out = list(results)
    for i, value in zip(pending, done):
        if isinstance(value, BaseException) and not isinstance(value, Exception):
            raise value  # cancellation / interrupts are not per-sample failures
        out[i] = value
    return out


# --------------------------------------------------------------------------------------------
# Output validation


def validate_output(name: str, fn: Callable[..., Any], output: Any, expected: int) -> list[Any]:
    """Turn a reward's return value into ``list[float | None]`` (NaN/inf kept for the caller).

    Raises :class:`RewardOutputError` for anything other than a flat sequence of ``expected``
    numbers or ``None``.
    """
    where = f"reward {name!r} ({describe_callable(fn)})"
    if isinstance(output, torch.Tensor) or type(output).__module__ == "numpy":
        if getattr(output, "ndim", None) != 1:
            raise RewardOutputError(
                f"{where} returned a {type(output).__name__} of shape "
                f"{tuple(getattr(output, 'shape', ()))}; expected one value per completion "
                f"({expected})"
            )
        output = output.tolist()
    if not isinstance(output, (list, tuple)):
        raise RewardOutputError(
            f"{where} returned {type(output).__name__} {_short(output)}; expected a list of "
            f"{expected} floats (or None), one per completion"
        )
    if len(output) != expected:
        raise RewardOutputError(
            f"{where} returned {len(output)} values for {expected} completions: {_short(output)}"
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
            values.append(float(value))
    return values


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------
# Scoring one component with failure isolation


@dataclass
class _Scored:
    values: list[float | None]
    failures: int


def _is_bad(value: float | None) -> bool:
    return value is not None and not math.isfinite(value)


def _take(fields: Mapping[str, Sequence[Any]], rows: Sequence[int]) -> dict[str, list[Any]]:
    return {k: [v[i] for i in rows] for k, v in fields.items()}


def _call_batched(spec: RewardFunction, fields: Mapping[str, Any]) -> tuple[Any, Exception | None]:
    """(raw batched result, None), or (None, the exception the user function raised)."""
    try:
        return resolve(spec.start(fields)), None
    except RewardConfigError:
        raise
    except Exception as exc:  # isolated by the caller, which retries per sample
        return None, exc


def _call_per_sample(spec: RewardFunction, fields: Mapping[str, Sequence[Any]], size: int) -> list:
    started: list[Any] = []
    for i in range(size):
        try:
            started.append(spec.start(_take(fields, [i])))
        except RewardConfigError:
            raise
        except Exception as exc:  # recorded as this sample's failure
            started.append(exc)
    results = resolve_many(started)
    for r in results:
        if isinstance(r, RewardConfigError):
            raise r
    return results


def score_component(
    spec: RewardFunction,
    fields: Mapping[str, Sequence[Any]],
    size: int,
    failure_value: float,
    sample_ids: Sequence[int] | None = None,
) -> _Scored:
    """Score ``size`` samples with one reward, isolating per-sample failures.

    ``sample_ids`` are the samples' indices in the caller's batch (for the log line).
    """
    sample_ids = list(range(size)) if sample_ids is None else list(sample_ids)
    batched, batch_error = _call_batched(spec, fields)
    errors: list[BaseException | None] = [None] * size
    if batch_error is not None:
        values: list[float | None] = []
        for i, result in enumerate(_call_per_sample(spec, fields, size)):
            if isinstance(result, Exception):
                values.append(None)
                errors[i] = result
            else:
                values.extend(validate_output(spec.name, spec.fn, result, 1))
        if all(e is None for e in errors):
            logger.warning(
                "reward %r: the batched call raised %s: %s, but every per-sample call succeeded; "
                "the function probably mishandles batches",
                spec.name,
                type(batch_error).__name__,
                batch_error,
            )
    else:
        values = validate_output(spec.name, spec.fn, batched, size)
    for i, value in enumerate(values):
        if _is_bad(value):
            errors[i] = ValueError(f"returned non-finite value {value}")
    failed = [i for i, e in enumerate(errors) if e is not None]
    if not failed:
        return _Scored(values, 0)
    first = errors[failed[0]]
    if len(failed) == size:
        raise RewardError(
            f"reward {spec.name!r} ({describe_callable(spec.fn)}) failed on every sample "
            f"({size}); first error (sample {sample_ids[failed[0]]}): "
            f"{type(first).__name__}: {first}"
        ) from first
    logger.warning(
        "reward %r failed on %d of %d samples (they get failure value %s); "
        "first failure at sample %d: %s: %s",
        spec.name,
        len(failed),
        size,
        failure_value,
        sample_ids[failed[0]],
        type(first).__name__,
        first,
    )
    logger.debug("traceback of reward %r's first failure", spec.name, exc_info=first)
    for i in failed:
        values[i] = failure_value
    return _Scored(values, len(failed))


# --------------------------------------------------------------------------------------------
# The runner


@dataclass(frozen=True)
class RewardResult:
    """Rewards for one batch.

    total: [B] float32, the weighted sum of components (NaN-skipping).
    components: name -> [B] float32 unweighted values; NaN where the function returned ``None``
        (or, in data_source mode, where the sample belongs to another source).
    metrics: ``reward/<name>/{mean,std,failures}``, ``reward/total/{mean,std}``,
        ``reward/all_none``. Means/stds skip NaN and are omitted when nothing is left; std is
        the population std (0 for a single value).
    """

    total: torch.Tensor
    components: dict[str, torch.Tensor]
    metrics: dict[str, float]


# Maps the distinct data_source values of a batch to their rewards; raises a RewardConfigError
# naming every unknown source.
DataSourceLookup = Callable[[Sequence[str]], Mapping[str, RewardFunction]]


class RewardRunner:
    """Calls reward functions on a batch and combines them with weights.

    ``RewardRunner(specs)`` applies every spec to every sample.
    ``RewardRunner.by_data_source(lookup)`` picks each sample's reward from its ``data_source``
    field (see :mod:`groupflow.rewards.registry`); samples of different sources can share a batch.
    """

    def __init__(self, specs: Sequence[RewardFunction], failure_value: float = 0.0) -> None:
        specs = list(specs)
        if not specs:
            raise RewardConfigError(
                "RewardRunner needs at least one RewardFunction; use RewardRunner.by_data_source() "
                "to pick rewards from each sample's data_source"
            )
        self._init(specs, None, failure_value)

    @classmethod
    def by_data_source(cls, lookup: DataSourceLookup, failure_value: float = 0.0) -> RewardRunner:
        """A runner that scores each sample with the reward registered for its ``data_source``.

        ``lookup(sources)`` returns ``{source: RewardFunction}`` for the batch's distinct
        sources and raises a :class:`RewardConfigError` subclass naming any unknown ones.
        """
        runner = cls.__new__(cls)
        runner._init([], lookup, failure_value)
        return runner

    def _init(
        self, specs: list[RewardFunction], lookup: DataSourceLookup | None, failure_value: float
    ) -> None:
        for spec in specs:
            if not isinstance(spec, RewardFunction):
                raise RewardConfigError(
                    f"RewardRunner expects RewardFunction objects, got {type(spec).__name__}"
                )
        names = [s.name for s in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise RewardConfigError(f"reward names must be unique; repeated: {duplicates}")
        self.specs = specs
        if (
            isinstance(failure_value, bool)
            or not isinstance(failure_value, (int, float))
            or not math.isfinite(failure_value)
        ):
            raise RewardConfigError(
                f"RewardRunner: failure_value must be a finite number, got {failure_value!r}"
            )
        self.failure_value = float(failure_value)
        self._lookup = lookup

    @property
    def dispatch_by_data_source(self) -> bool:
        return self._lookup is not None

    def check_fields(self, available: Iterable[str]) -> None:
        """Fail early (e.g. at dataset load) if a reward needs a field the data lacks."""
        available = set(available) | set(CORE_FIELDS)
        if self._lookup is not None and "data_source" not in available:
            raise MissingRewardFieldError(
                "rewards are chosen by data_source, but the batch has no 'data_source' field; "
                f"available fields: {sorted(available)}. Configure rewards explicitly instead."
            )
        for spec in self.specs:
            spec.check_fields(available)

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **fields: Sequence[Any]
    ) -> RewardResult:
        size = len(completions)
        batch = {"prompts": list(prompts), "completions": list(completions), **fields}
        _check_lengths(batch, size)
        if size == 0:
            empty = torch.zeros(0, dtype=torch.float32)
            return RewardResult(total=empty, components={}, metrics={})
        groups = self._plan(batch, size)
        names = [spec.name for spec, _ in groups]
        components: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        for spec, rows in groups:
            spec.check_fields(batch)
            failure = self.failure_value if spec.failure_value is None else spec.failure_value
            fields_subset = batch if len(rows) == size else _take(batch, rows)
            scored = score_component(spec, fields_subset, len(rows), failure, rows)
            column = torch.full((size,), float("nan"), dtype=torch.float32)
            column[rows] = _to_tensor(scored.values)
            components[spec.name] = column
            metrics.update(_summary(f"reward/{spec.name}", column))
            metrics[f"reward/{spec.name}/failures"] = float(scored.failures)
        weights = {spec.name: spec.weight for spec, _ in groups}
        total, all_none = _weighted_sum(components, weights, size, self.failure_value)
        if all_none.any():
            logger.warning(
                "%d of %d samples got no reward from any of %s (all returned None); "
                "they get failure value %s",
                int(all_none.sum()),
                size,
                names,
                self.failure_value,
            )
        metrics.update(_summary("reward/total", total))
        metrics["reward/all_none"] = float(all_none.sum())
        return RewardResult(total=total, components=components, metrics=metrics)

    def _plan(self, batch: Mapping[str, Any], size: int) -> list[tuple[RewardFunction, list[int]]]:
        """(reward, sample rows) pairs: every reward on every row, or rows grouped by source."""
        if self._lookup is None:
            return [(spec, list(range(size))) for spec in self.specs]
        if "data_source" not in batch:
            self.check_fields(batch)
        sources = list(batch["data_source"])
        chosen = self._lookup(list(dict.fromkeys(sources)))
        by_name: dict[str, tuple[RewardFunction, list[int]]] = {}
        for row, source in enumerate(sources):
            spec = chosen[source]
            entry = by_name.setdefault(spec.name, (spec, []))
            if entry[0] != spec:
                raise RewardConfigError(
                    f"data sources in this batch map to two different reward functions named "
                    f"{spec.name!r}; register one of them with a distinct name="
                )
            entry[1].append(row)
        return list(by_name.values())


def _check_lengths(batch: Mapping[str, Any], size: int) -> None:
    for key, value in batch.items():
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            raise ValueError(
                f"reward field {key!r} must be a per-sample list of length {size}, "
                f"got {type(value).__name__}"
            )
        if len(value) != size:
            raise ValueError(
                f"reward field {key!r} has {len(value)} entries but there are {size} completions"
            )


def _to_tensor(values: Sequence[float | None]) -> torch.Tensor:
    return torch.tensor([float("nan") if v is None else v for v in values], dtype=torch.float32)


def _weighted_sum(
    components: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    size: int,
    failure_value: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN-skipping weighted sum over components; samples with no value get ``failure_value``."""
    if not components:
        return torch.zeros(size), torch.zeros(size, dtype=torch.bool)
    stacked = torch.stack([components[n] for n in components])  # [K, B]
    w = torch.tensor([weights[n] for n in components], dtype=torch.float32).unsqueeze(1)
    present = ~torch.isnan(stacked)
    total = torch.where(present, stacked * w, torch.zeros_like(stacked)).sum(dim=0)
    all_none = ~present.any(dim=0)
    total = torch.where(all_none, torch.full_like(total, failure_value), total)
    return total, all_none


def _summary(prefix: str, values: torch.Tensor) -> dict[str, float]:
    kept = values[~torch.isnan(values)]
    if kept.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": kept.mean().item(),
        f"{prefix}/std": kept.std(correction=0).item(),
    }
