"""The CLI's account of failures other than config and data errors (groupflow/cli/errors.py):
reward contract violations, a diverged update, failed workers, disk and permission errors. Each
must print one paragraph naming the culprit and the fix, no traceback, and exit 2 for errors the
user fixes (1 for a worker that died or hung); an unanticipated error keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import pathlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from groupflow.cli.commands import main
from groupflow.distributed.group import WorkerError
from groupflow.rollout.hosts import RolloutTimeoutError
from groupflow.run import checkpoint as ckpt_module
from groupflow.trainer import Trainer
from groupflow.workers import actor as actor_module

REPO_ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path, tiny_config_data, **overrides) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config_data(run__total_steps=1, **overrides)))
    return str(path)


def _fails(capsys, argv: list[str], code: int = 2) -> str:
    """Run main; check the exit code and a one-paragraph message without a traceback."""
    assert main([*argv, "--no-plot"] if argv[0] == "train" else argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[0].startswith(f"groupflow {argv[0]}: error: "), err
    assert lines[1:] == ["(run with --log-level DEBUG for the full traceback)"], err
    return lines[0]


def _reward(name: str) -> str:
    return f"reward.functions=[{{function: 'bad_rewards:{name}'}}]"


def test_reward_returning_the_wrong_number_of_values(
    tmp_path, capsys, tiny_config_data, helpers_on_path
):
    msg = _fails(capsys, ["train", _config(tmp_path, tiny_config_data), _reward("wrong_length")])
    assert "bad_rewards" in msg and "wrong_length" in msg
    assert "returned 1 values for 16 completions" in msg
    assert "must return one float (or None) per completion" in msg


def test_reward_returning_strings(tmp_path, capsys, tiny_config_data, helpers_on_path):
    msg = _fails(capsys, ["train", _config(tmp_path, tiny_config_data), _reward("strings")])
    assert "strings" in msg and "non-numeric value at position 0: 'good'" in msg
    assert "must return one float (or None) per completion" in msg


def test_reward_failing_on_every_sample(tmp_path, capsys, tiny_config_data, helpers_on_path):
    msg = _fails(capsys, ["train", _config(tmp_path, tiny_config_data), _reward("always_fails")])
    assert "failed on every sample" in msg and "ZeroDivisionError: my reward divided by zero" in msg
    assert "fix the function or its kwargs under reward.functions" in msg


def test_diverged_updates(tmp_path, capsys, tiny_config_data, monkeypatch):
    real = actor_module.policy_loss

    def nan_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(actor_module, "policy_loss", nan_loss)
    config = _config(tmp_path, tiny_config_data, actor__max_nonfinite_steps=1)
    msg = _fails(capsys, ["train", config])
    assert "1 consecutive updates had a non-finite loss or gradient norm; lower actor.lr" in msg
    assert "run.allow_config_changes=[actor.lr]" in msg


def _raise_in_fit(monkeypatch, exc: BaseException) -> None:
    def fit(self):
        raise exc

    monkeypatch.setattr(Trainer, "fit", fit)


REMOTE_NONFINITE = """raised an exception; remote traceback:
Traceback (most recent call last):
  File "groupflow/distributed/group.py", line 58, in call
  File "groupflow/workers/common.py", line 60, in passed
groupflow.workers.common.NonFiniteLossError: 3 consecutive updates had a non-finite loss or gradient norm; lower actor.lr
"""
REMOTE_BUG = """raised an exception; remote traceback:
Traceback (most recent call last):
  File "groupflow/workers/actor.py", line 1, in update
