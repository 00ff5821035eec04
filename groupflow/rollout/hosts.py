"""Asynchronous rollout: the batches of later steps are collected while the trainer updates.

Design decision (verl's one-step-off policy generalised to k steps; AReaL's staleness bound):
with ``rollout.max_staleness: k`` the batch trained at step s is *always* generated with the
weights of version max(0, s − k) — never "whatever is newest" — so a run is reproducible, and a
resume can regenerate the batches that were in flight from the weight snapshots the checkpoint
keeps.

Where the work happens (profiled: ``benchmarks/README.md``): the *whole* collect stage — loader
draws, generation, rewards, batch assembly, dynamic-sampling refills — runs on the rollout side
(``groupflow.rollout.side``), by default a spawned child process with one torch thread, so that
nothing but the update competes for the trainer's core or its GIL. The trainer talks to it with
three calls: ``publish(version, weights)`` copies a version into a shared ``WeightRing`` (one
memcpy: the whole cost of a weight push to the trainer), ``submit(step, version)`` sends a tiny
message, ``result(step)`` receives the finished, contract-checked batch. The side's prompt loader
replicates the trainer's, so prompts are those of a synchronous run; each result carries the
loader state after it (``loader_state``, what a checkpoint saves). With a Ray rollout pool
(``pool``) the same side runs in a Ray actor on that pool (``groupflow.rollout.ray_host``), and
versions are published as weight-transport tickets instead of weights. The three places the
side can run — a child process (``distributed.process.ProcessHost``), a thread (``ThreadHost``),
a Ray actor (``ray_host.PoolSideHost``) — are one ``SideHost``: the pipe's end, a wait that
reports a dead host, a description for an error, close; the trainer's calls never ask which.

``rollout.async_worker: thread`` runs the same side in a thread of this process (no pickling of
the spec, slower: one GIL); it is also the fallback, with a warning, when the spec cannot be
pickled or unpickled in a child — e.g. a reward function given to ``groupflow.Run`` as a lambda or
defined in a notebook — and when the run was started from the top level of a script outside
``if __name__ == "__main__":`` (the child would run the script again: ``utils.main_guard``).

Every wait has a timeout (``run.worker_timeout_s``), the child's start included; a dead child, a
hung weight load or collect, or an error on the side is raised in the trainer naming the role,
the step and the policy version.

``rollout.async_mode: eager`` trades reproducibility for freshness: a job takes the newest version
published when the side *starts* it (at submission the newest version is the scheduled one, so
only a start that lags behind — generation slower than training, k >= 2 — can see a newer one).
That version is at least the scheduled one, so the bound still holds, and the batch records the
version it really came from.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import threading
import time
from typing import Any, Protocol

import torch

from groupflow.distributed import WorkerError
from groupflow.distributed.process import ChildStartError, ProcessHost
from groupflow.rollout.ray_host import PoolSideHost, TicketStore
from groupflow.rollout.side import (
    COLLECTING,
    IDLE,
    LOADING,
    SPEC_UNPICKLABLE,
    RolloutSide,
    process_main,
    serve,
)
from groupflow.rollout.spec import RolloutSpec
from groupflow.rollout.weight_ring import WeightRing
from groupflow.utils.main_guard import unguarded_main_call

log = logging.getLogger("groupflow")

__all__ = ["AsyncRollout", "schedule_version", "RolloutTimeoutError", "RolloutError"]


def schedule_version(step: int, max_staleness: int) -> int:
    """The policy version whose weights generate the batch of ``step`` (deterministic schedule)."""
    return max(0, step - max_staleness)


def ring_slots(max_staleness: int) -> int:
    """Weight versions the ring holds: version v is overwritten by v + k + 2 only after the batch
    of step v + k + 1 — whose version is v + 1 — was delivered, i.e. once no job can need v."""
    return max_staleness + 2


class RolloutTimeoutError(RuntimeError):
    """The rollout role did not deliver a batch (or load weights) within its timeout."""


def _sending(msg) -> str:
    """What a message to the rollout side was for (an error names the step and version)."""
    if isinstance(msg, tuple) and msg[0] == "job":
        return f" (submitting the batch of step {msg[1]}, policy version {msg[2]})"
    if isinstance(msg, tuple) and msg[0] == "weights":
        return f" (sending policy version {msg[1]})"
    return ""


class RolloutError(RuntimeError):
    """The rollout side failed with an exception that could not be sent back as itself."""


class SideHost(Protocol):
    """Where the rollout side runs, as ``AsyncRollout`` talks to it."""

    kind: str  # "process", "thread" or "Ray actor" (error notes)
    process: Any  # the child process, or None

    @property
    def conn(self) -> Any:
        """The trainer's end of the pipe (send, recv_bytes, close)."""
        ...

    def wait(self, timeout_s: float) -> None:
        """Until a reply can be read: ``TimeoutError`` after ``timeout_s``, ``ChildProcessError``
        once the host died."""
        ...

    def describe(self, what: str) -> str:
        """The host ``what`` (e.g. "died"), for an error message."""
        ...

    def close(self) -> None: ...


