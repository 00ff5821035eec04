"""Calling reward functions with a time limit (``reward.timeout_s``), sync or async.

Design decision: a call the driver can stop waiting for must run somewhere else, and the only
place that works for arbitrary user code (closures, loaded models, open clients) is a thread of
this process: a subprocess would need the function and its state to be picklable and would pay
an interpreter start per call. So every call runs in a daemon thread and the driver waits on it
until the deadline. An ``async`` reward runs in that thread's own event loop; at the deadline its
pending coroutines are *cancelled* (a cooperative stop: nothing keeps running). A sync call cannot
be stopped — Python has no way to kill a thread — so at the deadline it is *abandoned*: it keeps
running in the background until it returns, its result is dropped, and it is counted; once
:data:`MAX_ABANDONED` abandoned calls are alive at the same time the run stops with a
:class:`~groupflow.rewards.base.RewardError`, because each one may hold a CPU core or memory.
Daemon threads never keep the process from exiting.

Granularity (what "the sample times out" means): a reward is first called on the whole batch;
if that call does not finish in ``timeout_s`` (or raises), its samples are retried one by one —
async ones concurrently, sync ones in order — and the retries share one more ``timeout_s``. A
sample with no value by then has timed out. So one reward never holds a step longer than
2 × ``timeout_s``; an async reward isolates a hanging sample exactly, while a sync one that
hangs on sample i also times out the samples after i in that retry (their turn never comes).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from groupflow.utils.daemon_calls import Abandoned, start_daemon

__all__ = ["MAX_ABANDONED", "TIMED_OUT", "CallGuard"]

# Sync calls that timed out and are still running, over all rewards of a runner.
MAX_ABANDONED = 4
# Time an async call gets to unwind after its cancellation before its thread is abandoned too.
_CANCEL_GRACE_S = 1.0


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


# The result of a call, or of one sample, that did not finish before its deadline.
TIMED_OUT = _Marker("TIMED_OUT")
_UNSET = _Marker("UNSET")  # a per-sample slot whose call has not returned


async def _bounded_all(awaitables: Sequence[Any], timeout: float | None) -> list[Any]:
    """Await all concurrently until ``timeout``; each slot is a value, an exception or TIMED_OUT."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    done, pending = await asyncio.wait(
        tasks, timeout=None if timeout is None else max(timeout, 0.0)
    )
    for task in pending:
        task.cancel()
    if pending:  # let cancelled coroutines run their cleanup (finally blocks, closing clients)
        await asyncio.wait(pending, timeout=_CANCEL_GRACE_S)
    out: list[Any] = []
    for task in tasks:
        if task not in done:
            out.append(TIMED_OUT)
        elif task.exception() is not None:
            out.append(task.exception())
        else:
            out.append(task.result())
    return out


def _resolve_all(
    started: list[Any], deadline: float | None, awaiting: threading.Event | None = None
) -> list[Any]:
    """Await the awaitables among ``started`` (in this thread's own loop) until ``deadline``;
    ``awaiting`` is set first, telling the waiting thread that cancellation will follow."""
    pending = [i for i, r in enumerate(started) if inspect.isawaitable(r)]
    if not pending:
        return started
    if awaiting is not None:
        awaiting.set()
    timeout = None if deadline is None else deadline - time.monotonic()
    results = asyncio.run(_bounded_all([started[i] for i in pending], timeout))
    out = list(started)
    for i, value in zip(pending, results):
        if isinstance(value, BaseException) and not isinstance(value, Exception):
            raise value  # interrupts are not per-sample failures
        out[i] = value
    return out


class CallGuard:
    """Runs reward calls with a deadline and keeps count of abandoned (still running) calls.

    ``timeout_s=None`` calls in the caller's thread with no limit (for rewards that need the
    main thread, e.g. ones using ``signal.alarm``).
    """

    def __init__(self, timeout_s: float | None) -> None:
        if timeout_s is not None and (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0
        ):
            raise ValueError(f"timeout_s must be a positive number or None, got {timeout_s!r}")
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self._abandoned = Abandoned()

    def abandoned(self) -> list[str]:
        """Names of the rewards whose timed-out sync calls are still running."""
        return self._abandoned.alive()

    def _run(
        self,
        name: str,
        work: Callable[[float | None, threading.Event], Any],
        partial: list[Any] | None,
    ) -> Any:
        """``work(deadline, awaiting)`` in a daemon thread; its value, its exception, or TIMED_OUT.

        ``partial``: a list the work fills slot by slot; at the deadline its filled slots are
        kept (a copy) and the rest become TIMED_OUT.
        """
        awaiting = threading.Event()
        if self.timeout_s is None:
            try:
                return work(None, awaiting)
            except Exception as exc:  # returned like the threaded path returns it
                return exc
        deadline = time.monotonic() + self.timeout_s
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = work(deadline, awaiting)
            except BaseException as exc:  # handed to the waiting thread
                box["error"] = exc

        thread = start_daemon(f"groupflow-reward-{name}", target)
        thread.join(self.timeout_s)
        if thread.is_alive() and awaiting.is_set():
            # An async call cancels itself at the deadline; give it a moment to unwind.
            thread.join(_CANCEL_GRACE_S)
        if thread.is_alive():
            self._abandoned.add(name, thread)
            if partial is None:
                return TIMED_OUT
            return list(partial)
        if "error" in box:
            if not isinstance(box["error"], Exception):
                raise box["error"]
            return box["error"]
        return box["value"]

    def batched(self, name: str, start: Callable[[], Any]) -> Any:
        """One call on the whole batch: its result, the exception it raised, or TIMED_OUT."""

        def work(deadline: float | None, awaiting: threading.Event) -> Any:
            result = start()
            if inspect.isawaitable(result):
                (result,) = _resolve_all([result], deadline, awaiting)
                if isinstance(result, Exception):
                    raise result
            return result

        return self._run(name, work, None)

    def per_sample(self, name: str, starts: Sequence[Callable[[], Any]]) -> list[Any]:
        """One call per sample: each slot a result, an exception or TIMED_OUT.

        Sync calls run in order; awaitables they return are awaited together afterwards.
        """
        slots: list[Any] = [_UNSET] * len(starts)

        def work(deadline: float | None, awaiting: threading.Event) -> list[Any]:
            for i, start in enumerate(starts):
                if deadline is not None and time.monotonic() >= deadline:
                    break  # abandoned: do not start more user calls after the deadline
                try:
                    slots[i] = start()
                except Exception as exc:  # recorded as this sample's failure
                    slots[i] = exc
            started = [s for s in slots if s is not _UNSET]
            done = _resolve_all(started, deadline, awaiting)
            return done + [TIMED_OUT] * (len(slots) - len(done))

        result = self._run(name, work, slots)
        if isinstance(result, Exception):  # the retry loop itself failed (e.g. asyncio refused)
            raise result
        return [TIMED_OUT if v is _UNSET or inspect.isawaitable(v) else v for v in result]
