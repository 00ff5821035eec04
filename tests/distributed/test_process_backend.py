"""The ``process`` backend: one worker per spawned child process, every call under a timeout.

Checked with the toy worker: answers come back (tensors included), a worker's exception arrives
with its traceback, and a dead or hung child becomes a WorkerError naming the worker, its role and
the method — never a hang.
"""

import sys
import time
from pathlib import Path

import pytest
import torch

from groupflow.batch import Batch
from groupflow.distributed import WorkerError, WorkerGroup

sys.path.insert(0, str(Path(__file__).parent))
from toy_worker import ToyWorker  # noqa: E402


@pytest.fixture(scope="module")
def group():
    g = WorkerGroup(ToyWorker, 2, backend="process", timeout_s=20, role_name="rollout", scale=3.0)
    yield g
    g.shutdown()


def test_calls_reach_every_child_and_tensors_come_back(group):
    assert group.whoami() == [(0, 2), (1, 2)]
    assert group.scaled(2.0) == 6.0
    out = group.double(Batch({"x": torch.arange(4.0)}))
    torch.testing.assert_close(out["y"], torch.tensor([0.0, 2.0, 4.0, 6.0]))
    assert out["rank"].tolist() == [0, 0, 1, 1]


def test_worker_exception_names_role_method_and_carries_traceback(group):
    with pytest.raises(WorkerError) as e:
        group.fail_on(1)
    msg = str(e.value)
    assert "ToyWorker (rollout role) rank 1: fail_on() failed" in msg
    assert "ValueError: boom on rank 1" in msg
    assert group.whoami() == [(0, 2), (1, 2)]  # the group still works after a raised error


def test_dead_child_is_reported_at_once_not_at_the_timeout():
    g = WorkerGroup(ToyWorker, 1, backend="process", timeout_s=60, role_name="rollout")
    try:
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"rollout role\) rank 0: die\(\) failed: .*died"):
            g.die(0)
        assert time.monotonic() - start < 10
    finally:
        g.shutdown()


def test_hung_child_times_out_and_is_killed():
    g = WorkerGroup(ToyWorker, 1, backend="process", timeout_s=1.0, role_name="rollout")
    try:
        process = g._hosts[0].process
        with pytest.raises(
            WorkerError, match=r"sleep\(\) failed: no answer within 1 s \(timeout\)"
        ):
            g.sleep(30)
        assert not process.is_alive()
    finally:
        g.shutdown()


def test_constructor_failure_is_a_worker_error():
    with pytest.raises(WorkerError, match=r"(?s)__init__\(\) failed: .*TypeError"):
        WorkerGroup(ToyWorker, 1, backend="process", timeout_s=20, no_such_argument=1)


def test_a_child_stuck_importing_the_script_times_out_at_start_and_big_arguments_arrive(tmp_path):
    # spawn makes the child import the parent's __main__ script again before it reads anything;
    # a child stuck there (a script starting a run outside `if __name__ == "__main__":`) must not
    # block the parent past the start-up timeout, however big the arguments it is to receive
    import os
    import subprocess

    script = tmp_path / "script.py"
    script.write_text(
        "import sys, time\n"
        "if __name__ == '__mp_main__' and sys.argv[1] == 'stuck':\n"
        "    time.sleep(3600)  # the child, importing this script again, never gets further\n"
        "from groupflow.distributed.process import ProcessHost\n"
        "def target(conn, blob):\n"
        "    conn.send((True, None))\n"
        "    conn.send(len(blob))\n"
        "if __name__ == '__main__':\n"
        "    start = time.monotonic()\n"
        "    try:\n"
        "        limit = float(sys.argv[2])\n"
        "        host = ProcessHost(target, (b'x' * 2_000_000,), startup_timeout_s=limit)\n"
        "        print('started', host.conn.recv())\n"
        "        host.close()\n"
        "    except TimeoutError as e:\n"
        "        print('timeout after', round(time.monotonic() - start), 's:', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    def run(mode, limit):
        out = subprocess.run([sys.executable, str(script), mode, str(limit)], env=env,
                             capture_output=True, text=True, timeout=90)  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    stuck = run("stuck", 3)
    assert stuck.startswith("timeout after 3 s: no answer within 3 s (timeout); process killed")
    assert "if __name__ == '__main__':" in stuck
    assert run("fine", 60) == "started 2000000"
