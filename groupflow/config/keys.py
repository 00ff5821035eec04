"""Key paths in the config schema: is ``a.b.c`` a key, and which valid key was meant.

Design decision: these walk a schema given to them (the root model is an argument), so the
loader's error messages and ``run.allow_config_changes``' check share one implementation without
the sections importing the root ``Config`` that contains them.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel

__all__ = ["section_type", "suggest", "unknown_key_problem"]


def suggest(root: type[BaseModel], loc: list[str]) -> str:
    """Closest valid key at the same level as the unknown one."""
    model: type[BaseModel] = root
    for part in loc[:-1]:
        if part.isdigit():  # an index into a list of sections
            continue
        field = model.model_fields.get(part)
        if field is None:
            return ""
        sub = section_type(field.annotation)
        if sub is None:
            return ""  # e.g. inside a list of reward specs
        model = sub
    valid = list(model.model_fields)
    close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
    parent = ".".join(loc[:-1])
    prefix = f"{parent}." if parent else ""
    if close:
        return f"; did you mean '{prefix}{close[0]}'?"
    return f"; valid keys here: {', '.join(valid)}"


def unknown_key_problem(root: type[BaseModel], parts: list[str]) -> str | None:
    """Why a dotted key names nothing in the schema (with the closest valid name), or None.

    Below a field that is not a section (a dict of options, a list of reward specs) any key is
    accepted: those hold free-form or indexed entries.
    """
    model: type[BaseModel] | None = root
    for depth, part in enumerate(parts):
        if model is None:
            return None
        if part.isdigit():  # an index into a list of sections (reward.functions.0)
            continue
        field = model.model_fields.get(part)
        if field is None:
            return f"is not a config key{suggest(root, parts[: depth + 1])}"
        model = section_type(field.annotation)
    return None


def section_type(annotation: Any) -> type[BaseModel] | None:
    candidates = typing.get_args(annotation) or (annotation,)
    for c in candidates:
        if isinstance(c, type) and issubclass(c, BaseModel):
            return c
    return None