class ThreadHost:
    """The side in a thread of the trainer's process (``rollout.async_worker: thread``, or the
    fallback when the spec cannot travel to a child)."""

    kind = "thread"
    process = None

    def __init__(self, spec: RolloutSpec, ring, status: torch.Tensor, eager: bool,
                 join_timeout_s: float):  # fmt: skip
        self.side = RolloutSide(spec)  # built here: a failure surfaces at once
        self._conn, child = mp.Pipe()
        self.join_timeout_s = join_timeout_s
        self.thread = threading.Thread(
            target=serve, args=(child, self.side, ring, status, eager),
            name="groupflow-rollout", daemon=True,
        )  # fmt: skip
        self.thread.start()

    @property
    def conn(self):
        return self._conn

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(min(0.2, max(0.0, deadline - time.monotonic()))):
            if not self.thread.is_alive():
                raise ChildProcessError("the rollout thread stopped")
            if time.monotonic() >= deadline:
                raise TimeoutError

    def describe(self, what: str) -> str:
        return f"the rollout thread {what}"

    def close(self) -> None:
        self._conn.close()  # a reply nobody will read must not block the thread's send
        self.thread.join(timeout=self.join_timeout_s)
        self.side.close()


class AsyncRollout:
    """The trainer's handle on the rollout side: ``publish`` weights, ``submit`` jobs (in step
    order), take each ``result`` in step order."""

    def __init__(self, spec: RolloutSpec, template: dict[str, torch.Tensor], *,
                 max_staleness: int, process: bool, timeout_s: float, eager: bool = False,
                 role: str = "rollout", ring=None, pool=None):  # fmt: skip
        """``pool``: a Ray rollout pool (``WorkerGroup``): the side runs in a Ray actor there
        (``groupflow.rollout.ray_host``), publishing the tickets in ``ring`` (a ``TicketStore``)."""
        self.timeout_s, self.role = timeout_s, role
        self.loader_state = spec.loader.state  # the loader after the last delivered batch
        self._jobs: dict[int, int] = {}  # submitted, not yet taken: step -> scheduled version
        self._ready: dict[int, tuple] = {}  # received, not yet taken: step -> reply
        self._host: SideHost | None = None
        process = process and pool is None
        if process and (where := unguarded_main_call()) is not None:
            _warn_thread_route(
                f"the run was started at the top level of {where}, outside "
                '`if __name__ == "__main__":`, and a child process would run that script '
                "again",
                'Start the run under `if __name__ == "__main__":` to keep it in a process.',
            )
            process = False
        data = _pickled(spec) if process else None  # None: stays in this process (warned)
        # ring: the versions' store (a caller's, e.g. transport tickets; default shared memory)
        self.ring = (
            ring
            if ring is not None
            else WeightRing(template, ring_slots(max_staleness), shared=data is not None)
        )
        self.status = torch.zeros(3, dtype=torch.long)  # phase, step, version (side.py)
        if data is not None:
            self.status.share_memory_()
            self._host = self._start_process(data, eager)
        if pool is not None:
            self._host = self._start_on_pool(spec, pool, eager)
        if self._host is None:
            self._host = ThreadHost(spec, self.ring, self.status, eager, self.timeout_s)
        self._conn = self._host.conn

    def _start_process(self, data: bytes, eager: bool) -> ProcessHost | None:
        args = (data, self.ring, self.status, eager)
        try:
            host = ProcessHost(process_main, args, startup_timeout_s=self.timeout_s)
        except ChildStartError as e:
            if str(e.value).startswith(SPEC_UNPICKLABLE):  # e.g. a reward defined in a notebook
                _warn_thread_route(f"{SPEC_UNPICKLABLE} ({str(e.value).splitlines()[-1]})")
                return None
            raise WorkerError(self._name(), 0, "__init__", str(e)) from None
        except (ChildProcessError, TimeoutError) as e:
            raise WorkerError(self._name(), 0, "__init__", str(e)) from None
        return host

    def _start_on_pool(self, spec: RolloutSpec, pool, eager: bool) -> PoolSideHost:
        assert isinstance(self.ring, TicketStore), "a pool's versions are transport tickets"
        try:
            host = PoolSideHost(spec, pool, self.ring, self.status, eager=eager,
                                startup_timeout_s=self.timeout_s)  # fmt: skip
        except (ChildProcessError, TimeoutError) as e:
            raise WorkerError(self._name(), 0, "__init__", str(e)) from None
        return host

    @property
    def process(self):
        """The child process (None in the thread route and on a pool)."""
        return self._host.process if self._host is not None else None

    # ----- the trainer's calls ------------------------------------------------------------------
    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Make ``version``'s weights available to the side (a copy into the ring)."""
        self.ring.write(version, weights)
        self._send(("weights", version))

    def submit(self, step: int, version: int) -> None:
        if step in self._jobs:
            raise RuntimeError(f"the batch of step {step} was already submitted")
        self._jobs[step] = version
        self._send(("job", step, version))

    def in_flight(self) -> list[int]:
        return sorted(self._jobs)

    def result(self, step: int) -> tuple:
        """The (batch, metrics) of ``step``, waiting for it at most ``timeout_s``."""
        if step not in self._jobs:
            raise RuntimeError(f"no rollout job for step {step} (in flight: {self.in_flight()})")
        while step not in self._ready:
            self._receive(step)
        reply = self._ready.pop(step)
        version = self._jobs.pop(step)
        if reply[0] == "error":
            raise self._error(reply[2], step, version)
        _, _, batch, metrics, self.loader_state = reply
        return batch, metrics

    def drain(self) -> None:
        """Wait until every submitted job has been answered (results stay to be taken)."""
        for step in self.in_flight():
            while step not in self._ready:
                self._receive(step)

    def close(self) -> None:
        """Stop the side after the job it is running (abandoned jobs are not waited for)."""
        self._jobs.clear()
        self._ready.clear()
        try:
            self._conn.send(None)
        except (OSError, ValueError):
            pass  # already gone (a dead child, a closed pipe): nothing to stop
        if self._host is not None:
            if self._host.process is not None:
                self._host.process.join(timeout=5.0)
            self._host.close()
            self._host = None

    # ----- plumbing -------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        try:
            self._conn.send(msg)
        except (BrokenPipeError, OSError) as e:
            detail = self._death(f"could not be reached ({e})")
            if int(self.status[0]) == IDLE:  # say what the driver was sending it
                detail += _sending(msg)
            raise WorkerError(self._name(), 0, "submit", detail) from None

    def _receive(self, step: int) -> None:
        """Wait for the next reply (for at most ``timeout_s``) and file it under its step."""
        try:
            self._wait()
            reply = pickle.loads(self._conn.recv_bytes())
        except TimeoutError:
            raise RolloutTimeoutError(self._timeout_message(step)) from None
        except ChildProcessError as e:
            raise WorkerError(self._name(), 0, "collect", f"{e}{self._doing()}") from None
        except (EOFError, OSError):
            raise WorkerError(self._name(), 0, "collect", self._death("died")) from None
        self._ready[reply[1]] = reply

    def _wait(self) -> None:
        assert self._host is not None, "the rollout side was closed"
        self._host.wait(self.timeout_s)  # also reports a host that died

    def _timeout_message(self, step: int) -> str:
        phase, doing_step, version = (int(x) for x in self.status)
        what = "deliver the batch of"
        if phase == LOADING:
            what = f"load the weights of policy version {version} (weight sync) before"
            step = doing_step
        return (
            f"the {self.role} role did not {what} step {step} (policy version "
            f"{self._jobs.get(step, version)}) within {self.timeout_s:g} s "
            "(run.worker_timeout_s); it is hung or far too slow"
        )

    def _doing(self) -> str:
        """What the side was doing, from its status (for an error message). A Ray actor's status
        is the copy its last answer carried, which a dead actor cannot refresh: that is said, with
        the batches in flight from the driver's own records (exact either way)."""
        phase, step, version = (int(x) for x in self.status)
        doing = ""
        if phase == LOADING:
            doing = f"loading the weights of policy version {version} for step {step}"
        elif phase == COLLECTING:
            doing = f"collecting the batch of step {step}, policy version {version}"
        if not getattr(self._host, "status_is_copy", False):
            return f" (while {doing})" if doing else ""
        parts = [f"last heard from {doing}"] if doing else []
        if self._jobs:
            parts.append(
                "batches in flight: "
                + ", ".join(f"step {t} (policy version {v})" for t, v in sorted(self._jobs.items()))
            )
        return f" ({'; '.join(parts)})" if parts else ""

    def _death(self, what: str) -> str:
        if self._host is None:
            return f"the rollout side (closed) {what}"
        return f"{self._host.describe(what)}{self._doing()}"

    def _error(self, payload: tuple, step: int, version: int) -> BaseException:
        kind, body, text = payload
        where = self._host.kind if self._host is not None else "side"
        note = (f"(in the {self.role} role's {where}, batch of step {step}, policy version "
                f"{version}); its traceback:\n{text}")  # fmt: skip
        error = pickle.loads(body) if kind == "exception" else RolloutError(body)
        error.add_note(note)
        return error

    def _name(self) -> str:
        return f"RolloutSide ({self.role} role)"


def _pickled(spec: RolloutSpec) -> bytes | None:
    try:
        return pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - e.g. a lambda given as a reward
        _warn_thread_route(f"the rollout spec cannot be pickled ({type(e).__name__}: {e})")
        return None


def _warn_thread_route(reason: str, fix: str = "") -> None:
    log.warning(
        "rollout.async_worker=process: %s; the rollout side runs in a thread of this process "
        "instead (slower: it shares the trainer's GIL). %s",
        reason,
        fix
        or "Reward functions given to groupflow.Run keep it in a process of its own when "
        "defined at the top level of an importable module.",
    )
