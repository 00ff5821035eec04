"""Prompt rows: the `PromptRow` every consumer sees, and the validation of one raw row into it.

Design decision: every row is validated and normalised once, at load time, into one small
dataclass — the prompt (a string or a list of chat messages) plus a flat `fields` dict that reward
functions receive by name. verl-style rows are accepted unchanged: their `reward_model`,
`data_source` and `extra_info` stay in `fields`, and `reward_model.ground_truth` is additionally
lifted to `fields["ground_truth"]`, so a reward never has to know which row shape it came from.
Whole-number floats in top-level columns become ints: pandas stores an int column with a missing
value as float64, and "654321.0" is never the answer a reward wants. Validation here is pure (a
raw dict in, a `PromptRow` or a `DataError` out) and knows nothing of files: the readers and the
skip policy are `groupflow.data.datasets`, which hands each raw row here with its location.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from groupflow.data.images import (
    ImageLimits,
    ImageProblem,
    has_image_input,
    normalize_image_prompt,
    prompt_images,
)

__all__ = [
    "IN_MEMORY_SOURCE",
    "DataError",
    "Prompt",
    "PromptRow",
    "located_normalize",
    "normalize_row",
    "type_name",
]

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


# --------------------------------------------------------------------------------------------
# Row validation (pure: raw dict -> PromptRow, or DataError without location)
# --------------------------------------------------------------------------------------------


class _RowProblem(Exception):
    """Internal: a validation failure before the caller attaches source/index/line."""

    def __init__(self, field: str | None, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


def type_name(value: Any) -> str:
    return type(value).__name__


def _validate_messages(messages: list) -> None:
    if not messages:
        raise _RowProblem("prompt", "empty list of chat messages")
    for i, msg in enumerate(messages):
        where = f"prompt[{i}]"
        if not isinstance(msg, dict):
            raise _RowProblem(where, f"chat message must be a dict, got {type_name(msg)}")
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
                f"{where}.content", f"content must be a string, got {type_name(msg['content'])}"
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
        "prompt", f"prompt must be a string or a list of chat messages, got {type_name(prompt)}"
    )


def _check_optional_type(raw: dict, key: str, types: tuple[type, ...], desc: str) -> None:
    value = raw.get(key)
    if value is not None and not isinstance(value, types):
        raise _RowProblem(key, f"{key} must be {desc}, got {type_name(value)}")


def _lift_ground_truth(raw: dict, fields: dict[str, Any]) -> None:
    reward_model = raw.get("reward_model")
    if reward_model is None:
        return
    if not isinstance(reward_model, dict):
        raise _RowProblem(
            "reward_model",
            f"reward_model must be a struct like {{'style': 'rule', 'ground_truth': ...}}, "
            f"got {type_name(reward_model)}",
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
    return located_normalize(raw, source, index, None)


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


def _normalize(
    raw: Any,
    source: str,
    index: int,
    seen: dict[str, list[Any]] | None = None,
    images: ImageLimits | None = None,
) -> PromptRow:
    if not isinstance(raw, dict):
        raise _RowProblem(None, f"row must be a JSON object / dict, got {type_name(raw)}")
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


def located_normalize(
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
