"""Worker groups on both backends with a toy worker (Ray tests start a local Ray instance once)."""

import os
import sys
from pathlib import Path

import pytest
import torch

from groupflow.batch import Batch
from groupflow.distributed import PlacementError, PoolSpec, WorkerError, WorkerGroup

sys.path.insert(0, str(Path(__file__).parent))
from toy_worker import ToyWorker  # noqa: E402

BACKENDS = ["local", pytest.param("ray", marks=pytest.mark.slow)]


def ray_sees_toy_worker() -> None:
    """Ray actors import the toy worker module by name. Ray's worker processes take their
    environment when Ray starts, so a Ray started earlier (by another test module) is restarted
    once the module's folder is on PYTHONPATH."""
    ray = pytest.importorskip("ray")
    here = str(Path(__file__).parent)
    if here in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        return
    os.environ["PYTHONPATH"] = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module", params=BACKENDS)
def group(request):
    if request.param == "ray":
        ray_sees_toy_worker()
    g = WorkerGroup(ToyWorker, 3, backend=request.param, timeout_s=30, scale=10.0)
    yield g
    g.shutdown()


def test_all_and_rank0_and_one(group):
    assert group.whoami() == [(0, 3), (1, 3), (2, 3)]
    assert group.scaled(2.0) == 20.0
    assert group.only_rank0() == 0
    assert "not_exposed" not in vars(group)  # undecorated methods are not group methods


def test_submit_returns_a_wait_that_gives_the_call_result(group):
    wait = group.submit("scaled", 3.0)  # Ray: running meanwhile; in-process: already ran
    assert wait() == 30.0 and group.submit("whoami")() == [(0, 3), (1, 3), (2, 3)]
    with pytest.raises(AttributeError, match="no registered method 'not_exposed'"):
        group.submit("not_exposed")


