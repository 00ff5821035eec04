"""Prompt datasets: load parquet / JSON-lines / in-memory rows into validated `PromptRow`s.

Design decision: every row is validated and normalised once, at load time, into one small
dataclass — the prompt (a string or a list of chat messages) plus a flat `fields` dict that reward
functions receive by name. verl-style rows are accepted unchanged: their `reward_model`,
`data_source` and `extra_info` stay in `fields`, and `reward_model.ground_truth` is additionally
lifted to `fields["ground_truth"]`, so a reward never has to know which row shape it came from.
A malformed row is a `DataError` that names the file, the 0-based row index (plus the 1-based line
number for JSON lines) and the field; `on_bad_row="skip"` turns that into a count and one warning.
Whole-number floats in top-level columns become ints (with one warning per column): pandas stores
an int column with a missing value as float64, and "654321.0" is never the answer a reward wants.

Templating (`render_prompt`) and the over-long prompt filter (`filter_overlong`) live here too,
because they are the last dataset-level transformation before prompts reach the rollout engine.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from groupflow.data.columns import RowMappingError
from groupflow.data.images import (
    ImageLimits,
    ImageProblem,
    has_image_input,
    normalize_image_prompt,
    prompt_images,
)

logger = logging.getLogger(__name__)

ON_BAD_ROW_CHOICES = ("error", "skip")
OVERLONG_MODES = ("filter", "error")
SUPPORTED_EXTENSIONS = (".parquet", ".jsonl", ".json")
IN_MEMORY_SOURCE = "<in-memory>"

Prompt = str | list[dict[str, Any]]


class DataError(ValueError):
    """A malformed dataset row, located by source, row index, line (JSON lines) and field."""

    def __init__(
        self,
        reason: str,
        *,
        source: str,
        index: int | None = None,
        line: int | None = None,
        field: str | None = None,
    ) -> None:
        self.reason = reason
        self.source = source
        self.index = index
        self.line = line
        self.field = field
        super().__init__(self._format())

    def _format(self) -> str:
        where = [self.source]
        if self.index is not None:
            where.append(f"row {self.index}" + (f" (line {self.line})" if self.line else ""))
        if self.field is not None:
            where.append(f"field '{self.field}'")
        return f"{', '.join(where)}: {self.reason}"


@dataclass(frozen=True)
class PromptRow:
    """One validated prompt.

    `prompt` is a non-empty string or a non-empty list of `{"role", "content", ...}` messages.
    `fields` holds every other column of the row by name (handed to reward functions), plus
    `ground_truth` lifted from `reward_model.ground_truth` for verl-style rows.
    `source` / `index` locate the row (file path or "<in-memory>", 0-based row index).
    """

    prompt: Prompt
    fields: dict[str, Any]
    source: str
    index: int

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list)


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


# --------------------------------------------------------------------------------------------
# Row validation (pure: raw dict -> PromptRow, or DataError without location)
# --------------------------------------------------------------------------------------------


class _RowProblem(Exception):
    """Internal: a validation failure before the caller attaches source/index/line."""

    def __init__(self, field: str | None, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


def _type_name(value: Any) -> str:
    return type(value).__name__


def _validate_messages(messages: list) -> None:
    if not messages:
        raise _RowProblem("prompt", "empty list of chat messages")
    for i, msg in enumerate(messages):
        where = f"prompt[{i}]"
        if not isinstance(msg, dict):
            raise _RowProblem(where, f"chat message must be a dict, got {_type_name(msg)}")
        for key in ("role", "content"):
            if key not in msg or msg[key] is None:
                raise _RowProblem(f"{where}.{key}", f"chat message is missing '{key}'")
        if not isinstance(msg["role"], str) or not msg["role"].strip():
            raise _RowProblem(
                f"{where}.role", f"role must be a non-empty string, got {msg['role']!r}"
            )
        if not isinstance(msg["content"], str):
            # Content-part lists (images) take groupflow.data.images' path before this; anything
            # else is named here rather than by the chat template later.
            raise _RowProblem(
                f"{where}.content", f"content must be a string, got {_type_name(msg['content'])}"
            )
    if not any(msg["content"].strip() for msg in messages):
        raise _RowProblem("prompt", "empty prompt: every chat message has empty content")


def _validate_prompt(prompt: Any) -> Prompt:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _RowProblem("prompt", "empty prompt string")
        return prompt
    if isinstance(prompt, (list, tuple)):
        messages = [dict(m) if isinstance(m, dict) else m for m in prompt]
        _validate_messages(messages)
        return messages
    raise _RowProblem(
        "prompt", f"prompt must be a string or a list of chat messages, got {_type_name(prompt)}"
    )


def _check_optional_type(raw: dict, key: str, types: tuple[type, ...], desc: str) -> None:
    value = raw.get(key)
    if value is not None and not isinstance(value, types):
        raise _RowProblem(key, f"{key} must be {desc}, got {_type_name(value)}")


def _lift_ground_truth(raw: dict, fields: dict[str, Any]) -> None:
    reward_model = raw.get("reward_model")
    if reward_model is None:
        return
    if not isinstance(reward_model, dict):
        raise _RowProblem(
            "reward_model",
            f"reward_model must be a struct like {{'style': 'rule', 'ground_truth': ...}}, "
            f"got {_type_name(reward_model)}",
        )
    if reward_model.get("ground_truth") is None:
        raise _RowProblem("reward_model.ground_truth", "reward_model has no ground_truth")
    truth = reward_model["ground_truth"]
    if "ground_truth" in raw and raw["ground_truth"] is not None and raw["ground_truth"] != truth:
        raise _RowProblem(
            "ground_truth",
            f"top-level ground_truth {raw['ground_truth']!r} conflicts with "
            f"reward_model.ground_truth {truth!r}",
        )
    fields["ground_truth"] = truth


def normalize_row(raw: Any, *, source: str = IN_MEMORY_SOURCE, index: int = 0) -> PromptRow:
    """Validate one raw row (plain or verl-style) into a `PromptRow`; raises `DataError`."""
    return _located_normalize(raw, source, index, None)


def _whole_floats_to_ints(fields: dict[str, Any], seen: dict[str, list[Any]]) -> None:
    """Top-level columns (and ``reward_model.ground_truth``) holding whole-number floats get ints.

    A float column of whole numbers is, far more often than not, an int column that pandas
    widened to float64 because a value was missing; handed on as is, a reward comparing text sees
    "654321.0" for the answer 654321 and scores every sample wrong. ``seen`` collects, per
    column, the count and the first value, for one warning per column.
    """
    for key, value in fields.items():
        if isinstance(value, float) and value.is_integer():
            fields[key] = int(value)
            seen.setdefault(key, [0, value])[0] += 1
    reward_model = fields.get("reward_model")
    if isinstance(reward_model, dict):
        truth = reward_model.get("ground_truth")
        if isinstance(truth, float) and truth.is_integer():
            fields["reward_model"] = {**reward_model, "ground_truth": int(truth)}


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


def _normalize(
    raw: Any,
    source: str,
    index: int,
    seen: dict[str, list[Any]] | None = None,
    images: ImageLimits | None = None,
) -> PromptRow:
    if not isinstance(raw, dict):
        raise _RowProblem(None, f"row must be a JSON object / dict, got {_type_name(raw)}")
    if raw.get("prompt") is None:
        raise _RowProblem("prompt", f"missing prompt (row keys: {sorted(raw)})")
    if has_image_input(raw):
        return _normalize_with_images(raw, source, index, seen, images or ImageLimits())
    prompt = _validate_prompt(raw["prompt"])
    _check_optional_type(raw, "data_source", (str,), "a string")
    _check_optional_type(raw, "ability", (str,), "a string")
    _check_optional_type(raw, "extra_info", (dict,), "a struct / dict")
    fields = {k: v for k, v in raw.items() if k != "prompt"}
    _lift_ground_truth(raw, fields)
    _whole_floats_to_ints(fields, {} if seen is None else seen)
    return PromptRow(prompt=prompt, fields=fields, source=source, index=index)


def _normalize_with_images(
    raw: dict, source: str, index: int, seen, limits: ImageLimits
) -> PromptRow:
    """A row that shows images (``groupflow.data.images``): its prompt becomes chat messages with
    decoded image parts; ``fields["images"]`` holds the decoded images for rewards that look at
    them, in place of the raw image column. Relative image paths resolve against the file's
    directory."""
    # a data file's (or a Hub dataset's) image paths are confined; rows built in Python are not
    is_file = source != IN_MEMORY_SOURCE and "://" not in source and Path(source).is_file()
    root = Path(source).parent if is_file else None
    try:
        prompt, column = normalize_image_prompt(raw, root, limits, is_file or "://" in source)
    except ImageProblem as problem:
        raise _RowProblem(problem.field, problem.reason) from None
    for i, msg in enumerate(prompt):
        if not isinstance(msg.get("role"), str) or not msg["role"].strip():
            raise _RowProblem(
                f"prompt[{i}].role", f"role must be a non-empty string, got {msg.get('role')!r}"
            )
    _check_optional_type(raw, "data_source", (str,), "a string")
    _check_optional_type(raw, "ability", (str,), "a string")
    _check_optional_type(raw, "extra_info", (dict,), "a struct / dict")
    fields = {k: v for k, v in raw.items() if k not in ("prompt", column)}
    fields["images"] = prompt_images(prompt)
    _lift_ground_truth(raw, fields)
    _whole_floats_to_ints(fields, {} if seen is None else seen)
    return PromptRow(prompt=prompt, fields=fields, source=source, index=index)


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
        f"got {_type_name(source)}"
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
                row = _located_normalize(raw, name, index, line, whole_floats, images)
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


def _located_normalize(
    raw: Any,
    source: str,
    index: int,
    line: int | None,
    seen: dict[str, list[Any]] | None = None,
    images: ImageLimits | None = None,
) -> PromptRow:
    try:
        return _normalize(raw, source, index, seen, images)
    except _RowProblem as problem:
        raise DataError(
            problem.reason, source=source, index=index, line=line, field=problem.field
        ) from None


# --------------------------------------------------------------------------------------------
# Templating and the over-long filter
# --------------------------------------------------------------------------------------------


def render_prompt(
    row: PromptRow | Prompt, tokenizer: Any, use_chat_template: bool | None = None
) -> str:
    """Render a prompt to the exact text the policy will be conditioned on.

    Chat messages go through `tokenizer.apply_chat_template(..., add_generation_prompt=True)`.
    A plain string is used as is, unless `use_chat_template=True`, which wraps it as one user
    message. `use_chat_template=False` with chat messages is an error (there is no faithful way
    to flatten messages without a template).
    """
    prompt = row.prompt if isinstance(row, PromptRow) else row
    name = _row_name(row)
    if isinstance(prompt, str):
        if not use_chat_template:
            return prompt
        messages = [{"role": "user", "content": prompt}]
    else:
        if use_chat_template is False:
            raise ValueError(
                f"{name}: prompt is a list of chat messages but use_chat_template=False; "
                "use a plain string prompt or enable the chat template"
            )
        messages = prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"{name}: the tokenizer has no chat template, so chat-message prompts cannot be "
            "rendered; use plain string prompts or set tokenizer.chat_template"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _row_name(row: Any) -> str:
    if isinstance(row, PromptRow):
        return f"{row.source}, row {row.index}"
    return "prompt"


def prompt_token_lengths(
    texts: Sequence[str],
    tokenizer: Any,
    *,
    add_special_tokens: bool = False,
    batch_size: int = 512,
) -> list[int]:
    """Token counts of rendered prompts, encoded in batches (fast tokenizers encode a batch in
    parallel in Rust, which is what makes filtering a large dataset quick)."""
    lengths: list[int] = []
    for start in range(0, len(texts), batch_size):
        chunk = list(texts[start : start + batch_size])
        encoded = tokenizer(
            chunk, add_special_tokens=add_special_tokens, return_attention_mask=False
        )["input_ids"]
        lengths.extend(len(ids) for ids in encoded)
    return lengths


def filter_overlong(
    rows: Iterable[PromptRow],
    tokenizer: Any,
    max_prompt_tokens: int,
    mode: str = "filter",
    *,
    use_chat_template: bool | None = None,
    add_special_tokens: bool = False,
    batch_size: int = 512,
) -> tuple[list[PromptRow], int]:
    """Drop (mode="filter", verl's default) or reject (mode="error") prompts whose templated
    token count exceeds `max_prompt_tokens`. Returns (kept_rows, num_filtered).

    `add_special_tokens` must match how the rollout engine encodes prompts; chat templates
    usually spell out their special tokens in the text, hence the default False.
    """
    if mode not in OVERLONG_MODES:
        raise ValueError(f"overlong prompt mode must be one of {OVERLONG_MODES}, got {mode!r}")
    if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int):
        raise TypeError(f"max_prompt_tokens must be an int, got {_type_name(max_prompt_tokens)}")
    if max_prompt_tokens <= 0:
        raise ValueError(f"max_prompt_tokens must be positive, got {max_prompt_tokens}")
    rows = list(rows)
    texts = [render_prompt(r, tokenizer, use_chat_template) for r in rows]
    lengths = prompt_token_lengths(
        texts, tokenizer, add_special_tokens=add_special_tokens, batch_size=batch_size
    )
    kept = [r for r, n in zip(rows, lengths) if n <= max_prompt_tokens]
    if mode == "error" and len(kept) < len(rows):
        row, n = next((r, n) for r, n in zip(rows, lengths) if n > max_prompt_tokens)
        raise DataError(
            f"prompt has {n} tokens after templating, more than max_prompt_tokens="
            f"{max_prompt_tokens} ({len(rows) - len(kept)} over-long prompts in total); raise "
            "the limit or use mode='filter'",
            source=row.source,
            index=row.index,
            field="prompt",
        )
    return kept, len(rows) - len(kept)