IndexError: index 7 is out of bounds for dimension 0 with size 4
"""


@pytest.mark.parametrize(
    "detail, code, expected",
    [
        ("the worker process died (RayActorError: ...)", 1, "killed for memory"),
        ("no answer within 600 s (timeout)", 1, "Raise run.worker_timeout_s"),
        (REMOTE_NONFINITE, 2, "NonFinite"),
        (REMOTE_BUG, 1, "IndexError: index 7 is out of bounds"),
    ],
)
def test_worker_errors(tmp_path, capsys, tiny_config_data, monkeypatch, detail, code, expected):
    _raise_in_fit(monkeypatch, WorkerError("actor", 1, "update", detail))
    msg = _fails(capsys, ["train", _config(tmp_path, tiny_config_data)], code=code)
    assert "worker actor rank 1 failed in update()" in msg
    if expected == "NonFinite":  # a user error inside the worker: its own explanation
        assert "3 consecutive updates had a non-finite loss" in msg
        assert "run.allow_config_changes=[actor.lr]" in msg
    else:
        assert expected in msg and "run.resume=auto" in msg


HUNG_ROLLOUT = (
    "the rollout role did not deliver the batch of step 2 (policy version 1) within 15 s "
    "(run.worker_timeout_s); it is hung or far too slow"
)


def test_a_rollout_timeout_is_a_hang_not_the_timeout_it_was_raised_from(
    tmp_path, capsys, tiny_config_data, monkeypatch
):
    def fit(self):  # what AsyncRollout._receive does when the child's answer does not come
        try:
            raise TimeoutError("no answer within 15 s (timeout); process killed")
        except TimeoutError:
            raise RolloutTimeoutError(HUNG_ROLLOUT) from None

    monkeypatch.setattr(Trainer, "fit", fit)
    msg = _fails(capsys, ["train", _config(tmp_path, tiny_config_data)], code=1)
    assert msg.startswith(f"groupflow train: error: {HUNG_ROLLOUT}. Raise run.worker_timeout_s")
    assert "run.output_dir" not in msg and "run.resume=auto" in msg


@pytest.mark.slow  # a spawned rollout child
def test_a_stopped_rollout_child_is_reported_as_a_hang(
    tmp_path, capsys, tiny_config_data, helpers_on_path
):
    reward = {"function": "reward_helpers:stops_its_process_unless", "label": "reverse",
              "kwargs": {"parent_pid": os.getpid()}}  # SIGSTOPs the rollout child  # fmt: skip
    # The child's start is under the same timeout: leave a loaded machine time to import torch.
    config = _config(tmp_path, tiny_config_data, rollout__max_staleness=1,
                     run__worker_timeout_s=20, reward__functions=[reward])  # fmt: skip
    msg = _fails(capsys, ["train", config], code=1)
    assert "the rollout role did not deliver the batch of step 0 (policy version 0)" in msg
    assert "within 20 s (run.worker_timeout_s)" in msg and "Raise run.worker_timeout_s" in msg


def test_full_disk_found_in_the_chained_exception(tmp_path, capsys, tiny_config_data, monkeypatch):
    def full_disk(directory, name, value):
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(directory / f"{name}.pt"))
        except OSError as err:  # what torch does: its own error, the OS error only in the chain
            raise RuntimeError("PytorchStreamWriter failed writing file data/0") from err

    monkeypatch.setattr(ckpt_module, "_write_component", full_disk)
    msg = _fails(capsys, ["train", _config(tmp_path, tiny_config_data)])
    assert "no space left on the disk holding" in msg and "PytorchStreamWriter" in msg
    assert "set run.output_dir to a disk with room" in msg and "run.resume=auto" in msg


SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def test_full_disk_in_safetensors_is_the_disk_full_error(
    tmp_path, capsys, tiny_config_data, monkeypatch
):
    from safetensors import SafetensorError  # what safetensors raises (not an OSError)

    def full_disk(tensors, path):
        raise SafetensorError(SAFETENSORS_FULL)

    monkeypatch.setattr(ckpt_module, "_save_safetensors", full_disk)
    msg = _fails(capsys, ["train", _config(tmp_path, tiny_config_data)])
    assert "no space left on the disk holding " in msg and ".safetensors" in msg
    assert "set run.output_dir to a disk with room" in msg and "run.resume=auto" in msg
    # raised elsewhere (no file known), its text still gives it away
    _raise_in_fit(monkeypatch, SafetensorError(SAFETENSORS_FULL))
    msg = _fails(capsys, ["train", _config(tmp_path, tiny_config_data, run__name="again")])
    assert msg.startswith("groupflow train: error: no space left on the disk holding a file of")
    assert f"(SafetensorError: {SAFETENSORS_FULL})" in msg


def test_an_environment_whose_constructor_raises(
    tmp_path, capsys, tiny_config_data, helpers_on_path
):
    env = {"class": "agent_helpers:UnbuildableEnv", "kwargs": {"host": "sim:9"}}
    config = _config(tmp_path, tiny_config_data, rollout__max_turns=2, rollout__environment=env,
                     rollout__observation_template="{content}")  # fmt: skip
    msg = _fails(capsys, ["train", config])
    assert "rollout.environment: agent_helpers:UnbuildableEnv(**{'host': 'sim:9'}) raised " in msg
    assert "ConnectionError: cannot reach the simulator at sim:9" in msg
    assert "fix the class or rollout.environment.kwargs" in msg


def test_run_dir_below_a_file(tmp_path, capsys, tiny_config_data):
    (tmp_path / "afile").write_text("")
    config = _config(tmp_path, tiny_config_data, run__output_dir=str(tmp_path / "afile" / "runs"))
    msg = _fails(capsys, ["train", config])
    assert str(tmp_path / "afile") in msg and "Not a directory" in msg and "run.output_dir" in msg


def test_unwritable_run_dir(tmp_path, capsys, tiny_config_data, monkeypatch):
    locked = tmp_path / "locked"
    real_mkdir = pathlib.Path.mkdir

    def mkdir(self, *args, **kwargs):  # as for a directory without write permission (we are root)
        if str(self).startswith(str(locked)):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    msg = _fails(
        capsys, ["train", _config(tmp_path, tiny_config_data, run__output_dir=str(locked))]
    )
    assert f"cannot write {locked / 'tiny'}: Permission denied" in msg
    assert "choose a writable run.output_dir" in msg


def test_unanticipated_errors_keep_their_traceback(tmp_path, capsys, tiny_config_data, monkeypatch):
    _raise_in_fit(monkeypatch, RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["train", _config(tmp_path, tiny_config_data), "--no-plot"])


def test_debug_log_level_shows_the_traceback(tmp_path, tiny_config_data, helpers_on_path):
    from groupflow.rewards import RewardOutputError

    with pytest.raises(RewardOutputError):
        main(
            [
                "--log-level",
                "DEBUG",
                "train",
                _config(tmp_path, tiny_config_data),
                _reward("strings"),
            ]
        )


def test_exit_code_of_the_installed_command(tmp_path, tiny_config_data, helpers_on_path):
    env = {**os.environ, "PYTHONPATH": f"{helpers_on_path}{os.pathsep}{REPO_ROOT}"}
    config = _config(tmp_path, tiny_config_data)
    proc = subprocess.run(
        [sys.executable, "-m", "groupflow.cli", "train", config, _reward("strings"), "--no-plot"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "groupflow train: error: reward" in proc.stderr and "'good'" in proc.stderr
