"""Reading a benchmark's prompt file (official ``key / prompt / instruction_id_list / kwargs`` rows)
from the package that ships it, found without importing the package.

Design decision: the data packages are carriers (their ``__init__`` imports serving stacks we do
not install), so their files are located by ``importlib`` spec only (``groupflow.utils.packages``);
each row becomes a one-message chat prompt carrying the official fields for the grader.
"""

from __future__ import annotations

import json
from pathlib import Path

from groupflow.data import PromptRow
from groupflow.evals.base import BenchmarkDataMissing
from groupflow.utils.packages import find_package_file

__all__ = ["instruction_rows"]


def instruction_rows(module: str, relative: str, package: str, pip: str, name: str) -> list[PromptRow]:  # fmt: skip
    path: Path = find_package_file(
        module, relative, package=package, install_hint=pip, error=BenchmarkDataMissing
    )
    rows = []
    with open(path) as f:
        for index, line in enumerate(f):
            if not line.strip():
                continue
            r = json.loads(line)
            missing = {"key", "prompt", "instruction_id_list", "kwargs"} - set(r)
            if missing:
                raise ValueError(f"{path}: row {index} lacks {sorted(missing)}")
            fields = {
                "key": str(r["key"]),
                "raw_prompt": r["prompt"],
                "instruction_id_list": list(r["instruction_id_list"]),
                "kwargs": [dict(k) for k in r["kwargs"]],
                "data_source": name,
            }
            prompt = [{"role": "user", "content": r["prompt"]}]
            rows.append(PromptRow(prompt=prompt, fields=fields, source=str(path), index=index))
    return rows
