"""The asynchronous rollout side on a Ray rollout pool: the rollout loop is a Ray actor there.

Design decision: with ``placement.rollout`` a Ray pool, the whole rollout side
(``groupflow.rollout.side.RolloutSide``: the workflow — single- or multi-turn, tools and
environments —, the replica of the prompt loader, rewards, dynamic-sampling refills) runs in one
Ray actor placed in the pool's first bundle, i.e. on the pool's node, reserving nothing of its
own (while it waits for generation, the pool's workers compute). Its workflow generates on the
pool's workers, which fetch each scheduled weight version from the actor's ranks through the
weight transport; the driver forwards only transport *tickets* (references, not weights) and
small job messages, and receives finished, contract-checked batches (token ids, rewards,
metrics) — nothing of the collect stage runs in the driver's process.

The actor runs the very ``serve`` loop of the local child process (``groupflow.rollout.side``) on
one end of a pipe inside its process; ``PoolSideHost`` gives ``AsyncRollout`` the surface of a
child process (``conn.send`` / ``recv_bytes``, ``wait``, ``close``) over Ray calls, so the
protocol, the deterministic schedule, timeouts and error reports are the local route's. The
driver makes one call at a time and waits for each, so the actor sees messages in order.

In-flight weight updates (``rollout.async_mode: in_flight``) need every worker of the pool to
switch between its own decode steps, in its own process, where the loop's pipe does not reach. So
each version the loop actor is given is also posted on a ``VersionBoard``, a small asynchronous
Ray actor beside it that holds the newest version and its ticket. Each worker keeps one question
to the board open (``BoardUpdates``: "a version newer than the one I hold?") and, between two
decode steps, only looks whether the answer has come (``ray.wait`` with no timeout: no call per
step). When it has, the worker fetches that version through the weight transport into its model
and goes on decoding (``InferenceWorker.take_updates_in_flight``). The workers switch
independently, each at its own step: every token records its version either way. A collective
transport cannot serve this (its receivers must all meet the sender), and the asynchronous
rollout refuses it anyway.

A driver killed with SIGKILL takes the actor with it (Ray ends the actors a dead job owns); a
resume regenerates the in-flight batches from the checkpoint's weight snapshots.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import threading
from typing import Any

import torch

from groupflow.rollout.side import RolloutSide, serve
from groupflow.rollout.spec import RolloutSpec

__all__ = ["BoardUpdates", "PoolSideHost", "TicketStore", "VersionBoard"]

GRACE_S = 30.0  # beyond a wait's own timeout, for the Ray call that carries it


class TicketStore:
    """The transport tickets of the last ``slots`` versions, with the ``WeightRing``'s interface
    (``write``/``read``/``versions``): what the pooled route publishes instead of weights."""

    def __init__(self, slots: int):
        self.slots, self._held = slots, {}

    def write(self, version: int, ticket) -> None:
        self._held[version] = ticket
        for v in [v for v in self._held if v <= version - self.slots]:
            del self._held[v]  # what a ring slot would have overwritten

    def read(self, version: int):
        if version not in self._held:
            raise RuntimeError(
                f"no weight ticket of policy version {version} (held: {self.versions()}): a "
                f"reader fell more than {self.slots} versions behind the writer"
            )
        return self._held[version]

    def versions(self) -> list[int]:
        return sorted(self._held)


class VersionBoard:
    """The newest version posted and its ticket (a Ray actor with asynchronous methods: many
    workers can wait on it at once). Versions only go up: an older one posted later (a
    checkpoint's snapshot at a resume) is not newer for anyone."""

    def __init__(self):
        self.version, self.ticket = -1, None
        self.posted = asyncio.Condition()

    async def post(self, version: int, ticket) -> None:
        async with self.posted:
            if version > self.version:
                self.version, self.ticket = version, ticket
                self.posted.notify_all()

    async def newer(self, held: int) -> tuple[int, Any]:
        """(version, ticket) once a version newer than ``held`` is posted."""
        async with self.posted:
            await self.posted.wait_for(lambda: self.version > held)
            return self.version, self.ticket


class BoardUpdates:
    """A worker's end of the ``VersionBoard``: ``self(held)`` is (the newest version posted, its
    ticket) when one newer than ``held`` has been posted, else (``held``, None) at once. One
    question stays open at the board; a call only looks whether its answer has come."""

    def __init__(self, board):
        self.board, self.asked = board, None

    def __call__(self, held: int) -> tuple[int, Any]:
        import ray

        if self.asked is not None and ray.wait([self.asked], timeout=0)[0]:
            version, ticket = ray.get(self.asked)
            self.asked = None
            if version > held:  # else: the worker got this far with a batch's own version
                return version, ticket
        if self.asked is None:
            self.asked = self.board.newer.remote(held)
        return held, None

    def __getstate__(self) -> dict:
        return {"board": self.board, "asked": None}  # a question is asked from one process


class SideActor:
    """The Ray actor that owns the rollout loop: a ``RolloutSide`` served by a thread of its
    process; its methods are the driver's end of the pipe."""

    def __init__(self, spec: RolloutSpec, slots: int, eager: bool, board=None):
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        torch.set_num_threads(spec.threads)
        self.ring = TicketStore(slots)  # tickets; the pool's workers fetch the weights
        self.status = torch.zeros(3, dtype=torch.long)  # phase, step, version (side.py)
        self.board = board  # in-flight updates: where the pool's workers look for versions
        self.side = RolloutSide(spec)
        self.conn, end = mp.Pipe()
        updates = None if board is None else BoardUpdates(board)
        self.thread = threading.Thread(
            target=serve, args=(end, self.side, self.ring, self.status, eager, updates),
            name="groupflow-rollout", daemon=True,
        )  # fmt: skip
        self.thread.start()

    def ready(self) -> bool:
        return True

    def publish(self, version: int, ticket) -> None:
        import ray

        self.ring.write(version, ticket)
        if self.board is not None:  # before the loop hears of it: no job starts older
            ray.get(self.board.post.remote(version, ticket), timeout=GRACE_S)
        self.conn.send(("weights", version))

    def submit(self, step: int, version: int) -> None:
        self.conn.send(("job", step, version))

    def poll(self, timeout_s: float) -> tuple[bool, bool, list[int]]:
        """(a reply is ready, the loop is alive, status) after waiting at most ``timeout_s``."""
        ready = self.conn.poll(timeout_s)
        return ready, self.thread.is_alive(), self.status.tolist()

    def recv_bytes(self) -> bytes:
        return self.conn.recv_bytes()

    def close(self) -> None:
        """Stop after the job that runs (its reply is dropped)."""
        try:
            self.conn.send(None)
        finally:
            self.conn.close()
            self.thread.join(timeout=5.0)
            self.side.close()


class PoolSideHost:
    """The driver's handle on the ``SideActor``, with the surface ``AsyncRollout`` uses for a
    child process. ``ring``: the driver's ``TicketStore`` (a ``("weights", v)`` message sends
    ``v``'s ticket along); ``status``: the driver's copy, refreshed at every wait."""

    kind = "Ray actor"
    process = None  # not a child process of the driver
    status_is_copy = True  # as of the actor's last answer: a dead actor's is stale

    def __init__(self, spec: RolloutSpec, pool, ring: TicketStore, status: torch.Tensor, *,
                 eager: bool, startup_timeout_s: float):  # fmt: skip
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        self.ring, self.status, self.conn = ring, status, self
        self.where = pool.node_report  # the loop actor shares the pool's first bundle
        self.board = None
        if spec.async_mode == "in_flight":
            self.board = ray.remote(VersionBoard).options(**pool.placement(0)).remote()
        remote = ray.remote(SideActor).options(**pool.placement(0), max_concurrency=1)
        self.actor = remote.remote(spec, ring.slots, eager, self.board)
        try:
            ray.get(self.actor.ready.remote(), timeout=startup_timeout_s)
        except GetTimeoutError:
            self.close()
            raise TimeoutError(
                f"the rollout loop's Ray actor did not start within {startup_timeout_s:g} s"
            ) from None
        except RayActorError as e:
            self.close()
            raise ChildProcessError(
                f"the rollout loop's Ray actor failed to start: {e}{self.where(0)}"
            ) from None

    def _get(self, ref, timeout_s: float) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(ref, timeout=timeout_s)
        except RayActorError as e:
            raise EOFError(
                f"the rollout loop's Ray actor died ({type(e).__name__}: {e}{self.where(0)})"
            ) from None
        except GetTimeoutError:
            raise TimeoutError from None

    # ----- the conn surface (AsyncRollout._conn) ------------------------------------------------
    def send(self, msg) -> None:
        if msg is None:
            return  # close() stops the actor
        try:
            if msg[0] == "weights":
                self._get(self.actor.publish.remote(msg[1], self.ring.read(msg[1])), GRACE_S)
            else:
                self._get(self.actor.submit.remote(*msg[1:]), GRACE_S)
        except (EOFError, TimeoutError) as e:
            raise BrokenPipeError(str(e) or "no answer from the rollout loop's Ray actor") from None

    def recv_bytes(self) -> bytes:
        return self._get(self.actor.recv_bytes.remote(), GRACE_S)

    # ----- the host surface (AsyncRollout._host) -------------------------------------------------
    def wait(self, timeout_s: float) -> None:
        """Until a reply is ready (TimeoutError after ``timeout_s``; ChildProcessError when the
        actor or its loop died)."""
        try:
            ready, alive, status = self._get(self.actor.poll.remote(timeout_s), timeout_s + GRACE_S)
        except EOFError as e:
            raise ChildProcessError(str(e)) from None
        self.status[:] = torch.tensor(status)
        if not ready and not alive:
            raise ChildProcessError("the rollout loop's thread in its Ray actor stopped")
        if not ready:
            raise TimeoutError

    def describe(self, what: str) -> str:
        """The actor ``what`` (e.g. "died"), with the node it ran on: a dead actor on a
        cluster most often means a dead machine, so the node is named every time."""
        where = self.where(0)
        return f"the rollout loop's Ray actor {what}{'' if where in what else where}"

    def close(self) -> None:
        import ray

        try:
            self._get(self.actor.close.remote(), GRACE_S)
        except Exception:  # noqa: BLE001 - already dead or hung: killed below either way
            pass
        ray.kill(self.actor)  # pyright: ignore[reportArgumentType] - Ray types handles as proxies
        if self.board is not None:
            ray.kill(self.board)  # pyright: ignore[reportArgumentType]
