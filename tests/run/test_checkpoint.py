import json
import math
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from groupflow.run import checkpoint as ckpt
from groupflow.run.checkpoint import (
    CheckpointError,
    capture_rng_state,
    checkpoint_step,
    find_latest_checkpoint,
    is_complete_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    restore_rng_state,
    save_checkpoint,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


class Custom:
    """A class weights_only loading refuses (module-level so that it can be unpickled)."""

    def __init__(self, value):
        self.value = value


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((2, 3), value)}, "trainer_state": {"step": int(value)}}


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_round_trip_writes_one_file_per_component(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    state = {
        "model": {**model.state_dict(), "half": torch.arange(4, dtype=torch.bfloat16)},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "trainer_state": {"step": 3, "data_position": 17, "history": [1.0, 0.5], "name": "x"},
        "rng": capture_rng_state(),
        "extra": {"pair": (1, 2), 5: "int key", "nan": float("nan"), "raw": b"\x00\x01"},
        "flags": [0, 1],  # not a dict: a tree too
    }
    path = save_checkpoint(tmp_path, 3, state)
    assert path == tmp_path / "step_3"
    files = sorted(p.name for p in path.iterdir())
    assert files == [
        "extra.safetensors",
        "flags.safetensors",
        "manifest.json",
        "model.safetensors",
        "optimizer.safetensors",
        "rng.safetensors",
        "scheduler.json",
        "trainer_state.json",
    ]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["format_version"] == 2
    assert {k: v["format"] for k, v in manifest["components"].items()} == {
        "model": "safetensors",
        "optimizer": "tree",
        "scheduler": "json",
        "trainer_state": "json",
        "rng": "tree",
        "extra": "tree",
        "flags": "tree",
    }
    for info in manifest["components"].values():
        assert (path / info["file"]).stat().st_size == info["bytes"]
    assert (tmp_path / "latest").read_text() == "step_3\n"

    loaded = load_checkpoint(path)
    assert set(loaded) == set(state)
    for key, tensor in state["model"].items():
        assert loaded["model"][key].dtype == tensor.dtype and torch.equal(
            loaded["model"][key], tensor
        )
    assert loaded["trainer_state"] == state["trainer_state"]
    assert loaded["scheduler"] == state["scheduler"]
    extra = loaded["extra"]
    assert set(extra) == {"pair", 5, "nan", "raw"} and math.isnan(extra["nan"])
    assert (extra["pair"], extra[5], extra["raw"]) == ((1, 2), "int key", b"\x00\x01")
    assert loaded["flags"] == [0, 1]
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)  # tuples stay tuples
    exp_avg = state["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], exp_avg)
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    opt2 = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.5)
    opt2.load_state_dict(loaded["optimizer"])
    assert opt2.param_groups[0]["lr"] == 0.1


def test_tied_and_non_contiguous_tensors_are_saved(tmp_path):
    shared = torch.arange(6.0).reshape(2, 3)
    state = {"model": {"embed": shared, "lm_head": shared, "t": shared.t(), "row": shared[1]}}
    loaded = load_checkpoint(save_checkpoint(tmp_path, 0, state))["model"]
    assert torch.equal(loaded["embed"], shared) and torch.equal(loaded["lm_head"], shared)
    assert torch.equal(loaded["t"], shared.t()) and torch.equal(
        loaded["row"], torch.tensor([3.0, 4.0, 5.0])
    )


