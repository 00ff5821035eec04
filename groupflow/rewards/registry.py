"""Named rewards, user rewards by import path, and default rewards per ``data_source``.

Design decision: configs never hold callables, only names: ``{name: gsm8k, weight: 1.0,
kwargs: {mode: flexible}}`` builds a built-in through its factory, and ``{function:
"pkg.module:fn"}`` imports a user function. Both are resolved and checked (options against the
factory's signature, the function's signature by :class:`RewardFunction`) when the runner is
built, so a typo fails at load with the valid names and the closest one. With no ``rewards``
configured, each sample is scored by the reward registered for its ``data_source`` (verl's
``default_compute_score`` behaviour); :func:`register_data_source` adds sources.

Defaults: ``openai/gsm8k`` uses ``gsm8k`` in strict mode (verl's default, so scores compare with
verl's); the MATH sources in :data:`MATH_DATA_SOURCES` use ``math_boxed``; the code sources in
:data:`CODE_DATA_SOURCES` (verl's ``prime_code`` sources) use ``code_tests``.
"""

from __future__ import annotations

import difflib
import inspect
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from groupflow.rewards.base import (
    DEFAULT_TIMEOUT_S,
    RewardConfigError,
    RewardFunction,
    RewardRunner,
    describe_callable,
)
from groupflow.rewards.code import make_code_tests_reward
from groupflow.rewards.format import make_format_tags_reward
from groupflow.rewards.instructions import make_ifeval_reward, make_instructions_reward
from groupflow.rewards.judge import make_judge_reward
from groupflow.rewards.length import make_length_penalty, make_overlong_penalty
from groupflow.rewards.math import make_gsm8k_reward, make_math_boxed_reward
from groupflow.rewards.trajectory import make_env_reward, make_tool_use_reward
from groupflow.utils import imports

RewardFactory = Callable[..., Callable[..., Any]]

_BUILTINS: dict[str, RewardFactory] = {
    "gsm8k": make_gsm8k_reward,
    "math_boxed": make_math_boxed_reward,
    "format_tags": make_format_tags_reward,
    "overlong_penalty": make_overlong_penalty,
    "length_penalty": make_length_penalty,
    "code_tests": make_code_tests_reward,
    "env_reward": make_env_reward,  # multi-turn: the environment's per-turn rewards, reduced
    "tool_use": make_tool_use_reward,  # multi-turn: did the sample call a tool
    "instructions": make_instructions_reward,  # IFEval-style constraints, partial credit
    "ifeval": make_ifeval_reward,  # rows in IFEval's format, the official checkers, partial credit
    "judge": make_judge_reward,  # an LLM judge behind any OpenAI-compatible endpoint
}

SPEC_KEYS = ("name", "function", "label", "weight", "kwargs", "failure_value", "monitor")

GSM8K_DATA_SOURCES = ("openai/gsm8k",)
MATH_DATA_SOURCES = (
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "EleutherAI/hendrycks_math",
    "hendrycks/competition_math",
)

# verl scores these with prime_code (pass fraction of test cases in reward_model.ground_truth).
CODE_DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")


class UnknownRewardError(RewardConfigError):
    """A reward name that is not registered."""


class UnknownDataSourceError(RewardConfigError):
    """A batch holds samples whose ``data_source`` has no registered reward."""


def _suggest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


# --------------------------------------------------------------------------------------------
# Built-in (named) rewards


def reward_names() -> list[str]:
    """Names usable as ``{name: ...}`` in a config."""
    return sorted(_BUILTINS)


