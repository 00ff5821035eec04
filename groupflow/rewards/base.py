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

Combining is :func:`groupflow.rewards.combine.combine_rewards`: the weighted sum, or with
``normalize="group"`` and the batch's ``group_ids`` the weighted sum of each reward's group
z-scores; ``reward/<name>/share`` logs how much of the within-group signal each reward carries. A
``monitor`` reward is scored and logged like the others but left out of the total: a held-out
check that the trained rewards are not being hacked.

Every call has a time limit (``timeout_s``, see :mod:`groupflow.rewards.calls`): a sample with no
value by then gets the failure value and counts in ``reward/<name>/timeouts`` as well as in
``failures``. Fields a function requires are checked per dataset row before training
(:meth:`RewardRunner.missing_fields`), so a row lacking one is reported, never scored as ``None``.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from groupflow.rewards.calls import MAX_ABANDONED, CallGuard
from groupflow.rewards.combine import NORMALIZE_MODES, combine_rewards
from groupflow.rewards.errors import (
    MissingRewardFieldError,
    RewardConfigError,
    RewardError,
    RewardOutputError,
    describe_callable,
)
from groupflow.rewards.scoring import score_component, take_rows

logger = logging.getLogger("groupflow.rewards")

# Field names every reward can receive; dataset fields come on top of these.
CORE_FIELDS = ("prompts", "completions")
# Fields the trainer supplies at scoring time, not the dataset.
RUNTIME_FIELDS = (*CORE_FIELDS, "completion_lengths")
# Default of ``reward.timeout_s``: generous for a remote judge scoring a whole batch, finite.
DEFAULT_TIMEOUT_S = 300.0


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
        monitor: scored and logged, but not part of the total (a held-out hacking monitor).
    """

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    failure_value: float | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    monitor: bool = False
    _params: _Params = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise RewardConfigError(f"reward name must be a non-empty string, got {self.name!r}")
        if not callable(self.fn):
            raise RewardConfigError(
                f"reward {self.name!r}: fn must be callable, got {type(self.fn).__name__}"
            )
        object.__setattr__(self, "weight", _finite_float(self.name, "weight", self.weight))
        if not isinstance(self.monitor, bool):
            raise RewardConfigError(
                f"reward {self.name!r}: monitor must be true or false, got {self.monitor!r}"
            )
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

    def missing_fields(self, row: Mapping[str, Any]) -> list[str]:
        """Fields this function requires that one dataset row lacks or holds as ``None``.

        A function may also declare ``fn.reference_fields = ("ground_truth", "answer")``: it
        reads the first of them a row has, so a row needs at least one (reported by the first
        name).
        """
        exempt = set(RUNTIME_FIELDS) | set(self.options)
        missing = [f for f in sorted(self._params.required - exempt) if row.get(f) is None]
        one_of: tuple[str, ...] = tuple(getattr(self.fn, "reference_fields", ()) or ())
        if one_of and all(row.get(f) is None for f in one_of):
            missing.append(" or ".join(one_of))
        return missing

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
        """Call ``fn`` on ``fields``; the result may be an awaitable (awaited by the caller)."""
        return self.fn(**self.select(fields))


def _finite_float(name: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardConfigError(f"reward {name!r}: {key} must be a finite number, got {value!r}")
    return float(value)


# --------------------------------------------------------------------------------------------
# The runner


@dataclass(frozen=True)
class RewardResult:
    """Rewards for one batch.

    total: [B] float32, the weighted sum of the trained components (NaN-skipping; of their group
        z-scores under ``normalize="group"`` when the call had ``group_ids``).
    components: name -> [B] float32 unweighted values, monitors included; NaN where the
        function returned ``None`` (or, in data_source mode, where the sample belongs to another
        source).
    metrics: ``reward/<name>/{mean,std,failures,timeouts}`` (and ``share`` with groups),
        ``reward/total/{mean,std}``, ``reward/all_none``. Means/stds skip NaN and are omitted
        when nothing is left; std is the population std (0 for a single value).
    weights: name -> weight of every trained component (monitors absent), for a caller that
        adds components of its own (the reward-model runner).
    """

    total: torch.Tensor
    components: dict[str, torch.Tensor]
    metrics: dict[str, float]
    weights: dict[str, float] = field(default_factory=dict)


# Maps the distinct data_source values of a batch to their rewards; raises a RewardConfigError
# naming every unknown source.
DataSourceLookup = Callable[[Sequence[str]], Mapping[str, RewardFunction]]


class RewardRunner:
    """Calls reward functions on a batch and combines them with weights.

    ``RewardRunner(specs)`` applies every spec to every sample.
    ``RewardRunner.by_data_source(lookup)`` picks each sample's reward from its ``data_source``
    field (see :mod:`groupflow.rewards.registry`); samples of different sources can share a batch.
    """

    def __init__(
        self,
        specs: Sequence[RewardFunction],
        failure_value: float = 0.0,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        normalize: str = "none",
        normalize_eps: float = 1e-6,
    ) -> None:
        specs = list(specs)
        if not specs:
            raise RewardConfigError(
                "RewardRunner needs at least one RewardFunction; use RewardRunner.by_data_source() "
                "to pick rewards from each sample's data_source"
            )
        self._init(specs, None, failure_value, timeout_s, normalize, normalize_eps)

    @classmethod
    def by_data_source(
        cls,
        lookup: DataSourceLookup,
        failure_value: float = 0.0,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        normalize: str = "none",
        normalize_eps: float = 1e-6,
    ) -> RewardRunner:
        """A runner that scores each sample with the reward registered for its ``data_source``.

        ``lookup(sources)`` returns ``{source: RewardFunction}`` for the batch's distinct
        sources and raises a :class:`RewardConfigError` subclass naming any unknown ones.
        """
        runner = cls.__new__(cls)
        runner._init([], lookup, failure_value, timeout_s, normalize, normalize_eps)
        return runner

    def _init(
        self,
        specs: list[RewardFunction],
        lookup: DataSourceLookup | None,
        failure_value: float,
        timeout_s: float | None,
        normalize: str,
        normalize_eps: float,
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
        if specs and all(s.monitor for s in specs):
            raise RewardConfigError(
                f"every reward ({names}) is a monitor: at least one must be trained on"
            )
        if normalize not in NORMALIZE_MODES:
            raise RewardConfigError(
                f"RewardRunner: normalize must be one of {list(NORMALIZE_MODES)}, got {normalize!r}"
            )
        if isinstance(normalize_eps, bool) or not (
            isinstance(normalize_eps, (int, float)) and 0 <= normalize_eps < math.inf
        ):
            raise RewardConfigError(
                f"RewardRunner: normalize_eps must be a finite number >= 0, got {normalize_eps!r}"
            )
        self.normalize, self.normalize_eps = normalize, float(normalize_eps)
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
        try:
            self.guard = CallGuard(timeout_s)
        except ValueError as exc:
            raise RewardConfigError(f"RewardRunner: {exc}") from None

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

    def missing_fields(self, row: Mapping[str, Any]) -> list[tuple[str, str]]:
        """``(field, reason)`` for every field a reward that scores this dataset row needs but
        the row lacks (or holds as ``None``); raises for a ``data_source`` with no reward."""
        if self._lookup is None:
            specs = self.specs
        elif row.get("data_source") is None:
            return [("data_source", "rewards are chosen by data_source, but this row has none")]
        else:
            specs = [self._lookup([row["data_source"]])[row["data_source"]]]
        return [
            (f.split(" or ")[0], f"reward {spec.name!r} needs field {f!r}, which this row lacks")
            for spec in specs
            for f in spec.missing_fields(row)
        ]

    def __call__(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        *,
        group_ids: Sequence[int] | torch.Tensor | None = None,
        **fields: Sequence[Any],
    ) -> RewardResult:
        """Score a batch; ``group_ids`` (training batches) enable ``normalize="group"`` and the
        ``share`` metrics, and are not passed to the reward functions."""
        size = len(completions)
        if group_ids is not None and len(group_ids) != size:
            raise ValueError(
                f"group_ids has {len(group_ids)} entries but there are {size} completions"
            )
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
            fields_subset = batch if len(rows) == size else take_rows(batch, rows)
            scored = score_component(spec, fields_subset, len(rows), failure, rows, self.guard)
            column = torch.full((size,), float("nan"), dtype=torch.float32)
            column[rows] = _to_tensor(scored.values)
            components[spec.name] = column
            metrics.update(_summary(f"reward/{spec.name}", column))
            metrics[f"reward/{spec.name}/failures"] = float(scored.failures)
            metrics[f"reward/{spec.name}/timeouts"] = float(scored.timeouts)
            metrics.update(_own_metrics(spec))
        self._check_abandoned()
        weights = {spec.name: spec.weight for spec, _ in groups if not spec.monitor}
        combined = self.combine(components, weights, group_ids)
        total, all_none = combined.total, combined.all_none
        metrics.update({f"reward/{k}/share": v for k, v in combined.shares.items()})
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
        return RewardResult(total, components, metrics, weights)

    def combine(self, components, weights, group_ids=None):
        """This runner's combination (``normalize``, ``failure_value``) of any components."""
        return combine_rewards(
            components, weights, self.failure_value, group_ids=group_ids,
            normalize=self.normalize, eps=self.normalize_eps,
        )  # fmt: skip

    def _check_abandoned(self) -> None:
        stuck = self.guard.abandoned()
        if stuck:
            logger.warning(
                "%d timed-out reward call(s) still running in background threads (%s); they "
                "cannot be stopped and their results are dropped",
                len(stuck),
                ", ".join(sorted(set(stuck))),
            )
        if len(stuck) >= MAX_ABANDONED:
            raise RewardError(
                f"{len(stuck)} timed-out calls of reward(s) {sorted(set(stuck))} are still running "
                f"after reward.timeout_s={self.guard.timeout_s:g} s; a sync reward cannot be "
                "stopped once started, so the run stops before they pile up. Fix the function "
                "(or make it async: async calls are cancelled at the deadline), or raise "
                "reward.timeout_s if it is only slow"
            )

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


def _own_metrics(spec: RewardFunction) -> dict[str, float]:
    """A reward's own counters since its last call, as ``reward/<name>/<key>``: a callable may
    offer ``take_metrics() -> {key: number}`` (the code reward's sandbox failures, the judge's
    invalid verdicts)."""
    take = getattr(spec.fn, "take_metrics", None)
    if not callable(take):
        return {}
    own = take()
    if not isinstance(own, Mapping) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
        for k, v in own.items()
    ):
        raise RewardOutputError(
            f"reward {spec.name!r}: take_metrics() must return {{name: number}}, got {own!r}"
        )
    return {f"reward/{spec.name}/{k}": float(v) for k, v in own.items()}


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


def _summary(prefix: str, values: torch.Tensor) -> dict[str, float]:
    kept = values[~torch.isnan(values)]
    if kept.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": kept.mean().item(),
        f"{prefix}/std": kept.std(correction=0).item(),
    }
