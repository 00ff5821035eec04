"""Asynchronous rollout: the batches of later steps are generated while the trainer updates.

Design decision (verl's one-step-off policy generalised to k steps; AReaL's staleness bound):
with ``rollout.max_staleness: k`` the batch trained at step s is *always* generated with the
weights of version max(0, s − k) — never "whatever is newest" — so a run is reproducible, and a
resume can regenerate the batches that were in flight from the weight snapshots the checkpoint
keeps. One background thread consumes jobs in step order; a job first loads its weight snapshot
into the rollout worker (a separate model: a child process with one torch thread by default, so
decoding and training really run on two cores), then calls the trainer's ``collect`` (rollout,
rewards, dynamic-sampling refills: all of them with the job's version, so refills count against
the bound). Loader draws happen only in that thread, in step order, so the prompts of step s are
the same as in a synchronous run. Every wait has a timeout, and a failure in the thread (a dead
rollout process, a weight push that does not return) is raised in the trainer naming the role.

``rollout.async_mode: eager`` trades that reproducibility for freshness: a job takes the newest
snapshot at the moment the thread *starts* it (at submission the newest version is the scheduled
one, so only a start that lags behind — generation slower than training, k >= 2 — can see a newer
one). The version it takes is at least the scheduled one, so the bound still holds, and the batch
records the version it really came from.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AsyncRollout", "ThreadRoute", "schedule_version", "RolloutTimeoutError"]

_route = threading.local()  # .background: this thread is the rollout thread


def schedule_version(step: int, max_staleness: int) -> int:
    """The policy version whose weights generate the batch of ``step`` (deterministic schedule)."""
    return max(0, step - max_staleness)


class RolloutTimeoutError(RuntimeError):
    """The rollout role did not deliver a batch (or accept weights) within its timeout."""


class ThreadRoute:
    """``policy.rollout`` as each thread sees it: the background rollout thread generates with the
    snapshot worker (stale weights, by design); every other thread — validation, ``groupflow
    generate`` — with the actor (the current weights)."""

    def __init__(self, foreground, background):
        self.foreground, self.background = foreground, background

    def __getattr__(self, name: str) -> Any:
        target = self.background if getattr(_route, "background", False) else self.foreground
        return getattr(target, name)


@dataclass
class _Job:
    step: int
    version: int
    weights: dict | None  # None: the worker already holds this version
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    loader_state: dict | None = None  # the loader before this job drew (for checkpoints)
    result: tuple | None = None
    error: BaseException | None = None


class AsyncRollout:
    """Jobs ``submit(step, version, weights)`` run in order in one background thread.

    ``collect(step, version)`` → (batch, metrics) is the trainer's collect; ``push(weights)``
    loads a snapshot into the rollout worker; ``loader_state()`` captures the prompt loader;
    ``newest()`` → (version, weights), given in eager mode only, is the newest snapshot."""

    def __init__(self, collect: Callable[[int, int], tuple], push: Callable[[dict], None],
                 loader_state: Callable[[], dict], timeout_s: float, role: str = "rollout",
                 newest: Callable[[], tuple[int, dict]] | None = None):  # fmt: skip
        self._collect, self._push, self._loader_state = collect, push, loader_state
        self._newest = newest
        self.timeout_s, self.role = timeout_s, role
        self._jobs: dict[int, _Job] = {}
        self._pushing: int | None = None  # the version being loaded into the worker, if any
        self._held: int | None = None  # the version the worker holds
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="groupflow-rollout", daemon=True)
        self._thread.start()

    # ----- the trainer's side -------------------------------------------------------------------
    def submit(self, step: int, version: int, weights: dict | None) -> None:
        if step in self._jobs:
            raise RuntimeError(f"the batch of step {step} was already submitted")
        job = _Job(step, version, weights)
        self._jobs[step] = job
        self._queue.put(job)

    def in_flight(self) -> list[int]:
        return sorted(self._jobs)

    def result(self, step: int) -> tuple:
        """The (batch, metrics) of ``step``, waiting for it at most ``timeout_s``."""
        job = self._wait(step, "done", "deliver the batch of")
        del self._jobs[step]
        if job.error is not None:
            raise job.error
        return job.result

    def loader_state_before(self, step: int) -> dict:
        """The prompt loader as it was before ``step``'s batch drew from it (what a checkpoint
        saved before that step must restore)."""
        job = self._wait(step, "started", "start the batch of")
        return job.loader_state

    def drain(self) -> None:
        """Wait until every submitted job has finished (results stay to be collected)."""
        for step in list(self._jobs):
            self._wait(step, "done", "deliver the batch of")

    def close(self) -> None:
        """Stop the thread after the job it is running (abandoned jobs are not waited for)."""
        for job in self._jobs.values():
            job.weights = None
        self._jobs.clear()
        self._queue.put(None)
        self._thread.join(timeout=self.timeout_s)

    def _wait(self, step: int, event: str, what: str) -> _Job:
        job = self._jobs.get(step)
        if job is None:
            raise RuntimeError(f"no rollout job for step {step} (in flight: {self.in_flight()})")
        if not getattr(job, event).wait(self.timeout_s):
            pushing = self._pushing
            if pushing is not None:
                what = f"load the weights of policy version {pushing} (weight sync) before"
            raise RolloutTimeoutError(
                f"the {self.role} role did not {what} step {step} (policy version {job.version}) "
                f"within {self.timeout_s:g} s (run.worker_timeout_s); it is hung or far too slow"
            )
        return job

    # ----- the background thread ----------------------------------------------------------------
    def _run(self) -> None:
        _route.background = True
        failed: BaseException | None = None
        while (job := self._queue.get()) is not None:
            try:
                if failed is not None:  # a later job must not run on a broken worker
                    raise failed
                if self._newest is not None:  # eager: fresher weights, if there are any
                    version, weights = self._newest()
                    if version > job.version:
                        job.version, job.weights = version, weights
                if job.weights is not None and job.version != self._held:
                    self._pushing = job.version
                    self._push(job.weights)
                    self._pushing = None
                    self._held = job.version
                job.weights = None  # the snapshot now lives in the worker
                job.loader_state = self._loader_state()
                job.started.set()
                job.result = self._collect(job.step, job.version)
            except BaseException as e:  # noqa: BLE001 - re-raised in the trainer's thread
                if failed is None:
                    e.add_note(
                        f"(in the {self.role} role's background thread, batch of step "
                        f"{job.step}, policy version {job.version})"
                    )
                    failed = e
                job.error = failed
            finally:
                job.started.set()
                job.done.set()
