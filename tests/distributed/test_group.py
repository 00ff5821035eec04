"""Worker groups on both backends with a toy worker (Ray tests start a local Ray instance once)."""

import sys
from pathlib import Path

import pytest
import torch

from groupflow.batch import Batch
from groupflow.distributed import WorkerError, WorkerGroup

sys.path.insert(0, str(Path(__file__).parent))
from toy_worker import ToyWorker  # noqa: E402

BACKENDS = ["local", pytest.param("ray", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=BACKENDS)
def group(request):
    if request.param == "ray":
        pytest.importorskip("ray")
        import os

        # Ray actors import the toy worker module by name.
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        )
    g = WorkerGroup(ToyWorker, 3, backend=request.param, timeout_s=30, scale=10.0)
    yield g
    g.shutdown()


def test_all_and_rank0_and_one(group):
    assert group.whoami() == [(0, 3), (1, 3), (2, 3)]
    assert group.scaled(2.0) == 20.0
    assert group.only_rank0() == 0
    assert "not_exposed" not in vars(group)  # undecorated methods are not group methods


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
    with pytest.raises(ValueError, match="unknown backend 'mpi'; valid: local, ray"):
        WorkerGroup(ToyWorker, 1, backend="mpi")
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        WorkerGroup(ToyWorker, 0)


@pytest.mark.slow
def test_ray_timeout_and_dead_worker():
    pytest.importorskip("ray")
    import os

    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    )
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