def test_failure_midway_keeps_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {**_state(1.0), "optimizer": {"lr": torch.tensor(1.0), "t": (1,)}})
    real_save = ckpt.save_tree
    calls = []

    def failing_save(value, path, *args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise OSError("disk full")
        real_save(value, path, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_tree", failing_save)
    broken = {**_state(2.0), "optimizer": {"t": (1,)}, "extra": {"t": (2,)}}
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, broken)
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_1"]  # temp dir removed
    found = find_latest_checkpoint(tmp_path)
    assert found == tmp_path / "step_1"
    assert torch.equal(load_checkpoint(found)["model"]["w"], torch.full((2, 3), 1.0))


_KILLED_WRITER = """
import os, sys, time, torch
torch.set_num_threads(1)
import groupflow.run.checkpoint as ckpt
root, marker = sys.argv[1], sys.argv[2]
ckpt.save_checkpoint(root, 1, {"model": {"w": torch.ones(3)}, "trainer_state": {"step": 1}})
real_save = ckpt.save_tree
def stalled_save(value, path, *a, **k):
    real_save(value, path, *a, **k)
    open(marker, "w").close()  # one component is on disk: the save is now half done
    time.sleep(120)
ckpt.save_tree = stalled_save
ckpt.save_checkpoint(root, 2, {"model": {"w": torch.zeros(3)}, "optimizer": {"t": (1,)}, "more": {"t": (2,)}})
"""


def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path):
    root, marker = tmp_path / "ckpt", tmp_path / "marker"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(root), str(marker)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, "writer exited before reaching the stalled save"
            assert time.monotonic() < deadline, "writer never reached the stalled save"
            time.sleep(0.05)
        tmp_dir = root / f".tmp_step_2_{proc.pid}"
        assert (tmp_dir / "optimizer.safetensors").exists() and not (
            tmp_dir / "manifest.json"
        ).exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    found = find_latest_checkpoint(root)
    assert found == root / "step_1"
    assert torch.equal(load_checkpoint(found)["model"]["w"], torch.ones(3))
    assert not tmp_dir.exists()  # the dead writer's temp dir was cleaned up
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1"]


def test_latest_pointer_corruption_falls_back_to_newest_complete(tmp_path):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, _state(float(step)))
    latest = tmp_path / "latest"
    latest.unlink()
    assert find_latest_checkpoint(tmp_path) == tmp_path / "step_2"

    latest.write_text("../../etc\n")
    with pytest.warns(UserWarning, match="not a step_<N> name"):
        assert find_latest_checkpoint(tmp_path) == tmp_path / "step_2"

    latest.write_text("step_7\n")
    with pytest.warns(UserWarning, match="points at step_7, which does not exist"):
        assert find_latest_checkpoint(tmp_path) == tmp_path / "step_2"

    # step_2 damaged after the fact (truncated file): neither the pointer nor the scan accepts it.
    latest.write_text("step_2\n")
    with open(tmp_path / "step_2" / "model.safetensors", "r+b") as f:
        f.truncate(10)
    with pytest.warns(UserWarning, match="model.safetensors of 10 bytes, but manifest.json says"):
        assert find_latest_checkpoint(tmp_path) == tmp_path / "step_1"
    with pytest.raises(CheckpointError, match="step_2 has model.safetensors of 10 bytes"):
        load_checkpoint(tmp_path / "step_2")


def test_latest_is_authoritative_when_complete(tmp_path):
    # After resuming from an earlier step, `latest` (not the highest step number) names the newest save.
    save_checkpoint(tmp_path, 5, _state(5.0))
    save_checkpoint(tmp_path, 3, _state(3.0))
    assert find_latest_checkpoint(tmp_path) == tmp_path / "step_3"


