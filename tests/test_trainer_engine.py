"""The trainer with a rollout engine whose log-probs are not the training forward's: the logged
mismatch, truncated importance sampling, and a short GRPO run on vLLM (in .venv-vllm)."""

import json

import pytest

from groupflow.rollout.engines.vllm_engine import vllm_available
from groupflow.run.tracking import read_metrics
from groupflow.trainer import Trainer


def _steps(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0]


def test_recomputed_old_logprobs_log_the_rollout_mismatch(tiny_config):
    trainer = Trainer(tiny_config(run__total_steps=2, actor__recompute_old_logprobs="always"))
    trainer.fit()
    for row in _steps(trainer.run_dir):
        # the HF engine's decode loop and the training forward agree to float rounding
        assert 0.0 <= row["rollout/logprob_diff_mean"] <= row["rollout/logprob_diff_max"] < 1e-4
    assert "perf/weight_sync_s" not in row  # one HF worker: nothing to sync


def test_no_mismatch_metric_when_the_rollout_logprobs_are_used_as_old(tiny_config):
    trainer = Trainer(tiny_config(run__total_steps=1))
    trainer.fit()
    assert "rollout/logprob_diff_max" not in _steps(trainer.run_dir)[0]


def test_tis_weights_are_logged_and_near_one_for_the_hf_engine(tiny_config):
    trainer = Trainer(tiny_config(run__total_steps=2, actor__tis_cap=2.0))
    trainer.fit()
    for row in _steps(trainer.run_dir):
        assert row["actor/tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert row["actor/tis_capped_frac"] == 0.0


def test_tis_weights_reach_the_loss(tiny_config, monkeypatch):
    """A rollout engine that under-reports log-probs by 1 nat gives weights min(e, cap) = cap."""
    trainer = Trainer(
        tiny_config(run__total_steps=1, actor__tis_cap=1.5, actor__recompute_old_logprobs="always")
    )
    original = trainer.policy.prepare

    def skewed(batch, timer=None):
        batch["rollout_logprobs"] = batch["rollout_logprobs"] - 1.0
        return original(batch, timer)

    monkeypatch.setattr(trainer.policy, "prepare", skewed)
    trainer.fit()
    row = _steps(trainer.run_dir)[0]
    assert row["actor/tis_weight_mean"] == pytest.approx(1.5)
    assert row["actor/tis_capped_frac"] == pytest.approx(1.0)
    assert row["rollout/logprob_diff_mean"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.slow
@pytest.mark.skipif(
    not vllm_available(),
    reason="vLLM is not installed here; runs in .venv-vllm (bash scripts/setup_vllm.sh)",
)
def test_short_grpo_run_on_vllm_raises_reward(tmp_path):
    from groupflow.cli.commands import main

    code = main(
        ["train", "examples/reverse_vllm.yaml", f"run.output_dir={tmp_path}", "run.name=vllm",
         "run.loggers=[]", "--no-plot"]
    )  # fmt: skip
    assert code == 0
    rows = [json.loads(x) for x in (tmp_path / "vllm" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 40
    first = sum(r["reward/mean"] for r in steps[:10]) / 10
    last = sum(r["reward/mean"] for r in steps[-10:]) / 10
    assert last > first + 0.05, (first, last)  # measured: 0.31 -> 0.42
    assert rows[-1]["val/greedy/acc"] > rows[0]["val/greedy/acc"]  # measured: 16% -> 38%
    for r in steps:
        assert r["perf/weight_sync_s"] > 0
        assert r["rollout/logprob_diff_max"] < 1e-3  # fp32 on both sides
        assert r["actor/tis_weight_mean"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.slow
@pytest.mark.skipif(
    not vllm_available(),
    reason="vLLM is not installed here; runs in .venv-vllm (bash scripts/setup_vllm.sh)",
)
def test_multi_turn_episodes_on_vllm(tmp_path):
    """The calculator demo's multi-turn episodes with vLLM generating each turn (its prefix cache
    holds the conversation's earlier turns): tool results land between the model's turns, and the
    training forward's log-probs of the model tokens match vLLM's sampling ones."""
    from groupflow.config import load_config

    cfg = load_config(
        "examples/calc_tools_demo.yaml",
        ["rollout.engine=vllm", "rollout.vllm.dtype=float32", "rollout.vllm.cpu_kv_cache_gib=1",
         "model.tiny.hidden_size=128", "model.tiny.num_heads=2", "model.tiny.num_layers=2",
         "data.task.digits=2", "data.task.num_train=2000", "data.task.num_val=16",
         "data.prompts_per_step=4", "rollout.samples_per_prompt=4", "sft.steps=200",
         "sft.stop_at_accuracy=null", "sft.lr=3e-3", "run.total_steps=2", "run.loggers=[]",
         "validation.before_training=false", f"run.output_dir={tmp_path}"],
    )  # fmt: skip
    trainer = Trainer(cfg)
    trainer.fit()
    for row in _steps(trainer.run_dir):
        assert row["rollout/logprob_diff_max"] < 1e-3  # fp32 on both sides
        assert row["rollout/tool_call_rate"] > 0  # the warm start demonstrates the tool
        assert row["rollout/observation_tokens/mean"] > 0
