"""Files a run writes beside its checkpoints: the resolved config and the JSONL metric logs.

Design decision: these are plain functions over paths, shared by the tracker (which writes them),
``groupflow plot`` and the run-directory checks (which read them), so none of those readers needs
the tracker. Every write is atomic (temp file + ``os.replace``), so a crash leaves either the old
file or the new one; a reader tolerates exactly one damaged line, the last, which a crash or a live
writer can leave behind.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import numbers
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from groupflow.utils.env import redact_secrets

__all__ = [
    "CONFIG_FILE",
    "METRICS_FILE",
    "SAMPLES_FILE",
    "atomic_write_text",
    "read_metrics",
    "save_config",
    "to_json_safe",
    "to_plain",
    "truncate_jsonl_after",
]

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
CONFIG_FILE = "config.yaml"


def atomic_write_text(path: Path, text: str) -> None:
    # A reader (or a crash) must see either the old file or the new one, never half of one.
    tmp = path.with_name(f".tmp_{path.name}_{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def to_json_safe(obj: Any, where: str) -> Any:
    """Plain JSON types; non-finite floats become None; tensors/arrays via ``tolist()``."""
    if obj is None or isinstance(obj, (str, bool)):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        value = float(obj)
        return value if math.isfinite(value) else None
    if isinstance(obj, Mapping):
        out = {}
        for key, value in obj.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where}: key {key!r} must be a string, got {type(key).__name__}")
            out[str(key)] = to_json_safe(value, f"{where}.{key}")
        return out
    if isinstance(obj, (list, tuple)):
        return [to_json_safe(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if callable(getattr(obj, "tolist", None)):  # torch tensors, NumPy arrays and scalars
        return to_json_safe(obj.tolist(), where)
    raise TypeError(f"{where}: a {type(obj).__name__} cannot be written as JSON")


def to_plain(obj: Any, where: str) -> Any:
    """A config object (pydantic model, dataclass, mapping) as plain dicts/lists/scalars for YAML."""
    if hasattr(obj, "model_dump") and callable(obj.model_dump):
        return to_plain(obj.model_dump(mode="json"), where)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_plain(dataclasses.asdict(obj), where)
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v, f"{where}.{k}" if where else str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, enum.Enum):
        return to_plain(obj.value, where)
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return obj
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if callable(tolist := getattr(obj, "tolist", None)):
        return to_plain(tolist(), where)
    raise TypeError(
        f"config value at '{where}' has type {type(obj).__name__}, which cannot be saved"
    )


def save_config(run_dir: str | os.PathLike[str], config: Any) -> Path:
    """Write the resolved config (secrets redacted) to ``run_dir/config.yaml``; returns the path."""
    plain = to_plain(config, "")
    if not isinstance(plain, dict):
        raise TypeError(
            f"config must be a mapping (or pydantic model/dataclass), got {type(config).__name__}"
        )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_FILE
    text = yaml.safe_dump(redact_secrets(plain), sort_keys=False, allow_unicode=True)
    atomic_write_text(path, text)
    return path


def _read_jsonl_rows(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """Rows of a JSONL file, and whether a truncated last line (crash, live writer) was dropped."""
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if lineno == len(lines):
                warnings.warn(
                    f"{path}:{lineno}: dropping a truncated last line ({err.msg})", stacklevel=3
                )
                return rows, True
            raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}:{lineno}: expected a JSON object with an integer 'step'")
        rows.append(row)
    return rows, False


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def truncate_jsonl_after(path: str | os.PathLike[str], step: int) -> list[dict[str, Any]]:
    """Drop rows whose ``step`` is greater than ``step`` (atomically); returns the rows kept.

    Used on resume so that steps re-run after the checkpoint are not logged twice; a truncated last
    line left by a crash is removed too (appending after it would corrupt the next row). ``step=-1``
    empties the file. A missing file is treated as empty.
    """
    path = Path(path)
    if not path.exists():
        return []
    rows, dropped_tail = _read_jsonl_rows(path)
    kept = [row for row in rows if row["step"] <= step]
    if dropped_tail or len(kept) != len(rows) or not _ends_with_newline(path):
        atomic_write_text(path, "".join(json.dumps(row, allow_nan=False) + "\n" for row in kept))
    return kept


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, float]]:
    """Per-step metrics from a run directory or a ``metrics.jsonl`` path, sorted by step.

    Several lines with the same step (e.g. training then validation metrics) are merged; ``null``
    values come back as NaN. A missing file raises ``FileNotFoundError``.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path} (a run writes it as it trains)")
    merged: dict[int, dict[str, float]] = {}
    for row in _read_jsonl_rows(path)[0]:
        entry = merged.setdefault(row["step"], {})
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                entry[key] = float(value)
            elif value is None:
                entry[key] = math.nan
    return [{**merged[step], "step": float(step)} for step in sorted(merged)]