def test_incomplete_dirs_are_skipped(tmp_path):
    save_checkpoint(tmp_path, 1, _state(1.0))
    (tmp_path / "step_9").mkdir()  # e.g. copied by hand, no manifest
    (tmp_path / "latest").unlink()
    with pytest.warns(UserWarning, match="step_9: it has no manifest.json"):
        assert find_latest_checkpoint(tmp_path) == tmp_path / "step_1"
    bad = tmp_path / "step_8"
    bad.mkdir()
    (bad / "manifest.json").write_text(
        '{"step": 8, "components": {"m": {"file": "m.pt", "bytes": 3}}}'
    )
    assert not is_complete_checkpoint(bad)
    with pytest.raises(CheckpointError, match="step_8 is missing m.pt"):
        load_checkpoint(bad)
    (bad / "manifest.json").write_text('{"step": 1, "components": {}}')
    with pytest.raises(CheckpointError, match="manifest.json step 1, not 8"):
        checkpoint_step(bad)
    (bad / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable manifest.json"):
        load_checkpoint(bad)
    assert list_checkpoints(tmp_path) == [tmp_path / "step_1"]
    assert checkpoint_step(tmp_path / "step_1") == 1


def test_pruning_keeps_last_n_and_the_one_just_saved(tmp_path):
    (tmp_path / "step_0").mkdir()  # incomplete: never counted, never deleted
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, _state(float(step)), keep_last=2)
    assert list_checkpoints(tmp_path) == [tmp_path / "step_4", tmp_path / "step_5"]
    assert (tmp_path / "step_0").is_dir()
    save_checkpoint(tmp_path, 3, _state(3.0), keep_last=2)
    assert list_checkpoints(tmp_path) == [tmp_path / "step_3", tmp_path / "step_5"]
    assert prune_checkpoints(tmp_path, 1) == [tmp_path / "step_3"]
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_saving_an_existing_step_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 2, {"model": {"w": torch.ones(2)}, "old_only": {"a": 1}})
    save_checkpoint(tmp_path, 2, {"model": {"w": torch.zeros(2)}})
    loaded = load_checkpoint(tmp_path / "step_2")
    assert set(loaded) == {"model"} and torch.equal(loaded["model"]["w"], torch.zeros(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_2"]


def test_stale_temp_entries_are_cleaned_or_recovered(tmp_path):
    dead = _dead_pid()
    save_checkpoint(tmp_path, 4, _state(4.0))
    # A writer died between moving old step_4 aside and moving the new one in.
    os.rename(tmp_path / "step_4", tmp_path / f".tmp_old_step_4_{dead}")
    (tmp_path / f".tmp_step_7_{dead}").mkdir()
    (tmp_path / f".tmp_prune_step_1_{dead}").mkdir()
    (tmp_path / f".tmp_latest_{dead}").write_text("step_7\n")
    (tmp_path / f".tmp_step_8_{os.getpid()}").mkdir()  # a live writer's: left alone
    (tmp_path / ".tmp_not_ours").mkdir()
    with pytest.warns(UserWarning, match="restored .*step_4 from an interrupted replacement"):
        assert find_latest_checkpoint(tmp_path) == tmp_path / "step_4"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([f".tmp_step_8_{os.getpid()}", ".tmp_not_ours", "latest", "step_4"])
    assert torch.equal(load_checkpoint(tmp_path / "step_4")["model"]["w"], torch.full((2, 3), 4.0))


def test_find_latest_without_checkpoints(tmp_path):
    assert find_latest_checkpoint(tmp_path / "missing") is None
    assert find_latest_checkpoint(tmp_path) is None
    assert list_checkpoints(tmp_path / "missing") == []


@pytest.mark.parametrize(
    ("step", "state", "keep_last", "error", "match"),
    [
        (-1, {"a": {}}, None, ValueError, "step must be an integer >= 0"),
        (True, {"a": {}}, None, ValueError, "step must be an integer"),
        (1, {"a": {}}, 0, ValueError, "keep_last must be an integer >= 1"),
        (1, {}, None, TypeError, "non-empty dict"),
        (1, [1], None, TypeError, "non-empty dict"),
        (1, {"manifest": 1}, None, ValueError, "invalid checkpoint component name 'manifest'"),
        (1, {"../x": 1}, None, ValueError, "invalid checkpoint component name '../x'"),
        (1, {"_x": 1}, None, ValueError, "component name '_x'"),
    ],
)
def test_save_rejects_bad_input(tmp_path, step, state, keep_last, error, match):
    with pytest.raises(error, match=match):
        save_checkpoint(tmp_path, step, state, keep_last=keep_last)
    assert not any(tmp_path.iterdir())


def test_objects_that_would_need_pickle_are_refused_at_save(tmp_path):
    with pytest.raises(
        TypeError, match=r"component 'custom'.key: a tests.run.test_checkpoint.Custom"
    ):
        save_checkpoint(tmp_path, 1, {"custom": {"key": Custom(3)}})
    assert not any(tmp_path.iterdir())


class _Touch:
    """Unpickling this runs ``Path.touch`` on ``marker``: a stand-in for ``os.system``."""

    def __init__(self, marker):
        self.marker = Path(marker)

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _version1_checkpoint(root: Path, step: int, rng_payload) -> Path:
    """A checkpoint as format version 1 wrote it: RNG state in ``rng.pt`` via torch.save."""
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    with open(path / "rng.pt", "wb") as f:
        torch.save(rng_payload, f)
    components = {
        name: {"file": f, "format": fmt, "bytes": (path / f).stat().st_size}
        for name, f, fmt in (
            ("trainer_state", "trainer_state.json", "json"),
            ("rng", "rng.pt", "torch"),
        )
    }
    manifest = {"format_version": 1, "step": step, "components": components}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_a_crafted_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    path = _version1_checkpoint(tmp_path / "ckpt", 2, _Touch(marker))
    assert is_complete_checkpoint(path)
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"rng.pt: refusing to load it") as err:
        load_checkpoint(path)
    assert isinstance(err.value, ValueError)  # the CLI reports it as a user error
    assert not marker.exists()
    pickle.loads(pickle.dumps(_Touch(marker)))  # the payload is live: full unpickling runs it
    assert marker.exists()


def test_version1_checkpoints_still_load_with_the_weights_only_unpickler(tmp_path):
    random.seed(5)
    rng = capture_rng_state()
    expected = random.random()
    path = _version1_checkpoint(tmp_path, 4, rng)
    loaded = load_checkpoint(path)
    assert loaded["trainer_state"] == {"step": 4}
    restore_rng_state(loaded["rng"])
    assert random.random() == expected


def test_a_newer_format_version_is_a_clear_error(tmp_path):
    path = save_checkpoint(tmp_path, 1, _state(1.0))
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(
        CheckpointError, match="format version 99; this groupflow reads versions up to 2"
    ):
        load_checkpoint(path)


def _draw() -> tuple:
    return random.random(), np.random.rand(), np.random.randn(), torch.rand(2).tolist()


def test_rng_round_trip_through_a_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # leaves a cached Gaussian in NumPy's state
    path = save_checkpoint(tmp_path, 1, {"rng": capture_rng_state()})
    expected = _draw()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert _draw() != expected
    restore_rng_state(load_checkpoint(path)["rng"])  # a tree: no pickle involved
    assert _draw() == expected


def test_restore_rng_rejects_bad_state():
    with pytest.raises(TypeError, match="must be a dict"):
        restore_rng_state([1])
    state = capture_rng_state()
    with pytest.raises(ValueError, match=r"unknown keys \['jax'\] / missing keys \[\]"):
        restore_rng_state({**state, "jax": 1})
    with pytest.raises(ValueError, match=r"missing keys \['numpy'\]"):
        restore_rng_state({k: v for k, v in state.items() if k != "numpy"})


def test_cuda_state_without_cuda_warns(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    state = capture_rng_state()
    assert "cuda" not in state
    with pytest.warns(UserWarning, match="CUDA is not available"):
        restore_rng_state({**state, "cuda": [torch.zeros(8, dtype=torch.uint8)]})


@pytest.mark.gpu
def test_cuda_rng_state_round_trips_through_a_saved_file(tmp_path):
    torch.zeros(1, device="cuda")  # initialise CUDA: only then is its state captured
    state = capture_rng_state()
    assert len(state["cuda"]) == torch.cuda.device_count()
    torch.save(state, tmp_path / "rng.pt")
    first = torch.rand(4, device="cuda")
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=False))
    assert torch.equal(torch.rand(4, device="cuda"), first)


def test_module_exports_are_defined():
    assert all(hasattr(ckpt, name) for name in ckpt.__all__)
