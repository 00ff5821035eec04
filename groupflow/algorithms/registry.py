"""Name -> function registries for the algorithm building blocks.

Design decision: every family of interchangeable math (advantage estimators, policy losses,
aggregation modes, KL estimators) is a plain dict of functions behind one small `Registry` class,
so adding a variant is one function plus one decorator line and the trainer never branches on
algorithm names. Lookups fail loudly with the list of valid names and the closest match, and the
options a caller passes are checked against the registered function's keyword-only parameters,
so a typo such as `clip_eps_hgih` is an error instead of being silently ignored.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class UnknownNameError(ValueError):
    """A registry lookup used a name that is not registered."""


class UnknownOptionError(TypeError):
    """An option was passed that the selected function does not accept."""


def _suggestion(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


class Registry(Generic[F]):
    """A named collection of interchangeable functions.

    `kind` names the family in error messages ("advantage estimator", "KL estimator", ...).
    Aliases resolve to a canonical name; `names()` lists canonical names only.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}
        self._aliases: dict[str, str] = {}

    def register(
        self, name: str, *, aliases: tuple[str, ...] = (), override: bool = False
    ) -> Callable[[F], F]:
        """Decorator: `@REGISTRY.register("name")` adds the function and returns it unchanged."""

        def decorator(fn: F) -> F:
            self.add(name, fn, aliases=aliases, override=override)
            return fn

        return decorator

    def add(
        self, name: str, fn: F, *, aliases: tuple[str, ...] = (), override: bool = False
    ) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if not callable(fn):
            raise TypeError(f"{self.kind} {name!r} must be callable, got {type(fn).__name__}")
        for key in (name, *aliases):
            # Silently replacing a built-in would change results of every run that uses it.
            if not override and (key in self._entries or key in self._aliases):
                raise ValueError(
                    f"{self.kind} {key!r} is already registered; pass override=True to replace it"
                )
        self._entries[name] = fn
        for alias in aliases:
            self._aliases[alias] = name

    def unregister(self, name: str) -> None:
        """Remove a name and its aliases (mainly for tests that register temporary entries)."""
        canonical = self.canonical(name)
        del self._entries[canonical]
        self._aliases = {a: c for a, c in self._aliases.items() if c != canonical}

    def canonical(self, name: str) -> str:
        if not isinstance(name, str):
            raise TypeError(f"{self.kind} name must be a string, got {type(name).__name__}")
        if name in self._entries:
            return name
        if name in self._aliases:
            return self._aliases[name]
        valid = self.names()
        alias_text = ""
        if self._aliases:
            pairs = ", ".join(f"{a}->{c}" for a, c in sorted(self._aliases.items()))
            alias_text = f" (aliases: {pairs})"
        raise UnknownNameError(
            f"unknown {self.kind} {name!r}; valid names: {', '.join(valid)}{alias_text}"
            f"{_suggestion(name, [*valid, *self._aliases])}"
        )

    def get(self, name: str) -> F:
        return self._entries[self.canonical(name)]

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._entries or name in self._aliases)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={list(self.names())})"


def option_names(fn: Callable[..., Any]) -> tuple[str, ...] | None:
    """Keyword-only parameters of `fn` (its options); None if it takes **kwargs (accepts anything)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def check_options(
    fn: Callable[..., Any], opts: Mapping[str, Any], *, what: str, extra: tuple[str, ...] = ()
) -> None:
    """Raise UnknownOptionError if `opts` holds a key that `fn` does not declare keyword-only.

    `extra` lists options the caller consumes itself (they are valid but not passed to `fn`).
    """
    accepted = option_names(fn)
    if accepted is None:
        return
    valid = sorted({*accepted, *extra})
    for key in opts:
        if key not in accepted:
            raise UnknownOptionError(
                f"unknown option {key!r} for {what}; valid options: "
                f"{', '.join(valid) if valid else '(none)'}{_suggestion(key, valid)}"
            )
