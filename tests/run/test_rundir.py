"""Run directories: a fresh start never mixes with an earlier run, a resume never continues a
checkpoint under a different training config (groupflow/run/rundir.py), and a run ends with a
checkpoint (run.save_final).

The trainer-level tests run the tiny reverse task for one or two steps (a fraction of a second
each); the first one is the issue's repro: a copied run directory trained with another LR.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from groupflow.cli.commands import main
from groupflow.config import config_from_dict
from groupflow.run.checkpoint import list_checkpoints, save_checkpoint
from groupflow.run.rundir import (
    RUN_ENTRIES,
    RunDirError,
    checkpoint_config,
    clear_run_dir,
    config_diff,
    earlier_run,
    relevant_changes,
)
from groupflow.run.tracking import read_metrics
from groupflow.trainer import Trainer

# ----- pure parts -----------------------------------------------------------------------------


def test_config_diff_flattens_sections_and_indexes_lists_of_sections():
    old = {
        "actor": {"lr": 1e-3, "betas": [0.9, 0.999], "loss_options": {}},
        "reward": {"functions": [{"name": "a", "kwargs": {"mode": "strict"}}]},
        "run": {"loggers": []},
    }
    new = {
        "actor": {"lr": 2e-3, "betas": [0.9, 0.95], "loss_options": {"x": 1}},
        "reward": {"functions": [{"name": "a", "kwargs": {"mode": "flexible"}}, {"name": "b"}]},
        "run": {"loggers": ["console"]},
    }
    assert config_diff(old, old) == {}
    diff = config_diff(old, new)
    assert {k: v for k, v in diff.items() if k != "actor.loss_options.x"} == {
        "actor.lr": (1e-3, 2e-3),
        "actor.betas": ([0.9, 0.999], [0.9, 0.95]),  # a list of values is one value
        "reward.functions.0.kwargs.mode": ("strict", "flexible"),
        "reward.functions.1.name": diff["reward.functions.1.name"],
        "run.loggers": ([], ["console"]),
    }
    assert diff["reward.functions.1.name"][1] == "b"
    assert diff["actor.loss_options.x"][1] == 1  # absent before: an empty section has no keys


def test_relevant_changes_skips_safe_keys_and_allowed_sections():
    diff = {
        "run.total_steps": (10, 20),
        "run.loggers": ([], ["mlflow"]),
        "validation.every_steps": (0, 5),
        "actor.micro_batch_samples": (None, 4),
        "actor.lr": (1e-3, 2e-3),
        "run.seed": (0, 1),
        "reward.functions.0.kwargs.mode": ("a", "b"),
    }
    assert relevant_changes(diff) == {
        "actor.lr": (1e-3, 2e-3),
        "run.seed": (0, 1),
        "reward.functions.0.kwargs.mode": ("a", "b"),
    }
    assert relevant_changes(diff, ["actor", "reward.functions"]) == {"run.seed": (0, 1)}
    # a prefix matches whole key parts only: "run.see" is not "run.seed"
    assert "run.seed" in relevant_changes(diff, ["run.see"])


def test_allow_config_changes_names_must_exist(tiny_config):
    with pytest.raises(
        ValueError, match="'actor.lrr' is not a config key; did you mean 'actor.lr'"
    ):
        tiny_config(run__allow_config_changes=["actor.lrr"])
    cfg = tiny_config(run__allow_config_changes=["actor", "reward.functions.0.kwargs"])
    assert cfg.run.allow_config_changes == ["actor", "reward.functions.0.kwargs"]


def test_clear_run_dir_removes_only_what_groupflow_writes(tmp_path):
    run = tmp_path / "run"
    for name in ("checkpoints/step_2", "tokenizer", "plots", "export"):
        (run / name).mkdir(parents=True)
    (run / "checkpoints" / "step_2" / "model.safetensors").write_text("w")
    for name in ("metrics.jsonl", "config.yaml", ".tmp_metrics.jsonl_123", "notes.txt"):
        (run / name).write_text("x\n")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.png").write_text("png")
    (run / "images").symlink_to(outside)
    assert earlier_run(run) == ["metrics.jsonl", "checkpoints", "images"]  # empty plots/: none
    removed = clear_run_dir(run)
    assert set(removed) == {
        "metrics.jsonl", "config.yaml", "checkpoints", "tokenizer", "plots", "images",
        ".tmp_metrics.jsonl_123",
    }  # fmt: skip
    assert sorted(p.name for p in run.iterdir()) == ["export", "notes.txt"]
    assert (outside / "keep.png").is_file()  # a symlinked entry loses the link, not its target
    assert earlier_run(run) == [] and set(RUN_ENTRIES) >= {"metrics.jsonl", "checkpoints"}


def test_checkpoint_config_prefers_the_checkpoints_own_record(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"actor": {"lr": 0.5}}))
    with_record = save_checkpoint(
        run / "checkpoints", 1, {"trainer_state": {"step": 1}, "config": {"actor": {"lr": 0.1}}}
    )
    without = save_checkpoint(run / "checkpoints", 2, {"trainer_state": {"step": 2}})
    assert checkpoint_config(with_record) == {"actor": {"lr": 0.1}}
    assert checkpoint_config(without) == {"actor": {"lr": 0.5}}  # the run's config.yaml
    loose = save_checkpoint(tmp_path / "loose", 3, {"trainer_state": {"step": 3}})
    assert checkpoint_config(loose) is None


# ----- the trainer ------------------------------------------------------------------------------


def _train(data: dict) -> Trainer:
    trainer = Trainer(config_from_dict(data))
    trainer.fit()
    return trainer


def _steps(run_dir: Path) -> list[int]:
    return [int(r["step"]) for r in read_metrics(run_dir)]


@pytest.fixture
def finished(tiny_config_data, tmp_path):
    """A finished 2-step run (final checkpoint step_2), copied to a second output directory as
    the issue's repro does; returns (config dict aimed at the copy, the copy's run dir)."""
    data = tiny_config_data(run__total_steps=2, run__output_dir=str(tmp_path / "a"))
    _train(data)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    copy = {**data, "run": {**data["run"], "output_dir": str(tmp_path / "b")}}
    return copy, tmp_path / "b" / "tiny"


def test_resume_under_another_training_config_is_refused_with_a_diff(finished, tmp_path, capsys):
    data, run_dir = finished
    before = {name: (run_dir / name).read_bytes() for name in ("config.yaml", "metrics.jsonl")}
    config_file = tmp_path / "other.yaml"
    config_file.write_text(yaml.safe_dump(data))
    code = main(["train", str(config_file), "actor.lr=5e-3", "data.task.name=add", "--no-plot"])
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"checkpoint {run_dir / 'checkpoints' / 'step_2'}" in err
    assert "  - actor.lr: 0.001 → 0.005" in err
    assert "  - data.task.name: 'reverse' → 'add'" in err
    assert "run.allow_config_changes=[actor.lr,data.task.name]" in err
    # nothing in the run directory changed
    assert before == {name: (run_dir / name).read_bytes() for name in before}
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_2"]


def test_running_a_finished_run_again_says_so(finished, caplog):
    data, run_dir = finished
    trainer = _train(data)
    assert trainer.resume_from.name == "step_2" and trainer.step == 2
    assert "already reached run.total_steps=2: nothing to train" in caplog.text
    assert _steps(run_dir) == [0, 1, 2]


def test_safe_and_allowed_changes_resume(finished):
    data, run_dir = finished
    longer = {**data, "run": {**data["run"], "total_steps": 3, "loggers": []}}
    trainer = _train(longer)
    assert trainer.resume_from.name == "step_2" and trainer.step == 3
    assert _steps(run_dir) == [0, 1, 2, 3]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["total_steps"] == 3
    faster = {
        **longer,
        "run": {**longer["run"], "total_steps": 4, "allow_config_changes": ["actor.lr"]},
        "actor": {"lr": 5e-3},
    }
    trainer = _train(faster)
    assert trainer.resume_from.name == "step_3" and trainer.step == 4
    assert read_metrics(run_dir)[-1]["actor/lr"] == 5e-3


def test_fresh_run_into_a_used_directory_is_refused(finished, tiny_config_data):
    data, run_dir = finished
    never = {**data, "run": {**data["run"], "resume": "never"}}
    with pytest.raises(
        RunDirError, match=r"holds an earlier run \(metrics.jsonl.*run.resume=never"
    ):
        Trainer(config_from_dict(never))
    (run_dir / "checkpoints" / "step_2" / "manifest.json").unlink()  # no complete checkpoint
    with pytest.raises(RunDirError, match="no complete checkpoint to resume from"):
        Trainer(config_from_dict(data))


def test_overwrite_clears_the_earlier_run_and_its_tokenizer(finished):
    data, run_dir = finished
    (run_dir / "notes.txt").write_text("mine")
    fresh = {
        **data,
        "run": {**data["run"], "overwrite": True, "total_steps": 1},
        "data": {**data["data"], "task": {**data["data"]["task"], "name": "add"}},
    }
    trainer = _train(fresh)
    assert trainer.resume_from is None
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_1"]
    assert _steps(run_dir) == [0, 1]
    vocab = json.loads((run_dir / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    assert "+" in vocab  # trained on the 'add' task, not reused from the 'reverse' run
    assert (run_dir / "notes.txt").read_text() == "mine"


def test_leftovers_of_a_start_that_never_stepped_are_cleared_quietly(tiny_config_data, tmp_path):
    reverse = tiny_config_data(run__total_steps=1, run__save_final=False)
    Trainer(config_from_dict(reverse))  # writes the run's tokenizer, trains nothing
    run_dir = tmp_path / "tiny"
    assert (run_dir / "tokenizer").is_dir() and earlier_run(run_dir) == []
    add = tiny_config_data(run__total_steps=1, data__task__name="add")
    _train(add)
    vocab = json.loads((run_dir / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    assert "+" in vocab


def test_explicit_checkpoint_of_another_run_starts_a_new_directory(finished, tmp_path):
    data, run_dir = finished
    ckpt = run_dir / "checkpoints" / "step_2"
    branch = {
        **data,
        "run": {**data["run"], "name": "branch", "resume": str(ckpt), "total_steps": 3},
    }
    trainer = _train(branch)
    assert trainer.resume_from == ckpt and trainer.step == 3
    branch_dir = run_dir.parent / "branch"
    assert (branch_dir / "tokenizer" / "tokenizer.json").read_bytes() == (
        run_dir / "tokenizer" / "tokenizer.json"
    ).read_bytes()
    assert _steps(branch_dir) == [3]
    inside = {**data, "run": {**data["run"], "resume": str(ckpt), "overwrite": True}}
    with pytest.raises(RunDirError, match="would delete"):
        Trainer(config_from_dict(inside))


def test_a_run_ends_with_a_checkpoint_unless_save_final_is_off(tiny_config_data, tmp_path):
    # save_every 0 (the demo's setting): the final checkpoint still comes
    trainer = _train(tiny_config_data(run__total_steps=2, run__save_every=0))
    assert [p.name for p in list_checkpoints(trainer.run_dir / "checkpoints")] == ["step_2"]
    assert checkpoint_config(trainer.run_dir / "checkpoints" / "step_2")["actor"]["lr"] == 1e-3
    off = _train(tiny_config_data(run__name="off", run__total_steps=2, run__save_final=False))
    assert not (off.run_dir / "checkpoints").exists()


def test_inference_on_a_run_without_checkpoints_says_so(tiny_config_data, tmp_path, capsys):
    data = tiny_config_data(run__total_steps=1, run__save_final=False)
    _train(data)
    config_file = tmp_path / "c.yaml"
    config_file.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "tiny"
    assert main(["eval", str(config_file), "--checkpoint", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"run {run_dir} saved no checkpoint; set run.save_every" in err
    assert "manifest" not in err
