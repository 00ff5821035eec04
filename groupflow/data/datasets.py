"""Prompt datasets: load parquet / JSON-lines / in-memory rows into validated `PromptRow`s.

Design decision: loading is readers by source plus one shared loop. Each reader (parquet in
bounded batches, JSON lines, a JSON array, an in-memory list) yields ``(raw row, index, line,
parse error)``, so validation (`groupflow.data.rows`) and skipping are the same for every
source. A malformed row is a `DataError` that names the file, the 0-based row index (plus the
1-based line number for JSON lines) and the field; `on_bad_row="skip"` turns that into a count
and one warning. Whole-number floats turned into ints are reported once per column and source.
Templating and the over-long filter, which need the tokenizer, are `groupflow.data.templating`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from groupflow.data.columns import RowMappingError
from groupflow.data.images import ImageLimits
from groupflow.data.rows import (
    IN_MEMORY_SOURCE,
    DataError,
    PromptRow,
    located_normalize,
    type_name,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ON_BAD_ROW_CHOICES",
    "SUPPORTED_EXTENSIONS",
    "NamedRows",
    "PromptDataset",
    "check_row_fields",
    "load_prompt_rows",
]

ON_BAD_ROW_CHOICES = ("error", "skip")
SUPPORTED_EXTENSIONS = (".parquet", ".jsonl", ".json")


@dataclass
class PromptDataset(Sequence[PromptRow]):
    """The validated rows of one or more sources, with the count of rows skipped as malformed."""

    rows: list[PromptRow]
    num_skipped: int = 0
    first_skip_reason: str | None = None
    sources: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):  # type: ignore[override]
        return self.rows[i]

    def __iter__(self) -> Iterator[PromptRow]:
        return iter(self.rows)


def _warn_whole_floats(source: str, seen: dict[str, list[Any]]) -> None:
    for key, (count, example) in seen.items():
        logger.warning(
            "%s: column '%s' holds whole numbers stored as floats in %d row(s) (e.g. %r); they are "
            "passed to rewards as ints (%d), not as the text %r. Store the column as int or "
            "string to keep it exact (e.g. leading zeros)",
            source,
            key,
            count,
            example,
            int(example),
            str(example),
        )


# --------------------------------------------------------------------------------------------
# Readers: each yields (raw_row, index, line, parse_error) so validation and skipping are shared
# --------------------------------------------------------------------------------------------

_RawItem = tuple[Any, int, int | None, str | None]


def _read_parquet(path: Path) -> Iterator[_RawItem]:
    import pyarrow.parquet as pq

    index = 0
    # Batches keep memory bounded for large files; to_pylist turns structs and lists of structs
    # into plain dicts / lists, so nothing downstream sees pyarrow types.
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        for raw in batch.to_pylist():
            yield raw, index, None, None
            index += 1


def _read_json_lines(path: Path, text: str) -> Iterator[_RawItem]:
    index = 0
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue  # blank lines (e.g. a trailing newline) are not rows
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            yield None, index, line_no, f"invalid JSON line: {exc.msg} at column {exc.colno}"
        else:
            yield raw, index, line_no, None
        index += 1


def _read_json(path: Path) -> Iterator[_RawItem]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        # A .json file may also be one JSON array of rows; JSON lines rows are objects, so a
        # leading "[" is unambiguous.
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"invalid JSON array: {exc.msg} at line {exc.lineno}", source=str(path)
            ) from None
        for index, raw in enumerate(rows):
            yield raw, index, None, None
        return
    yield from _read_json_lines(path, text)


def _read_file(path: Path) -> Iterator[_RawItem]:
    if not path.exists():
        raise FileNotFoundError(f"prompt dataset file not found: {path}")
    if path.is_dir():
        raise IsADirectoryError(
            f"prompt dataset path is a directory: {path}; pass the data files (a list of paths)"
        )
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(path)
    if suffix in (".jsonl", ".json"):
        return _read_json(path)
    raise ValueError(
        f"unsupported prompt dataset extension '{path.suffix}' for {path}; "
        f"supported: {', '.join(SUPPORTED_EXTENSIONS)}"
    )


def _read_memory(rows: Sequence[Any]) -> Iterator[_RawItem]:
    for index, raw in enumerate(rows):
        yield raw, index, None, None


def _split_sources(
    source: Any, memory_name: str = IN_MEMORY_SOURCE
) -> list[tuple[str, Iterator[_RawItem]]]:
    """Resolve `source` into (name, raw-row iterator) pairs, one per file or one in-memory list."""
    if isinstance(source, (str, os.PathLike)):
        return [(str(source), _read_file(Path(source)))]
    if isinstance(source, NamedRows):
        return [(source.name, _read_memory(source.rows))]
    if isinstance(source, Sequence) and not isinstance(source, (bytes, bytearray)):
        if all(isinstance(s, (str, os.PathLike, NamedRows)) for s in source) and source:
            return [
                (s.name, _read_memory(s.rows))
                if isinstance(s, NamedRows)
                else (str(s), _read_file(Path(s)))
                for s in source
            ]
        if all(isinstance(s, dict) for s in source):
            return [(memory_name, _read_memory(source))]
        # Mixed lists: the in-memory reader reports each non-dict row precisely.
        if not any(isinstance(s, (str, os.PathLike)) for s in source):
            return [(memory_name, _read_memory(source))]
        raise TypeError(
            "prompt dataset source list mixes paths and rows; pass either a list of file paths "
            "or a list of row dicts"
        )
    raise TypeError(
        f"prompt dataset source must be a path, a list of paths or a list of row dicts, "
        f"got {type_name(source)}"
    )


@dataclass(frozen=True)
class NamedRows:
    """In-memory rows under a name errors use (``hf://openai/gsm8k/main[train]``); may stand in a
    list of file paths."""

    name: str
    rows: Sequence[Any]


def load_prompt_rows(
    source: Any,
    *,
    on_bad_row: str = "error",
    name: str = IN_MEMORY_SOURCE,
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    images: ImageLimits | None = None,
) -> PromptDataset:
    """Load and validate prompt rows.

    source: a `.parquet` / `.jsonl` / `.json` path, a list of such paths (concatenated in order),
        or an in-memory list of row dicts. `.json` holds JSON lines or one JSON array of rows.
    on_bad_row: "error" raises `DataError` at the first malformed row; "skip" drops malformed rows,
        counts them in `num_skipped` and logs one warning with the first reason.
    name: what errors call an in-memory list (e.g. "train_dataset").
    prepare: maps each raw row before validation (``groupflow.data.columns.row_mapper``); its
        ``RowMappingError`` is reported with the row's location.
    images: the pixel budget of prompt images (``groupflow.data.images``; None: its defaults).
    Raises `DataError` also when no valid rows remain (an empty dataset cannot train).
    """
    if on_bad_row not in ON_BAD_ROW_CHOICES:
        raise ValueError(f"on_bad_row must be one of {ON_BAD_ROW_CHOICES}, got {on_bad_row!r}")
    sources = _split_sources(source, name)
    rows: list[PromptRow] = []
    skipped: list[DataError] = []
    for name, items in sources:
        whole_floats: dict[str, list[Any]] = {}
        for raw, index, line, parse_error in items:
            try:
                if parse_error is not None:
                    raise DataError(parse_error, source=name, index=index, line=line)
                if prepare is not None:
                    raw = _located_prepare(prepare, raw, name, index, line)
                row = located_normalize(raw, name, index, line, whole_floats, images)
            except DataError as err:
                if on_bad_row == "error":
                    raise
                skipped.append(err)
                continue
            rows.append(row)
        _warn_whole_floats(name, whole_floats)
    names = [name for name, _ in sources]
    first = str(skipped[0]) if skipped else None
    if skipped:
        logger.warning(
            "skipped %d malformed prompt rows (kept %d); first: %s", len(skipped), len(rows), first
        )
    if not rows:
        detail = f"; all {len(skipped)} rows were malformed, first: {first}" if skipped else ""
        raise DataError(f"no prompt rows{detail}", source=", ".join(names) or IN_MEMORY_SOURCE)
    return PromptDataset(
        rows=rows, num_skipped=len(skipped), first_skip_reason=first, sources=names
    )


def check_row_fields(
    rows: Sequence[PromptRow],
    missing: Callable[[dict[str, Any]], list[tuple[str, str]]],
    *,
    on_bad_row: str = "error",
    split: str = "train",
) -> tuple[list[PromptRow], int]:
    """Rows that carry every field their consumer needs; ``(kept rows, number skipped)``.

    ``missing(row.fields)`` returns ``(field, reason)`` pairs (e.g. a reward's required fields
    that the row lacks or holds as null). The first such row is a `DataError` naming its source,
    row and field, or, with ``on_bad_row="skip"``, every such row is dropped, counted and
    reported in one warning; no rows left is an error either way.
    """
    if on_bad_row not in ON_BAD_ROW_CHOICES:
        raise ValueError(f"on_bad_row must be one of {ON_BAD_ROW_CHOICES}, got {on_bad_row!r}")
    kept: list[PromptRow] = []
    skipped: list[DataError] = []
    for row in rows:
        problems = missing(row.fields)
        if not problems:
            kept.append(row)
            continue
        field_name, reason = problems[0]
        err = DataError(reason, source=row.source, index=row.index, field=field_name)
        if on_bad_row == "error":
            raise err
        skipped.append(err)
    if skipped:
        logger.warning(
            "%s data: skipped %d row(s) lacking a field their reward needs (kept %d); first: %s",
            split,
            len(skipped),
            len(kept),
            skipped[0],
        )
    if not kept:
        raise DataError(
            f"no {split} rows left: all {len(skipped)} lack a field their reward needs; "
            f"first: {skipped[0]}",
            source=", ".join(dict.fromkeys(r.source for r in rows)) or IN_MEMORY_SOURCE,
        )
    return kept, len(skipped)


def _located_prepare(prepare, raw: Any, source: str, index: int, line: int | None) -> Any:
    try:
        return prepare(raw)
    except RowMappingError as problem:
        raise DataError(
            problem.reason, source=source, index=index, line=line, field=problem.field
        ) from None
