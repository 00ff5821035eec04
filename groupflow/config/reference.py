"""Every configuration key with its type, default, allowed values and description, read off the
pydantic schema: the source of the documentation site's configuration reference.

Design decision: a key's description is the comment its author already writes beside it in the
schema (the trailing ``# ...`` on the field's lines, else the comment lines directly above it), or
``Field(description=...)`` where one is given — one source, read in the code and on the site, so
the two cannot disagree. A section's description is its class docstring's first paragraph. The
walk is a pure function of the classes (no config is built); ``tests/config/test_reference.py``
requires a description for every key.
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

__all__ = ["Key", "Section", "config_reference", "field_comments"]


@dataclass(frozen=True)
class Key:
    path: str  # dotted, as written in YAML or an override: "rollout.max_staleness"
    type: str
    default: str  # "required" when the key has no default
    allowed: str  # Literal values or numeric bounds, "" when any value of the type is allowed
    description: str


@dataclass(frozen=True)
class Section:
    path: str  # "" for the top level
    description: str
    keys: tuple[Key, ...]


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """Field name → the comment attached to its annotated assignment in ``cls``'s own source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    out: dict[str, str] = {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    for node in body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
        text = [comments[n] for n in lines if n in comments]
        if not text:  # the comment block directly above the field
            n = node.lineno - 1
            while n in comments and n not in code_lines:
                text.insert(0, comments[n])
                n -= 1
        text = [t for t in text if not t.startswith(("fmt:", "noqa", "type:", "pragma"))]
        if text:
            out[node.target.id] = " ".join(text)
    return out


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is typing.Annotated:
        return _type_name(get_args(annotation)[0])
    if origin is Literal:
        return "str" if all(isinstance(a, str) for a in get_args(annotation)) else "literal"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _literals(annotation: Any) -> list[Any]:
    origin = get_origin(annotation)
    if origin is Literal:
        return list(get_args(annotation))
    if origin in (typing.Annotated, typing.Union, types.UnionType, list, tuple):
        return [v for a in get_args(annotation) for v in _literals(a)]
    return []


def _bounds(field: Any) -> str:
    marks = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    parts = [f"{marks[name]} {getattr(m, name)}" for m in field.metadata for name in marks
             if getattr(m, name, None) is not None]  # fmt: skip
    return ", ".join(parts)


def _default(field: Any) -> str:
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:  # a factory that takes the validated data
            return "computed"
        return "{}" if isinstance(value, BaseModel) else repr(value)
    if field.default is PydanticUndefined:
        return "required"
    return repr(field.default)


def _sections_in(annotation: Any) -> list[type[BaseModel]]:
    """The section classes a field holds (``X | None``, ``list[X]``, ``dict[str, X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [s for a in get_args(annotation) for s in _sections_in(a)]


def _doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    if cls.__doc__ is None or doc == inspect.getdoc(BaseModel):
        return ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def config_reference(root: type[BaseModel], prefix: str = "") -> list[Section]:
    """The sections under ``root`` (itself first), each with its keys, depth first."""
    comments = field_comments(root)
    keys, nested = [], []
    for name, field in root.model_fields.items():
        path = f"{prefix}{name}"
        allowed = _literals(field.annotation)
        sections = _sections_in(field.annotation)
        # a section without a comment of its own is described by its class docstring
        described = field.description or comments.get(name) or "".join(map(_doc, sections[:1]))
        keys.append(Key(
            path=path, type=_type_name(field.annotation), default=_default(field),
            allowed=" · ".join(repr(v) for v in allowed) if allowed else _bounds(field),
            description=" ".join(described.split()),
        ))  # fmt: skip
        for section in sections:
            suffix = "[]" if get_origin(field.annotation) is list else ""
            nested.append((f"{path}{suffix}.", section))
    out = [Section(prefix.rstrip("."), _doc(root), tuple(keys))]
    for sub_prefix, section in nested:
        out.extend(config_reference(section, sub_prefix))
    return out