def register_reward(name: str, factory: RewardFactory, *, overwrite: bool = False) -> None:
    """Make ``factory(**kwargs) -> reward callable`` available as ``{name: <name>}``."""
    if not isinstance(name, str) or not name:
        raise RewardConfigError(f"reward name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise RewardConfigError(f"reward {name!r}: factory must be callable, got {factory!r}")
    if name in _BUILTINS and not overwrite:
        raise RewardConfigError(
            f"reward {name!r} is already registered ({describe_callable(_BUILTINS[name])}); "
            "pass overwrite=True to replace it"
        )
    _BUILTINS[name] = factory


def get_reward(name: str, **options: Any) -> Callable[..., Any]:
    """Build the registered reward ``name`` with ``options`` (checked against its factory)."""
    if name not in _BUILTINS:
        raise UnknownRewardError(
            f"unknown reward {name!r}; valid names: {reward_names()}{_suggest(name, reward_names())}"
            " (or reference your own with function: 'package.module:function')"
        )
    factory = _BUILTINS[name]
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    valid = [n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    unknown = [k for k in options if k not in params]
    if unknown and not takes_any:
        raise RewardConfigError(
            f"reward {name!r} has no option {unknown[0]!r}; valid options: {valid}"
            + _suggest(unknown[0], valid)
        )
    missing = [
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and n not in options
    ]
    if missing:
        raise RewardConfigError(
            f"reward {name!r} requires option(s) {missing} (set them under kwargs:); "
            f"valid options: {valid}"
        )
    return factory(**options)


# --------------------------------------------------------------------------------------------
# User rewards by import path


def resolve_import_path(path: str) -> Callable[..., Any]:
    """Import ``"package.module:function"`` (the attribute may be dotted: ``module:Class.fn``; the
    module may be a file: ``path/to/file.py:fn``) through the resolver every extension point uses."""
    target = imports.resolve_import_path(path, f"reward function {path!r}", RewardConfigError)
    if not callable(target):
        raise RewardConfigError(
            f"reward function {path!r} is a {type(target).__name__}, not a callable"
        )
    return target


def _attr_name(path: str) -> str:
    """Default component name of "pkg.module:Class.fn": "fn"."""
    return path.rsplit(":", 1)[-1].rsplit(".", 1)[-1]


# --------------------------------------------------------------------------------------------
# Config specs -> runner


def _as_mapping(spec: Any, where: str) -> dict[str, Any]:
    if hasattr(spec, "model_dump"):  # a pydantic config object
        spec = spec.model_dump()
    if not isinstance(spec, Mapping):
        raise RewardConfigError(
            f"{where} must be a mapping like {{name: gsm8k, weight: 1.0}}, "
            f"got {type(spec).__name__}"
        )
    return {k: v for k, v in spec.items() if v is not None}


def make_reward_function(spec: Any, where: str = "reward") -> RewardFunction:
    """One config entry -> :class:`RewardFunction`.

    Keys: ``name`` (a built-in, see :func:`reward_names`) or ``function`` ("module:attr");
    ``label`` (component name, to use one built-in twice; defaults to ``name``, else the
    function's attribute name); ``weight`` (default 1.0); ``kwargs`` (a built-in's options, or
    fixed keyword arguments for a user function); ``failure_value`` (default: the runner's);
    ``monitor`` (true: scored and logged, not trained on).
    """
    entry = _as_mapping(spec, where)
    unknown = [k for k in entry if k not in SPEC_KEYS]
    if unknown:
        raise RewardConfigError(
            f"{where}: unknown key {unknown[0]!r}; valid keys: {list(SPEC_KEYS)}"
            + _suggest(unknown[0], SPEC_KEYS)
        )
    options = entry.get("kwargs", {})
    if not isinstance(options, Mapping):
        raise RewardConfigError(f"{where}: kwargs must be a mapping, got {type(options).__name__}")
    weight = entry.get("weight", 1.0)
    failure_value = entry.get("failure_value")
    monitor = entry.get("monitor", False)
    if "function" in entry:
        fn = resolve_import_path(entry["function"])
        name = entry.get("label") or entry.get("name") or _attr_name(entry["function"])
        return RewardFunction(name, fn, weight, failure_value, dict(options), monitor)
    if "name" not in entry:
        raise RewardConfigError(
            f"{where}: needs 'name' (one of {reward_names()}) or 'function' ('module:attr')"
        )
    fn = get_reward(entry["name"], **options)
    name = entry.get("label") or entry["name"]
    return RewardFunction(name, fn, weight, failure_value, monitor=monitor)


def build_reward_runner(
    specs: Sequence[Any] | None,
    failure_value: float = 0.0,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    functions: Sequence[RewardFunction] = (),
    normalize: str = "none",
    normalize_eps: float = 1e-6,
) -> RewardRunner:
    """The trainer's entry point: a runner for the configured rewards plus ``functions`` (reward
    objects built in Python), or, when there are none, one that picks each sample's reward from
    its ``data_source``. ``timeout_s`` limits every call (None: no limit); ``normalize`` and
    ``normalize_eps`` choose how components combine (:mod:`groupflow.rewards.combine`)."""
    if not specs and not functions:
        return RewardRunner.by_data_source(
            data_source_rewards, failure_value=failure_value, timeout_s=timeout_s,
            normalize=normalize, normalize_eps=normalize_eps,
        )  # fmt: skip
    if isinstance(specs, (str, Mapping)):
        raise RewardConfigError(
            f"rewards must be a list of mappings like [{{name: gsm8k, weight: 1.0}}], "
            f"got {type(specs).__name__}"
        )
    functions = list(functions)
    configured = []
    for i, spec in enumerate(specs or ()):
        try:
            configured.append(make_reward_function(spec, where=f"rewards[{i}]"))
        except RewardConfigError as exc:
            if str(exc).startswith(f"rewards[{i}]"):
                raise
            raise type(exc)(f"rewards[{i}]: {exc}") from exc
    functions = configured + functions
    names = [f.name for f in functions]
    repeated = sorted(n for n, c in Counter(names).items() if c > 1)
    if repeated:
        raise RewardConfigError(
            f"rewards: component names must be unique, {repeated} appear more than once; "
            "give each a distinct label:"
        )
    return RewardRunner(
        functions, failure_value=failure_value, timeout_s=timeout_s, normalize=normalize,
        normalize_eps=normalize_eps,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Default rewards per data_source

# A source's reward, or the name of the built-in that scores it, built the first time a batch (or
# a dataset row) needs it: building ``code_tests`` resolves the code sandbox, which a run that
# executes no model-written code must never need (nor fail on where no sandbox works).
_DATA_SOURCES: dict[str, RewardFunction | str] = {}
_SHARED_BUILTINS: dict[str, RewardFunction] = {}


def _shared_builtin(name: str) -> RewardFunction:
    """One instance per built-in, so sources sharing a reward form one component."""
    if name not in _SHARED_BUILTINS:
        _SHARED_BUILTINS[name] = RewardFunction(name, get_reward(name))
    return _SHARED_BUILTINS[name]


def _entry_name(entry: RewardFunction | str) -> str:
    return entry if isinstance(entry, str) else entry.name


def _built(entry: RewardFunction | str) -> RewardFunction:
    return _shared_builtin(entry) if isinstance(entry, str) else entry


def _as_reward_function(fn: Any, name: str | None) -> RewardFunction | str:
    if isinstance(fn, RewardFunction):
        return fn
    if isinstance(fn, str):
        if ":" in fn:
            return RewardFunction(name or _attr_name(fn), resolve_import_path(fn))
        if name is None:
            if fn not in _BUILTINS:
                get_reward(fn)  # raises UnknownRewardError with the valid names
            return fn  # built on first use
        return RewardFunction(name, get_reward(fn))
    if callable(fn):
        return RewardFunction(name or getattr(fn, "__name__", type(fn).__name__), fn)
    raise RewardConfigError(
        f"data source reward must be a callable, a built-in name {reward_names()} or "
        f"'module:function', got {fn!r}"
    )


def register_data_source(
    source: str, fn: Any, *, name: str | None = None, overwrite: bool = False
) -> RewardFunction | str:
    """Score samples whose ``data_source`` is ``source`` with ``fn`` when no rewards are set.

    ``fn``: a reward callable, a built-in name ("gsm8k"), "module:function", or a
    :class:`RewardFunction`. ``name`` is its component name (defaults to the function's name);
    two different functions cannot share a name. A built-in named without ``name`` is built the
    first time a batch of that source is scored (the return value is then its name).
    """
    if not isinstance(source, str) or not source:
        raise RewardConfigError(f"data_source must be a non-empty string, got {source!r}")
    if source in _DATA_SOURCES and not overwrite:
        raise RewardConfigError(
            f"data_source {source!r} already has reward {_entry_name(_DATA_SOURCES[source])!r}; "
            "pass overwrite=True to replace it"
        )
    reward = _as_reward_function(fn, name)
    for other_source, other in _DATA_SOURCES.items():
        same_name = _entry_name(other) == _entry_name(reward)
        if same_name and other != reward and other_source != source:
            raise RewardConfigError(
                f"data_source {source!r}: the name {_entry_name(reward)!r} is already used by a "
                f"different reward (for {other_source!r}); pass name='...' to tell them apart"
            )
        if other == reward:
            reward = other  # reuse the instance so both sources form one component
    _DATA_SOURCES[source] = reward
    return reward


def registered_data_sources() -> dict[str, str]:
    """``{data_source: reward name}`` for every registered source."""
    return {source: _entry_name(reward) for source, reward in sorted(_DATA_SOURCES.items())}


def data_source_rewards(sources: Sequence[str]) -> dict[str, RewardFunction]:
    """The reward for each distinct source; raises :class:`UnknownDataSourceError` naming every
    unknown one (the lookup used by ``RewardRunner.by_data_source``)."""
    unknown = [s for s in dict.fromkeys(sources) if s not in _DATA_SOURCES]
    if unknown:
        known = sorted(_DATA_SOURCES)
        hint = _suggest(unknown[0], known) if isinstance(unknown[0], str) else ""
        raise UnknownDataSourceError(
            f"no reward registered for data_source {', '.join(repr(s) for s in unknown)}"
            f"{hint or '.'} Known sources: {known}. Register one with "
            f'groupflow.rewards.register_data_source("{unknown[0]}", fn), or list rewards '
            "explicitly in the config (rewards: [{name: gsm8k}])."
        )
    return {s: _built(_DATA_SOURCES[s]) for s in dict.fromkeys(sources)}


for _source in GSM8K_DATA_SOURCES:
    register_data_source(_source, "gsm8k")
for _source in MATH_DATA_SOURCES:
    register_data_source(_source, "math_boxed")
for _source in CODE_DATA_SOURCES:
    register_data_source(_source, "code_tests")

# The built-in synthetic tasks (groupflow.data.synthetic) score by exact match with partial credit.
register_data_source("groupflow/reverse", "groupflow.data.synthetic:reverse_reward", name="reverse")
register_data_source("groupflow/add", "groupflow.data.synthetic:add_reward", name="add")
# the image demo's task (groupflow.data.shapes): a count, scored like the text tasks' answers
register_data_source("groupflow/shapes", "groupflow.data.shapes:count_reward", name="shapes")
register_data_source("groupflow/calc", "groupflow.data.synthetic:answer_match_reward", name="calc")
register_data_source("groupflow/instructions", "instructions")
register_data_source("groupflow/ifeval_style", "ifeval")
