"""The Python API: ``groupflow.Run(config, rewards=..., train_dataset=...).fit()``.

A notebook run trains with reward callables and in-memory rows (a list of dicts or a
``datasets.Dataset``), reports the same configuration and data errors as the CLI, and
``groupflow train`` goes through it.
"""

from __future__ import annotations

import pytest

import groupflow
from groupflow.config import ConfigError
from groupflow.data import DataError, make_task_rows
from groupflow.rewards import MissingRewardFieldError, RewardConfigError
from groupflow.run.tracking import read_metrics

CALLS: list[dict] = []


def reversed_digits(prompts, completions, answer, **_):
    """1 for an exact reverse; records what it was called with."""
    CALLS.append({"prompts": list(prompts), "answer": list(answer)})
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def _rows(n_train=12, n_val=4):
    train, val = make_task_rows("reverse", n_train, n_val, seed=5, digits=4)
    strip = ("data_source", "split")  # a notebook's rows: prompt + answer only
    return (
        [{k: v for k, v in r.items() if k not in strip} for r in train],
        [{k: v for k, v in r.items() if k not in strip} for r in val],
    )


def _config(tiny_config_data, **overrides):
    data = tiny_config_data(run__total_steps=2, **overrides)
    del data["data"]["task"]  # the datasets come from Python
    return data


def test_run_trains_two_steps_on_in_memory_rows_with_a_python_reward(tiny_config_data):
    train, val = _rows()
    CALLS.clear()
    run = groupflow.Run(
        _config(tiny_config_data),
        rewards=[reversed_digits],
        train_dataset=train,
        val_dataset=val,
    )
    final = run.fit()
    assert run.trainer.step == 2
    rows = read_metrics(run.run_dir / "metrics.jsonl")
    assert rows[0]["data/train_rows"] == 12.0 and rows[0]["data/val_rows"] == 4.0
    assert "reward/reversed_digits/mean" in final and "val/greedy/acc" in final
    # each step's 4 prompts × 4 samples came from the given rows, answers passed by name
    train_prompts = {r["prompt"] for r in train}
    step_calls = [c for c in CALLS if len(c["prompts"]) == 16]
    assert len(step_calls) == 2
    for call in step_calls:
        assert set(call["prompts"]) <= train_prompts
        answers = {r["prompt"]: r["answer"] for r in train}
        assert call["answer"] == [answers[p] for p in call["prompts"]]


def test_run_takes_a_hugging_face_dataset_and_a_weighted_reward_mapping(tiny_config_data):
    datasets = pytest.importorskip("datasets")
    train, val = _rows()
    run = groupflow.Run(
        _config(tiny_config_data),
        overrides={"run.total_steps": 1},
        rewards=[{"function": reversed_digits, "label": "exact", "weight": 0.5}],
        train_dataset=datasets.Dataset.from_list(train),
        val_dataset=datasets.Dataset.from_list(val),
    )
    assert [f.name for f in run.inputs.rewards] == ["exact"]
    assert run.inputs.rewards[0].weight == 0.5
    final = run.fit()
    assert final["reward/exact/mean"] * 0.5 == pytest.approx(final["reward/mean"])


def test_python_rewards_follow_the_configs_rewards(tiny_config_data):
    train, _ = _rows()
    cfg = _config(tiny_config_data, reward__functions=[{"name": "format_tags"}])
    run = groupflow.Run(cfg, rewards=reversed_digits, train_dataset=train)
    assert [f.name for f in run.trainer.workflow.reward_fn.specs] == [
        "format_tags",
        "reversed_digits",
    ]


def test_a_dataset_given_twice_is_a_config_error(tiny_config_data):
    train, val = _rows()
    with pytest.raises(ConfigError, match="train_dataset was given to groupflow.Run"):
        groupflow.Run(tiny_config_data(), train_dataset=train)
    cfg = _config(tiny_config_data, data__val_files=["val.jsonl"])
    with pytest.raises(ConfigError, match="remove data.val_files"):
        groupflow.Run(cfg, train_dataset=train, val_dataset=val)


def test_without_any_training_data_the_error_is_the_clis(tiny_config_data):
    with pytest.raises(ConfigError, match="set exactly one of data.train_files or data.task"):
        groupflow.Run(_config(tiny_config_data))


def test_config_errors_name_the_key_as_the_cli_does(tiny_config_data):
    train, _ = _rows()
    with pytest.raises(ConfigError, match=r"'actor.lrr': unknown key; did you mean 'actor.lr'"):
        groupflow.Run(_config(tiny_config_data, actor__lrr=1.0), train_dataset=train)
    with pytest.raises(ConfigError, match=r"override 'actor.lr' is not of the form"):
        groupflow.Run(_config(tiny_config_data), overrides=["actor.lr"], train_dataset=train)


