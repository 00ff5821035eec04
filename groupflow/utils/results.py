"""Measured results as files: what a benchmark or a recipe run measured, with when, where and at
which commit, so the documentation renders every number from one place.

Design decision: the script that measures writes the file (``write_results``); the docs build and
the README's results table only read it (``read_results``, ``markdown_table``), so a number that
appears twice cannot disagree. A file is plain JSON with a fixed top-level shape, checked on read
with errors that name the file and the field; rows are free-form dicts (each measurement has its
own columns).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

__all__ = [
    "ResultsError", "markdown_table", "provenance", "read_results", "rewrites", "write_results",
]  # fmt: skip

REQUIRED = {"name": str, "command": str, "rows": list, "measured": dict, "summary": dict}
SUMMARY = ("recipe", "what", "before", "after")


class ResultsError(ValueError):
    """A results file is missing, unreadable or not of the results shape."""


def _git(*args: str, cwd: Path) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def provenance(repo: Path | None = None) -> dict[str, Any]:
    """When, where and from which commit a measurement is being taken (now, on this machine)."""
    repo = repo or Path(__file__).resolve().parents[2]
    commit = _git("rev-parse", "--short=12", "HEAD", cwd=repo)
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", cwd=repo))
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # results of tools that run without torch
        torch_version = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit + ("+changes" if dirty and commit else ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "python": platform.python_version(),
        "torch": torch_version,
        "load_average": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def write_results(path: str | Path, *, name: str, command: str, rows: list[dict],
                  summary: dict[str, str], notes: str = "") -> Path:  # fmt: skip
    """Write one results file (rows measured now, by ``command``) and return its path."""
    missing = [k for k in SUMMARY if k not in summary]
    if missing:
        raise ResultsError(f"results {name!r}: summary lacks {', '.join(missing)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"name": name, "command": command, "rows": rows, "summary": summary,
            "notes": notes, "measured": provenance()}  # fmt: skip
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return path


def read_results(path: str | Path) -> dict[str, Any]:
    """A results file, checked: its top-level fields, their types and the summary's keys."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such results file") from None
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ResultsError(f"{path}: a results file is a JSON object")
    for key, kind in REQUIRED.items():
        if not isinstance(data.get(key), kind):
            raise ResultsError(f"{path}: field {key!r} must be a {kind.__name__}")
    missing = [k for k in SUMMARY if k not in data["summary"]]
    if missing:
        raise ResultsError(f"{path}: summary lacks {', '.join(missing)}")
    for i, row in enumerate(data["rows"]):
        if not isinstance(row, dict):
            raise ResultsError(f"{path}: rows[{i}] must be an object")
    return data


def _cell(value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def rewrites(data: dict[str, Any]) -> bool:
    """Whether the file's own command writes it: a benchmark given ``--results``, or
    ``scripts/reproduce.py`` on the recipe of the file's name (its default ``--out``)."""
    command = data["command"]
    if "--results" in command:
        return True
    recipe = re.search(r"scripts/reproduce\.py\s+examples/(\S+)\.yaml", command)
    return bool(recipe) and recipe.group(1) == data["name"] and "--out" not in command


def markdown_table(data: dict[str, Any]) -> str:
    """The rows as a Markdown table (columns in first-seen order), then where they come from."""
    columns: list[str] = []
    for row in data["rows"]:
        columns += [c for c in row if c not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in data["rows"]]
    m = data["measured"]
    if m.get("transcribed_from"):  # a number measured before results files existed
        again = (
            "measures it again and replaces this file"
            if rewrites(data)
            else ("measures it again; it prints the numbers but does not write this file")
        )
        lines += ["", f"*Transcribed from the measurement recorded in {m['transcribed_from']} "
                  f"(before results files existed); `{data['command']}` {again}.*"]  # fmt: skip
    else:
        where = f"{m.get('date', '?')}, commit `{m.get('commit') or '?'}`, {m.get('machine', '?')}"
        if m.get("load_average") is not None:
            where += f", load average {m['load_average']}"
        lines += ["", f"*Measured {where} by `{data['command']}`.*"]
    if data.get("notes"):
        lines += ["", data["notes"]]
    return "\n".join(lines)
