"""Column mapping and prompt templates: a dataset's own columns -> groupflow's row shape.

Design decision: Hub datasets keep their authors' column names (GSM8K's ``question``/``answer``,
MATH's ``problem``/``solution``), so a config maps them instead of requiring a preprocessing
script (verl's ``examples/data_preprocess``): ``data.columns`` renames (``{prompt: question}``:
the row's ``prompt`` is the dataset's ``question``), ``data.prompt_template`` builds the prompt
from any columns with ``str.format`` (``"{question} Answer after ####."``), and
``data.data_source`` fills ``data_source`` where a row has none (a Hub dataset's default is its
id, as verl writes it), which picks the reward when ``reward.functions`` is empty. The mapping is
one pure function per row; a missing column is reported with the row's location.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["RowMappingError", "row_mapper", "template_fields"]


class RowMappingError(Exception):
    """A row lacks a column the mapping or the template reads (``field`` names it)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


def template_fields(template: str) -> list[str]:
    """The column names ``template`` reads (``"{q} {a!r}"`` -> ``["q", "a"]``); a malformed
    template raises ValueError."""
    names = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name is None:
            continue
        if not name or name.isdigit():
            raise ValueError(
                f"prompt template {template!r}: use named fields like {{question}}, not "
                "positional ones ({} or {0}); write {{ and }} for literal braces"
            )
        names.append(name.split(".")[0].split("[")[0])
    return list(dict.fromkeys(names))


def row_mapper(
    columns: Mapping[str, str] | None = None,
    template: str | None = None,
    data_source: str | None = None,
) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
    """``raw row -> mapped row`` (a new dict), or None when there is nothing to map.

    ``columns``: groupflow field -> dataset column (the column is renamed; ``prompt: question``).
    ``template``: the prompt, formatted from the raw row's columns (before renaming).
    ``data_source``: set where the row has no ``data_source``.
    """
    columns = dict(columns or {})
    if template is not None:
        template_fields(template)  # fail at start-up on a malformed template
    if not columns and template is None and data_source is None:
        return None

    def apply(raw: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(raw, dict):
            return raw  # the row validator reports non-dict rows
        row = dict(raw)
        for target, column in columns.items():
            if column not in raw:
                raise RowMappingError(
                    column,
                    f"data.columns maps {target!r} to column {column!r}, which this row lacks "
                    f"(its columns: {sorted(raw)})",
                )
            row.pop(column)
            row[target] = raw[column]
        if template is not None:
            try:
                row["prompt"] = template.format(**raw)
            except KeyError as err:
                name = err.args[0]
                raise RowMappingError(
                    str(name),
                    f"data.prompt_template reads column {name!r}, which this row lacks "
                    f"(its columns: {sorted(raw)})",
                ) from None
        if data_source is not None and row.get("data_source") is None:
            row["data_source"] = data_source
        return row

    return apply