@pytest.mark.parametrize("dataset", [["a", "b"], ("a",), [{"prompt": "ok"}, "b"]])
def test_strings_given_as_rows_are_bad_rows_not_file_paths(tiny_config_data, dataset):
    bad = next(i for i, r in enumerate(dataset) if isinstance(r, str))
    with pytest.raises(
        DataError, match=rf"train_dataset, row {bad}: row must be a .*dict, got str"
    ):
        groupflow.Run(_config(tiny_config_data), rewards=[reversed_digits], train_dataset=dataset)


def test_a_bad_in_memory_row_is_named_by_dataset_row_and_field(tiny_config_data):
    train, _ = _rows()
    train[3] = {"answer": "1"}
    with pytest.raises(DataError, match=r"train_dataset, row 3, field 'prompt'"):
        groupflow.Run(_config(tiny_config_data), rewards=[reversed_digits], train_dataset=train)


def test_a_reward_needing_a_field_no_row_has_fails_at_build(tiny_config_data):
    train, _ = _rows()

    def needs_solution(prompts, completions, solution):
        return [0.0] * len(completions)

    with pytest.raises(MissingRewardFieldError, match="requires field 'solution'"):
        groupflow.Run(_config(tiny_config_data), rewards=[needs_solution], train_dataset=train)


@pytest.mark.parametrize(
    "rewards, message",
    [
        (lambda prompts, completions: [0.0], "a lambda has no name"),
        ([3], "a reward is a callable"),
        (["no_such_reward"], "unknown reward 'no_such_reward'"),
        ([{"function": reversed_digits, "wieght": 2}], "unknown key 'wieght'"),
    ],
)
def test_bad_rewards_are_reported_by_entry(tiny_config_data, rewards, message):
    train, _ = _rows()
    with pytest.raises(RewardConfigError, match=message):
        groupflow.Run(_config(tiny_config_data), rewards=rewards, train_dataset=train)


@pytest.mark.parametrize(
    "dataset, message",
    [
        ("train.jsonl", "set data.train_files"),
        ({"prompt": "x"}, "a single dict is one row"),
        (42, "expected a datasets.Dataset"),
    ],
)
def test_bad_dataset_objects_are_reported(tiny_config_data, dataset, message):
    with pytest.raises(TypeError, match=message):
        groupflow.Run(_config(tiny_config_data), train_dataset=dataset)


def test_the_cli_train_command_runs_through_the_api(tiny_config_data, tmp_path, monkeypatch):
    import yaml

    from groupflow import api
    from groupflow.cli import commands as cli

    built = []
    real = api.Run

    class Spy(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            built.append(self)

    monkeypatch.setattr(api, "Run", Spy)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_config_data()))
    assert cli.main(["train", str(path), "run.total_steps=1", "--no-plot"]) == 0
    assert len(built) == 1 and built[0].trainer.step == 1


# ----- a script without `if __name__ == "__main__":` and an asynchronous rollout -------------


def _unguarded_script(tmp_path, tiny_config_data, detection: bool):
    """The README's example as a script that starts the run at its top level, unguarded, with
    ``rollout.max_staleness: 1``; runs it (hard timeout) and returns (process, run_dir)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    cfg = tiny_config_data(run__total_steps=2)
    script = tmp_path / "train.py"
    script.write_text(
        "import json, groupflow\n"
        "from groupflow.rollout import hosts as async_rollout\n"
        + ("" if detection else "async_rollout.unguarded_main_call = lambda: None\n")
        + f"cfg = json.loads({json.dumps(json.dumps(cfg))})\n"
        "run = groupflow.Run(cfg, overrides={'rollout.max_staleness': 1, "
        "'run.worker_timeout_s': 30, 'run.overwrite': True})\n"
        "run.fit()\n"
        "print('fit done')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)  # fmt: skip
    return out, Path(cfg["run"]["output_dir"]) / cfg["run"]["name"]


@pytest.mark.slow
def test_an_unguarded_script_with_an_async_rollout_runs_it_in_a_thread_with_a_warning(
    tmp_path, tiny_config_data
):
    out, run_dir = _unguarded_script(tmp_path, tiny_config_data, detection=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fit done" in out.stdout
    assert 'outside `if __name__ == "__main__":`' in out.stderr
    assert "runs in a thread of this process" in out.stderr
    assert "deleted the earlier run" not in out.stderr
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]


@pytest.mark.slow
def test_a_child_that_runs_the_script_again_never_touches_the_run_and_the_parent_stops(
    tmp_path, tiny_config_data
):
    # were the script not spotted, the child process imports it again and so reaches
    # groupflow.Run: it refuses (it used to delete the parent's run files under run.overwrite),
    # dies, and the parent reports it within run.worker_timeout_s instead of hanging
    out, run_dir = _unguarded_script(tmp_path, tiny_config_data, detection=False)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "a child never starts a run nor touches the run directory" in out.stderr
    assert "died, exit code 1 while starting" in out.stderr
    assert "deleted the earlier run" not in out.stderr
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0]  # the parent's
    assert (run_dir / "tokenizer").is_dir() and (run_dir / "config.yaml").is_file()
