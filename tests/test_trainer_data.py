"""The driver's data and reward hardening, end to end on the tiny reverse task (CPU, one thread).

A row that lacks a field its reward needs is reported (file, row, field) or skipped and counted,
never scored as ``None``; the rows a run trains on are counted after the over-long filter; a
dataset smaller than a step names the config keys that fix it; a hanging reward is cut off by
``reward.timeout_s``.
"""

from __future__ import annotations

import json
import time

import pytest

from groupflow.data import DataError, make_task_rows
from groupflow.run.tracking import read_metrics
from groupflow.trainer import Trainer


def _task_file(path, n, drop_answer_at=None, **extra):
    rows, _ = make_task_rows("reverse", n, 1, seed=3, digits=4)
    with open(path, "w") as f:
        for i, row in enumerate(rows):
            row = {**row, **extra}
            if i == drop_answer_at:
                del row["answer"]
            f.write(json.dumps(row) + "\n")
    return path


def _file_config(tiny_config, tmp_path, train, val=None, **overrides):
    return tiny_config(
        data__task=None,
        data__train_files=[str(train)],
        data__val_files=[str(val)] if val else [],
        **overrides,
    )


def test_a_row_missing_its_rewards_field_is_an_error_naming_file_row_and_field(
    tiny_config, tmp_path
):
    train = _task_file(tmp_path / "train.jsonl", 8, drop_answer_at=2)
    with pytest.raises(
        DataError, match=r"train\.jsonl, row 2, field 'answer': reward 'reverse' needs"
    ):
        Trainer(_file_config(tiny_config, tmp_path, train))


def test_a_null_field_counts_as_missing_for_an_explicit_reward(
    tiny_config, tmp_path, helpers_on_path
):
    train = _task_file(tmp_path / "train.jsonl", 8)
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"prompt": "reverse 1234 =", "answer": None}) + "\n")
    cfg = _file_config(
        tiny_config,
        tmp_path,
        train,
        val,
        reward__functions=[{"function": "reward_helpers:fails_on_one_sample"}],
    )
    with pytest.raises(
        DataError, match=r"val\.jsonl, row 0, field 'answer': reward 'fails_on_one_sample'"
    ):
        Trainer(cfg)


def test_rows_missing_a_field_are_skipped_and_counted_with_bad_rows_skip(tiny_config, tmp_path):
    train = _task_file(tmp_path / "train.jsonl", 8, drop_answer_at=5)
    cfg = _file_config(tiny_config, tmp_path, train, data__bad_rows="skip", run__total_steps=1)
    trainer = Trainer(cfg)
    assert [r.index for r in trainer.workflow.train_rows] == [0, 1, 2, 3, 4, 6, 7]
    trainer.fit()
    logged = read_metrics(trainer.run_dir / "metrics.jsonl")[0]
    assert logged["data/train_skipped_bad_rows"] == 1.0 and logged["data/train_rows"] == 7.0


def test_train_rows_are_counted_after_the_overlong_filter(tiny_config, tmp_path):
    rows, _ = make_task_rows("reverse", 6, 1, seed=3, digits=4)
    rows[1]["prompt"] = rows[3]["prompt"] = "reverse 1234 1234 1234 1234 ="  # over 16 tokens
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _file_config(tiny_config, tmp_path, train, data__max_prompt_tokens=16, run__total_steps=0)
    trainer = Trainer(cfg)
    trainer.fit()
    logged = read_metrics(trainer.run_dir / "metrics.jsonl")[0]
    assert logged["data/train_rows"] == 4.0 and logged["data/train_filtered_overlong"] == 2.0
    assert logged["data/val_rows"] == 0.0 and logged["data/val_filtered_overlong"] == 0.0


def test_a_dataset_smaller_than_a_step_names_the_keys_that_fix_it(tiny_config):
    small = {"data__task__num_train": 3, "data__prompts_per_step": 4}
    with pytest.raises(ValueError, match=r"data\.prompts_per_step, data\.drop_last=false"):
        Trainer(tiny_config(**small))
    trainer = Trainer(tiny_config(**small, data__drop_last=False, run__total_steps=1))
    trainer.fit()
    assert trainer.loader.state_dict()["drop_last"] is False


def test_a_hanging_async_reward_is_cut_off_by_the_time_limit(tiny_config, helpers_on_path):
    cfg = tiny_config(
        run__total_steps=1,
        reward__timeout_s=0.3,
        reward__functions=[{"function": "reward_helpers:async_hangs_on_one_sample"}],
    )
    trainer = Trainer(cfg)
    start = time.monotonic()
    trainer.fit()
    assert time.monotonic() - start < 30  # not the reward's 3600 s
    step = read_metrics(trainer.run_dir / "metrics.jsonl")[-1]
    assert step["reward/async_hangs_on_one_sample/timeouts"] == 1.0
    assert step["reward/async_hangs_on_one_sample/failures"] == 1.0


def test_a_learning_rate_that_kills_the_policy_is_reported_once(tiny_config, caplog):
    trainer = Trainer(tiny_config(actor__lr=1e6, run__total_steps=6))
    trainer.fit()
    warnings = [r.getMessage() for r in caplog.records if "stopped learning" in r.getMessage()]
    assert len(warnings) == 1 and "actor.lr=1e+06" in warnings[0]
    assert "the model outputs a uniform distribution" in warnings[0]


def test_a_healthy_run_reports_no_collapse(tiny_config, caplog):
    Trainer(tiny_config(run__total_steps=4)).fit()
    assert "stopped learning" not in caplog.text