@pytest.mark.parametrize("n", [1, 2, 3, 7, 9])
def test_dp_uneven_sizes_roundtrip(group, n):
    b = Batch({"x": torch.arange(n)}, {"s": [f"s{i}" for i in range(n)]})
    out = group.double(b)
    assert out["y"].tolist() == [2 * i for i in range(n)]
    assert list(out["s"]) == [f"s{i}" for i in range(n)]
    # samples are spread over ranks in consecutive equal parts
    per = -(-n // 3)
    assert out["rank"].tolist() == [i // per for i in range(n)]


def test_dp_expansion_keeps_input_order(group):
    b = Batch({"x": torch.arange(5)})
    out = group.expand(b, 3)
    assert out["x"].tolist() == [i for i in range(5) for _ in range(3)]
    assert out["j"].tolist() == [0, 1, 2] * 5


def test_workers_see_which_samples_are_padding(group):
    out = group.count_real(
        Batch({"x": torch.arange(4)})
    )  # parts of 2: ranks hold 2, 2, 0 real samples
    assert out["real_on_rank"].tolist() == [2, 2, 2, 2]
    out = group.count_real(Batch({"x": torch.arange(7)}))  # parts of 3: 3, 3, 1 real
    assert out["real_on_rank"].tolist() == [3, 3, 3, 3, 3, 3, 1]


def test_worker_exception_names_worker_rank_method_and_traceback(group):
    if group.backend == "local":
        # in-process: the original exception, with a note saying where it happened
        with pytest.raises(ValueError, match="boom on rank 1") as e:
            group.fail_on(1)
        assert "(in ToyWorker rank 1, method fail_on())" in e.value.__notes__
    else:
        with pytest.raises(
            WorkerError, match=r"ToyWorker rank 1: fail_on\(\) failed: raised an exception"
        ) as e:
            group.fail_on(1)
        assert "ValueError: boom on rank 1" in str(e.value) and "Traceback" in str(e.value)
    assert group.whoami()[1] == (1, 3)  # the group is still usable


def test_bad_construction():
    with pytest.raises(ValueError, match="unknown backend 'mpi'; valid: local, process, ray"):
        WorkerGroup(ToyWorker, 1, backend="mpi")
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        WorkerGroup(ToyWorker, 0)


@pytest.mark.slow
def test_ray_timeout_and_dead_worker():
    ray_sees_toy_worker()
    slow = WorkerGroup(ToyWorker, 2, backend="ray", timeout_s=2)
    try:
        with pytest.raises(
            WorkerError, match=r"rank 0: sleep\(\) failed: no answer within 2 s \(timeout\)"
        ):
            slow.sleep(10)
    finally:
        slow.shutdown()
    dying = WorkerGroup(ToyWorker, 2, backend="ray", timeout_s=30)
    try:
        # the dead rank is reported, not a peer (the root cause comes first)
        with pytest.raises(WorkerError, match=r"rank 1: die\(\) failed: the worker process died"):
            dying.die(1)
    finally:
        dying.shutdown()


def test_pool_spec_slots_and_bad_counts():
    spec = PoolSpec(
        nodes=2, workers_per_node=3, cpus_per_worker=2, gpus_per_worker=0.5, name="actor"
    )
    assert spec.world_size == 6
    assert [spec.slot(r) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert spec.bundle() == {"CPU": 2, "GPU": 0.5}
    with pytest.raises(IndexError, match="rank 6 outside pool 'actor' of 6"):
        spec.slot(6)
    with pytest.raises(ValueError, match="pool 'ref': nodes and workers_per_node must be >= 1"):
        PoolSpec(nodes=0, name="ref")


def test_pool_spec_custom_resources_go_into_every_bundle_and_bad_ones_are_named():
    spec = PoolSpec(cpus_per_worker=0.5, name="rollout", resources={"node_b": 1})
    assert spec.bundle() == {"CPU": 0.5, "node_b": 1}
    with pytest.raises(ValueError, match=r"pool 'rollout': resource 'GPU' is Ray's own"):
        PoolSpec(name="rollout", resources={"GPU": 1})
    with pytest.raises(ValueError, match=r"pool 'rollout': resource 'node_b' must be > 0, got 0"):
        PoolSpec(name="rollout", resources={"node_b": 0})


def test_the_config_refuses_the_same_ray_resources_as_the_pool():
    from groupflow.config.run import RAY_RESOURCES
    from groupflow.distributed.placement import RESERVED_RESOURCES

    assert RAY_RESOURCES == RESERVED_RESOURCES


@pytest.mark.slow
def test_ray_pools_place_workers_per_node_and_report_what_cannot_fit():
    ray_sees_toy_worker()
    spec = PoolSpec(nodes=2, workers_per_node=2, cpus_per_worker=0.5, name="toy")
    g = WorkerGroup(ToyWorker, 4, backend="ray", timeout_s=60, pool=spec)
    try:
        where = g.placement()
        assert [(r, lr) for r, lr, _ in where] == [(0, "0"), (1, "1"), (2, "0"), (3, "1")]
        groups = [pg for _, _, pg in where]
        # one placement group per node: ranks 0-1 share one, ranks 2-3 another
        assert groups[0] == groups[1] != groups[2] == groups[3]
        assert g.double(Batch({"x": torch.arange(5.0)}))["y"].tolist() == [0, 2, 4, 6, 8]
    finally:
        g.shutdown()
    with pytest.raises(
        ValueError, match=r"pool 'toy' holds 4 workers \(2 nodes × 2\), but world_size is 3"
    ):
        WorkerGroup(ToyWorker, 3, backend="ray", pool=spec)
    greedy = PoolSpec(workers_per_node=1, cpus_per_worker=1, gpus_per_worker=4, name="gpu")
    with pytest.raises(
        PlacementError,
        match=r"pool 'gpu': Ray could not place 1 node\(s\) × 1 worker\(s\) with \{'CPU': 1, 'GPU': 4\} each within 3 s",
    ):
        WorkerGroup(ToyWorker, 1, backend="ray", pool=greedy, placement_timeout_s=3)
    # a group whose workers fail to start releases its reserved bundles (no leak for the next one)
    import ray

    def live_groups() -> set[str]:
        tables = ray.util.placement_group_table().values()
        return {t["placement_group_id"] for t in tables if t["state"] == "CREATED"}

    before = live_groups()
    with pytest.raises(WorkerError, match=r"ToyWorker rank \d: __init__\(\) failed"):
        WorkerGroup(ToyWorker, 2, backend="ray", timeout_s=60,
                    pool=PoolSpec(workers_per_node=2, cpus_per_worker=0.5), bogus=1)  # fmt: skip
    assert live_groups() == before


def test_ensure_ray_without_an_address_starts_its_own_instance(monkeypatch):
    """A cluster started on this machine earlier (``ray start``, another run) leaves its address
    in /tmp/ray, which a bare ``ray.init()`` joins, then refusing ``num_cpus``: without
    ``run.ray_address`` (and ``$RAY_ADDRESS``) a new local instance starts instead."""
    ray = pytest.importorskip("ray")
    from groupflow.distributed.group import ensure_ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ensure_ray(None, num_cpus=3)
    assert calls[-1]["address"] == "local" and calls[-1]["num_cpus"] == 3
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    ensure_ray(None, num_cpus=3)
    assert calls[-1]["address"] == "10.0.0.5:6379" and "num_cpus" not in calls[-1]
    ensure_ray("auto")
    assert calls[-1]["address"] == "auto"
