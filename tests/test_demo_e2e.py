"""A short version of the CPU demo, end to end through the CLI: the reward must rise."""

import json

import pytest

from groupflow.cli import main


@pytest.mark.slow
def test_short_demo_raises_reward(tmp_path, capsys):
    code = main(
        [
            "train",
            "examples/reverse_demo.yaml",
            f"run.output_dir={tmp_path}",
            "run.name=demo",
            "run.total_steps=70",
            "run.loggers=[]",
            "data.task.num_val=64",
            "validation.every_steps=0",
            "validation.samples_per_prompt=1",
        ]
    )
    assert code == 0
    rows = [
        json.loads(line) for line in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 70
    first = sum(r["reward/mean"] for r in steps[:10]) / 10
    last = sum(r["reward/mean"] for r in steps[-10:]) / 10
    assert last > first + 0.1, (first, last)
    assert (
        rows[0]["val/greedy/acc"] <= 0.3
    )  # the warm start stops while the policy is right only sometimes
    assert "val/greedy/acc" in rows[-1]
    out = capsys.readouterr().out
    assert "held-out greedy accuracy: before" in out
    assert (tmp_path / "demo" / "plots").is_dir()


@pytest.mark.slow
def test_short_demo_on_two_ray_workers(tmp_path):
    pytest.importorskip("ray")
    code = main(
        [
            "train",
            "examples/reverse_demo.yaml",
            f"run.output_dir={tmp_path}",
            "run.name=demo-ray",
            "run.backend=ray",
            "run.num_workers=2",
            "run.total_steps=12",
            "run.save_every=6",
            "run.loggers=[]",
            "data.task.num_val=32",
            "validation.every_steps=0",
            "validation.samples_per_prompt=1",
            "--no-plot",
        ]
    )
    assert code == 0
    rows = [
        json.loads(line)
        for line in (tmp_path / "demo-ray" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 12
    assert all(r["actor/grad_norm"] >= 0 and r["reward/mean"] >= 0 for r in steps)
    assert rows[0]["sft/steps"] > 0 and "val/greedy/acc" in rows[-1]
    assert (tmp_path / "demo-ray" / "checkpoints" / "step_12" / "shards").is_dir()
