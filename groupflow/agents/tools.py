"""Tools: plain Python callables a policy may call during a multi-turn rollout.

Design decision: a tool is an ordinary function with type hints and a Google-style docstring (an
``Args:`` section) — exactly what ``transformers`` chat templates describe with ``tools=`` — so a
user writes no schema by hand, and the description the model reads is generated from the code it
calls. Tools are resolved once at load (a built-in name or an import path, like rewards), with
``kwargs`` bound as fixed arguments that the schema then leaves out. A call's arguments are
checked against the schema's parameter names before the function runs; whatever it returns
becomes text (JSON for dicts and lists), which the caller caps in length.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from groupflow.utils.imports import resolve_import_path

__all__ = [
    "Tool",
    "ToolConfigError",
    "make_tool",
    "build_tools",
    "register_tool",
    "tool_names",
    "tool_result_text",
]


class ToolConfigError(ValueError):
    """A tool is misconfigured: unknown name, bad import path, no docstring, bad kwargs."""


@dataclass(frozen=True)
class Tool:
    """A callable plus the JSON schema chat templates take (``{"type": "function", ...}``)."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    timeout_s: float | None = None

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"].get("parameters", {}).get("properties", {})

    @property
    def required(self) -> list[str]:
        return list(self.schema["function"].get("parameters", {}).get("required", []))

    def argument_error(self, arguments: Any) -> str | None:
        """Why ``arguments`` cannot be passed to this tool, or None when they can."""
        if not isinstance(arguments, Mapping):
            return f"arguments must be a JSON object, got {type(arguments).__name__}"
        unknown = sorted(set(arguments) - set(self.parameters))
        if unknown:
            return f"unknown argument(s) {unknown}; parameters: {sorted(self.parameters)}"
        missing = [p for p in self.required if p not in arguments]
        if missing:
            return f"missing required argument(s) {missing}"
        return None


def _schema(fn: Callable[..., Any], name: str, bound: Sequence[str]) -> dict[str, Any]:
    from transformers.utils.chat_template_utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # transformers' parser raises its own exception types
        raise ToolConfigError(
            f"tool {name!r}: cannot describe {getattr(fn, '__qualname__', fn)!r} to the model "
            f"({exc}); give it type hints and a Google-style docstring with an 'Args:' section"
        ) from exc
    schema = json.loads(json.dumps(schema))  # a private copy
    function = schema["function"]
    function["name"] = name
    params = function.get("parameters", {})
    for key in bound:
        params.get("properties", {}).pop(key, None)
        if key in params.get("required", []):
            params["required"].remove(key)
    return schema


def make_tool(
    fn: Callable[..., Any],
    name: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout_s: float | None = None,
) -> Tool:
    """A :class:`Tool` from a function; ``kwargs`` are bound and hidden from the model."""
    if not callable(fn):
        raise ToolConfigError(f"tool {name!r}: expected a callable, got {type(fn).__name__}")
    name = name or getattr(fn, "__name__", None)
    if not name:
        raise ToolConfigError(f"tool {fn!r} has no __name__; give it a name")
    kwargs = dict(kwargs or {})
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in kwargs if k not in params and not takes_any]
    if unknown:
        raise ToolConfigError(
            f"tool {name!r}: {getattr(fn, '__qualname__', fn)} has no parameter(s) {unknown}; "
            f"its parameters are {list(params)}"
        )
    schema = _schema(fn, name, list(kwargs))
    bound = functools.partial(fn, **kwargs) if kwargs else fn
    return Tool(name, bound, schema, timeout_s)


# ----- built-in tools ----------------------------------------------------------------------------

# name -> factory(**kwargs) returning the tool function: registered objects, or import paths
# resolved on first use (so the sandbox module is imported only by runs that use it).
_BUILTIN: dict[str, Callable[..., Callable[..., Any]] | str] = {
    "calculator": "groupflow.tools.calculator:calculator_tool",
    "python": "groupflow.tools.python_tool:python_tool",  # the code sandbox
}


def register_tool(name: str):
    """Make ``factory(**kwargs) -> tool function`` available as ``{name: <name>}``."""

    def deco(factory):
        _BUILTIN[name] = factory
        return factory

    return deco


def tool_names() -> list[str]:
    return sorted(_BUILTIN)


def _builtin_factory(name: str) -> Callable[..., Callable[..., Any]]:
    factory = _BUILTIN[name]
    if isinstance(factory, str):
        factory = resolve_import_path(factory, f"built-in tool {name!r}", ToolConfigError)
        _BUILTIN[name] = factory
    return factory


# ----- from config ---------------------------------------------------------------------------------


def _entry(spec: Any, where: str) -> dict[str, Any]:
    if hasattr(spec, "model_dump"):
        spec = spec.model_dump()
    if not isinstance(spec, Mapping):
        raise ToolConfigError(f"{where} must be a mapping like {{name: calculator}}")
    return {k: v for k, v in spec.items() if v is not None}


def build_tools(specs: Sequence[Any], default_timeout_s: float | None = None) -> list[Tool]:
    """Config entries → tools. Each entry: ``name`` (a built-in) or ``function`` (an import
    path), optional ``label`` (the name the model calls it by), ``kwargs``, ``timeout_s``."""
    tools: list[Tool] = []
    for i, spec in enumerate(specs):
        where = f"rollout.tools[{i}]"
        entry = _entry(spec, where)
        kwargs = entry.get("kwargs", {})
        timeout = entry.get("timeout_s", default_timeout_s)
        if "function" in entry:
            fn = resolve_import_path(entry["function"], f"{where} function", ToolConfigError)
            name = entry.get("label") or entry.get("name") or getattr(fn, "__name__", None)
            try:
                tools.append(make_tool(fn, name, kwargs, timeout))
            except ToolConfigError as exc:
                raise ToolConfigError(f"{where}: {exc}") from None
            continue
        if "name" not in entry:
            raise ToolConfigError(f"{where}: needs 'name' (one of {tool_names()}) or 'function'")
        names = tool_names()
        if entry["name"] not in _BUILTIN:
            import difflib

            close = difflib.get_close_matches(entry["name"], names, n=1)
            raise ToolConfigError(
                f"{where}: unknown built-in tool {entry['name']!r}; built-ins: {names}"
                + (f"; did you mean {close[0]!r}?" if close else "")
            )
        try:
            fn = _builtin_factory(entry["name"])(**kwargs)
        except (TypeError, ValueError) as exc:  # a factory checks its options (python: limits)
            raise ToolConfigError(
                f"{where}.kwargs: bad kwargs for the {entry['name']!r} tool: {exc}"
            ) from exc
        except RuntimeError as exc:  # no isolating code sandbox here: the message says what to do
            raise ToolConfigError(f"{where}: built-in tool {entry['name']!r}: {exc}") from None
        tools.append(make_tool(fn, entry.get("label") or entry["name"], None, timeout))
    names = [t.name for t in tools]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ToolConfigError(f"rollout.tools: names must be unique; {dupes} repeat (set label:)")
    return tools


def tool_result_text(value: Any, max_chars: int | None = None) -> str:
    """A tool's return value as the text the model reads, cut to ``max_chars`` (marked)."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, (dict, list, tuple, int, float, bool)) or value is None:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            text = str(value)
    else:
        text = str(value)
    if max_chars is not None and len(text) > max_chars:
        text = text[:max_chars] + f"... [{len(text) - max_chars} more characters cut]"
    return text
