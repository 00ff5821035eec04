"""A short version of the CPU demo, end to end through the CLI: the reward must rise."""

import json
import shlex
from pathlib import Path

import pytest
import yaml

from groupflow.cli.commands import main
from groupflow.config import apply_overrides

REPO_ROOT = Path(__file__).resolve().parents[1]


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
            "run.total_steps=4",
            "run.save_every=2",
            "sft.steps=8",  # the warm start on the actor group (its probe too), not to its stop
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
    assert len(steps) == 4
    assert all(r["actor/grad_norm"] >= 0 and r["reward/mean"] >= 0 for r in steps)
    assert rows[0]["sft/steps"] > 0 and "val/greedy/acc" in rows[-1]
    assert (tmp_path / "demo-ray" / "checkpoints" / "step_4" / "shards").is_dir()


def _readme_commands(section: str) -> list[list[str]]:
    """The ``groupflow`` commands of the README's first bash block under ``section``, as argv."""
    text = (REPO_ROOT / "README.md").read_text()
    block = text.split(section, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]
    assert all(c[0] == ".venv/bin/groupflow" for c in commands), commands
    return [c[1:] for c in commands]


def _demo_sh_command() -> list[str]:
    """The groupflow arguments scripts/demo.sh runs (its ``exec`` line, without "$@")."""
    line = next(
        ln for ln in (REPO_ROOT / "scripts" / "demo.sh").read_text().splitlines() if "exec" in ln
    )
    argv = shlex.split(line)
    return [a for a in argv[argv.index(".venv/bin/groupflow") + 1 :] if a != "$@"]


@pytest.mark.slow
def test_readme_commands_work_right_after_the_demo(tmp_path, monkeypatch, capsys):
    """demo.sh, then every command of the README's "Using it" block, verbatim, on the demo config
    shortened to a few steps (the same file name, in a scratch working directory)."""
    demo = yaml.safe_load((REPO_ROOT / "examples" / "reverse_demo.yaml").read_text())
    short = apply_overrides(
        demo,
        {
            "run.total_steps": 2,
            "data.task.num_train": 400,
            "data.task.num_val": 8,
            "data.prompts_per_step": 4,
            "rollout.samples_per_prompt": 4,
            "sft.steps": 3,
            "run.samples_every": 1,
        },
    )
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "reverse_demo.yaml").write_text(yaml.safe_dump(short))
    monkeypatch.chdir(tmp_path)
    assert main(_demo_sh_command()) == 0
    assert (tmp_path / "runs" / "reverse-demo" / "checkpoints" / "step_2").is_dir()
    assert main(_demo_sh_command()) == 0  # the demo runs again (afresh), it is not refused
    capsys.readouterr()
    for argv in _readme_commands("## Using it"):
        assert main(argv) == 0, argv
        out = capsys.readouterr().out
        if argv[0] == "generate":
            line = json.loads(out.strip().splitlines()[-1])
            assert line["prompt"] == "reverse 123456 =" and "completion" in line
        if argv[0] == "eval":
            assert "val/greedy/acc" in out
    assert (tmp_path / "runs" / "reverse-demo" / "export" / "model.safetensors").is_file()
    assert (tmp_path / "runs" / "seed1-lr1e-4" / "checkpoints" / "step_2").is_dir()
