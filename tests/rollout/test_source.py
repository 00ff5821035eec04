"""The driver's rollout-source seam (``groupflow.rollout.source``).

Checked: the trainer's loop talks to its source only through the interface (a recording source
sees start, batch(s), after_update(s+1) in order, then close, and the trainer logs what the
source returns), the synchronous source collects with version = step and reports the bytes that
passed through the driver, the asynchronous source's needed versions by hand, and its
``weights/bytes_via_driver`` equal to the model's size on one host.
"""

from __future__ import annotations

import pytest
import torch

from groupflow.rollout.source import AsyncRolloutSource, SyncRollout
from groupflow.run.tracking import read_metrics
from groupflow.trainer import Trainer
from groupflow.workflows.collect import Sampling


def _steps(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0]


class Recording:
    """A source that forwards to another one and records the trainer's calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def start(self, step):
        self.calls.append(("start", step))
        self.inner.start(step)

    def batch(self, step):
        self.calls.append(("batch", step))
        batch, metrics = self.inner.batch(step)
        return batch, {**metrics, "test/marker": float(step)}

    def after_update(self, version):
        self.calls.append(("after_update", version))
        return self.inner.after_update(version)

    def state(self, step):
        self.calls.append(("state", step))
        return self.inner.state(step)

    def load_state(self, state):
        self.inner.load_state(state)

    def close(self):
        self.calls.append(("close",))
        self.inner.close()


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_loop_uses_only_the_source_interface(tiny_config, staleness):
    worker = {"rollout__async_worker": "thread"} if staleness else {}  # k = 0 runs no side
    trainer = Trainer(tiny_config(run__total_steps=2, run__save_every=0, run__save_final=True,
                                  rollout__max_staleness=staleness, **worker))  # fmt: skip
    recording = Recording(trainer.source)
    trainer.source = recording
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    assert recording.calls == [
        ("start", 0), ("batch", 0), ("after_update", 1), ("batch", 1), ("after_update", 2),
        ("state", 2), ("close",),
    ]  # fmt: skip
    rows = _steps(trainer.run_dir)
    assert [r["test/marker"] for r in rows] == [0.0, 1.0]  # the source's metrics are logged
    for r in rows:
        assert "time/weight_transfer" in r and "weights/bytes_via_driver" in r


class FakeLoader:
    def __init__(self):
        self.drawn = 0

    def next_batch(self):
        self.drawn += 1
        return [self.drawn]

    def state_dict(self):
        return {"drawn": self.drawn}

    def load_state_dict(self, state):
        self.drawn = state["drawn"]


class FakeWorkflow:
    def collect(self, rows, step, round_, version):
        batch = {"rows": rows, "version": version}
        return batch, {"reward/mean": 0.5}


class FakePolicy:
    def __init__(self, nbytes):
        self.nbytes, self.synced = nbytes, []

    def sync(self, version=-1):
        from groupflow.policies.base import Moved

        self.synced.append(version)
        return Moved(self.nbytes, between_nodes=56)


def test_sync_source_collects_with_the_current_version_and_reports_driver_bytes():
    policy, loader = FakePolicy(1234), FakeLoader()
    source = SyncRollout(policy, FakeWorkflow(), loader, Sampling(prompts_per_step=1))
    batch, metrics = source.batch(3)
    assert batch == {"rows": [1], "version": 3} and metrics == {"reward/mean": 0.5}
    assert source.after_update(4) == {"weights/bytes_via_driver": 1234.0,
                                      "weights/bytes_between_nodes": 56.0}  # fmt: skip
    assert policy.synced == [4]  # the version the rollout group now holds
    state = source.state(4)
    source.batch(4)
    source.load_state(state)
    assert loader.drawn == 1  # the checkpoint's loader, not the later draw


def test_async_source_keeps_the_versions_of_the_next_k_plus_one_batches():
    source = AsyncRolloutSource(None, None, FakeLoader(), max_staleness=2, total_steps=lambda: 9,
                                async_worker="thread", async_mode="deterministic", timeout_s=1)  # fmt: skip
    # batches of steps 5, 6, 7 use versions 3, 4, 5 (max(0, s - k))
    assert source.needed_versions(5) == {3, 4, 5}
    assert source.needed_versions(0) == {0}
    assert source.needed_versions(1) == {0, 1}  # steps 1, 2, 3: versions 0, 0, 1
    # no side running: the checkpoint keeps the held snapshots of versions other than the step's
    source.snapshots = {3: {"w": torch.ones(2)}, 4: {"w": torch.zeros(2)}, 1: {"w": torch.ones(1)}}
    state = source.state(5)
    assert state["async_rollout"] == {"versions": [3, 4]}
    assert torch.equal(state["rollout_weights_v3"]["w"], torch.ones(2))


def test_async_bytes_via_driver_are_the_models_bytes_on_one_host(tiny_config):
    trainer = Trainer(tiny_config(run__total_steps=2, rollout__max_staleness=1,
                                  rollout__async_worker="thread"))  # fmt: skip
    try:
        trainer.fit()
        weights = trainer.policy.snapshot()
    finally:
        trainer.shutdown()
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert nbytes > 0
    assert [r["weights/bytes_via_driver"] for r in _steps(trainer.run_dir)] == [nbytes, nbytes]
