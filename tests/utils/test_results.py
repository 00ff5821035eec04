"""Results files: written with their provenance, checked on read, rendered as a table."""

from __future__ import annotations

import json

import pytest

from groupflow.utils.results import (
    ResultsError,
    markdown_table,
    read_results,
    rewrites,
    write_results,
)

SUMMARY = {"recipe": "examples/x.yaml", "what": "acc", "before": "10 %", "after": "90 %"}


def test_written_results_read_back_with_when_where_and_commit(tmp_path):
    path = write_results(tmp_path / "r" / "x.json", name="x", command="python go.py",
                         rows=[{"seed": 0, "acc": 0.91234}], summary=SUMMARY)  # fmt: skip
    data = read_results(path)
    assert data["rows"] == [{"seed": 0, "acc": 0.91234}] and data["summary"] == SUMMARY
    measured = data["measured"]
    assert measured["date"].endswith("UTC") and "CPUs" in measured["machine"]
    assert measured["commit"]  # this checkout is a git repository


def test_the_table_lists_columns_in_first_seen_order_and_says_where_it_comes_from():
    data = {"name": "x", "command": "python go.py", "summary": SUMMARY, "notes": "",
            "rows": [{"run": "a", "acc": 0.5}, {"run": "b", "time": 3}],
            "measured": {"date": "2026-12-02 05:00 UTC", "commit": "abc", "machine": "m",
                         "load_average": 1.5}}  # fmt: skip
    assert markdown_table(data).split("\n") == [
        "| run | acc | time |", "|---|---|---|", "| a | 0.5 |  |", "| b |  | 3 |", "",
        "*Measured 2026-12-02 05:00 UTC, commit `abc`, m, load average 1.5 by `python go.py`.*",
    ]  # fmt: skip
    data["measured"] = {"transcribed_from": "`docs/x.md`"}
    assert "Transcribed from the measurement recorded in `docs/x.md`" in markdown_table(data)
    assert "does not write this file" in markdown_table(data)  # python go.py writes no file


@pytest.mark.parametrize(
    "name,command,writes",
    [
        ("b", "python benchmarks/b.py --repeats 3 --results benchmarks/results/b.json", True),
        ("x", "python scripts/reproduce.py examples/x.yaml --seeds 0 1 2", True),
        ("x_time", "python scripts/reproduce.py examples/x.yaml --seeds 0", False),
        ("x", "python scripts/reproduce.py examples/x.yaml --out elsewhere.json", False),
        ("x", "groupflow train examples/x.yaml", False),
    ],
)  # fmt: skip
def test_the_footnote_says_replaces_this_file_only_when_the_command_writes_it(
    name, command, writes
):
    data = {"name": name, "command": command, "summary": SUMMARY, "notes": "", "rows": [],
            "measured": {"transcribed_from": "`docs/x.md`"}}  # fmt: skip
    assert rewrites(data) is writes
    assert ("replaces this file" in markdown_table(data)) is writes


@pytest.mark.parametrize(
    "content,message",
    [
        ("{", "not JSON"),
        ("[1]", "is a JSON object"),
        (json.dumps({"name": "x", "command": "c", "rows": {}, "measured": {}, "summary": {}}),
         "field 'rows' must be a list"),
        (json.dumps({"name": "x", "command": "c", "rows": [], "measured": {},
                     "summary": {"recipe": "r"}}), "summary lacks what, before, after"),
        (json.dumps({"name": "x", "command": "c", "rows": [3], "measured": {},
                     "summary": SUMMARY}), r"rows\[0\] must be an object"),
    ],
)  # fmt: skip
def test_a_bad_results_file_is_refused_naming_the_file_and_field(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ResultsError, match=message) as e:
        read_results(path)
    assert str(path) in str(e.value)
    with pytest.raises(ResultsError, match="no such results file"):
        read_results(tmp_path / "missing.json")


def test_a_summary_without_its_keys_is_not_written(tmp_path):
    with pytest.raises(ResultsError, match="summary lacks before, after"):
        write_results(tmp_path / "x.json", name="x", command="c", rows=[],
                      summary={"recipe": "r", "what": "w"})  # fmt: skip
    assert not (tmp_path / "x.json").exists()
