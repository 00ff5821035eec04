"""The pooled rollout's pieces: the ticket store's eviction, the rule that only a Ray worker group
may travel to the rollout loop's actor, the reports of a dead loop actor (no Ray), and the version
board the pool's workers take in-flight updates from (a real Ray actor; the Ray route itself:
tests/distributed/test_ray_trainer.py)."""

import pickle
import time

import pytest

from groupflow.distributed import WorkerGroup
from groupflow.rollout.ray_host import BoardUpdates, TicketStore, VersionBoard


def test_ticket_store_keeps_the_last_slots_versions_and_names_a_missing_one():
    store = TicketStore(3)
    for v in range(5):
        store.write(v, f"ticket-{v}")
    assert store.versions() == [2, 3, 4]  # 0 and 1 overwritten, as ring slots would be
    assert store.read(3) == "ticket-3"
    with pytest.raises(
        RuntimeError, match=r"no weight ticket of policy version 1 \(held: \[2, 3, 4\]\)"
    ):
        store.read(1)


class _Echo:
    def __init__(self, rank: int, world_size: int):
        self.rank = rank


def test_an_in_process_worker_group_refuses_to_leave_its_process():
    group = WorkerGroup(_Echo, 1)
    with pytest.raises(TypeError, match=r"a local worker group \(_Echo\) cannot leave its process"):
        pickle.dumps(group)


def test_a_dead_loop_actor_is_reported_with_the_node_it_ran_on_once():
    """Every report of the actor's death names its node (a dead actor on a cluster is most often a
    dead machine), also when the driver only saw the pipe close; never twice."""
    from groupflow.rollout.ray_host import PoolSideHost

    host = object.__new__(PoolSideHost)  # no Ray: only the report is under test
    host.where = lambda rank: "; it ran on node n1 (10.0.0.2, now dead)"
    assert host.describe("died") == (
        "the rollout loop's Ray actor died; it ran on node n1 (10.0.0.2, now dead)"
    )
    seen = "could not be reached (the rollout loop's Ray actor died; it ran on node n1 (10.0.0.2, now dead))"
    assert host.describe(seen).count("it ran on node n1") == 1
    host.where = lambda rank: ""  # not known (the placement group is gone)
    assert host.describe("died") == "the rollout loop's Ray actor died"


def test_a_dead_loop_actor_names_the_batches_in_flight_and_calls_its_status_last_heard():
    """The driver's copy of the actor's status is as of its last answer, which a dead actor cannot
    refresh (the side may have moved on): the report says "last heard from" and names the batches
    in flight from the driver's own records, which are exact."""
    import torch

    from groupflow.rollout.hosts import AsyncRollout
    from groupflow.rollout.ray_host import PoolSideHost
    from groupflow.rollout.side import IDLE, LOADING

    host = object.__new__(PoolSideHost)
    host.where = lambda rank: "; it ran on node n1 (10.0.0.2)"
    rollouts = object.__new__(AsyncRollout)
    rollouts._host, rollouts._jobs = host, {3: 2, 2: 1}
    rollouts.status = torch.tensor([LOADING, 2, 1])
    assert rollouts._death("died") == (
        "the rollout loop's Ray actor died; it ran on node n1 (10.0.0.2) (last heard from loading "
        "the weights of policy version 1 for step 2; batches in flight: step 2 (policy version 1), "
        "step 3 (policy version 2))"
    )
    rollouts.status, rollouts._jobs = torch.tensor([IDLE, 2, 1]), {3: 2}
    assert rollouts._death("died").endswith("(batches in flight: step 3 (policy version 2))")
    rollouts._jobs = {}
    assert (
        rollouts._death("died") == "the rollout loop's Ray actor died; it ran on node n1 (10.0.0.2)"
    )


def _answer(asks: BoardUpdates, held: int, timeout_s: float = 30.0):
    """What ``asks(held)`` answers once the board's answer has come (it never waits itself)."""
    deadline = time.monotonic() + timeout_s
    while (got := asks(held)) == (held, None):
        assert time.monotonic() < deadline, f"no answer newer than {held}"
        time.sleep(0.01)
    return got


@pytest.mark.slow
def test_the_version_board_answers_newer_versions_only_and_never_makes_a_worker_wait(shared_ray):
    """A worker's end asks once and then only looks: before any post it answers (held, None) at
    once; after posts it answers the newest version with its ticket; an older version posted
    later (a resume's snapshot) is no news; an answer overtaken by the worker's own load is
    dropped; a copy pickled for another process carries no question of this one's."""
    import ray

    board = ray.remote(VersionBoard).remote()
    try:
        asks = BoardUpdates(board)
        start = time.perf_counter()
        assert asks(-1) == (-1, None) and asks(-1) == (-1, None)
        assert time.perf_counter() - start < 5.0  # a look, not a wait for a version
        ray.get(board.post.remote(2, {"version": 2, "refs": ["a"]}))
        ray.get(board.post.remote(1, {"version": 1}))  # older: ignored
        assert _answer(asks, -1) == (2, {"version": 2, "refs": ["a"]})
        assert asks(2) == (2, None)  # asked again, holding 2: nothing newer yet
        ray.get(board.post.remote(4, {"version": 4}))
        ray.get(board.post.remote(3, {"version": 3}))
        assert _answer(asks, 2) == (4, {"version": 4})
        # holding 4, it asks; then a batch loads 6 itself, and the board's answer (5) is stale
        assert asks(4) == (4, None)
        ray.get(board.post.remote(5, {"version": 5}))
        ray.wait([asks.asked], timeout=30)
        assert asks(6) == (6, None)  # 5 dropped, asked again holding 6
        ray.get(board.post.remote(7, {"version": 7}))
        assert _answer(asks, 6) == (7, {"version": 7})
        asks(7)
        clone = pickle.loads(pickle.dumps(asks))
        assert asks.asked is not None and clone.asked is None
        assert _answer(clone, 6) == (7, {"version": 7})  # the same board
    finally:
        ray.kill(board)
