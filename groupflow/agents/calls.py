"""Calling user code (tools, environments) from a rollout: sync or async, always with a timeout.

Design decision: a multi-turn rollout calls code it does not control, once per sample and turn.
Every such call goes through :func:`call_with_timeout`, which awaits coroutine functions on the
event loop and runs plain functions each in a daemon thread of its own
(``groupflow.utils.daemon_calls``, as rewards do), and gives up after ``timeout_s``. A coroutine
is cancelled; a thread cannot be killed in Python, so a stuck sync call is *abandoned*: its thread
finishes on its own or never, never keeps the process from exiting, and is counted. Once
:data:`MAX_ABANDONED` abandoned calls are alive at the same time, the next call raises
:class:`StuckCallsError` naming them, which stops the run (code that can hang for real, like the
code sandbox, runs in a subprocess it kills itself).

Whatever user code raises comes back as an ordinary ``Exception``: ``SystemExit`` (an argparse
wrapper's ``sys.exit(2)``), ``KeyboardInterrupt``, a ``CancelledError`` it made up — all become a
:class:`UserCodeExit`, so a caller's ``except Exception`` turns them into that sample's failure.
Only the user's real Ctrl-C stops the run: a signal reaches the main thread, never a call's
thread, and :func:`run_async` notes it before a coroutine on the main thread could mistake it for
the tool's own. Nothing else here catches exceptions: the callers decide what a failure means (an
error observation for a tool, an ended episode for an environment) and count it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import logging
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from groupflow.utils.daemon_calls import Abandoned, start_daemon

log = logging.getLogger("groupflow")

__all__ = [
    "MAX_ABANDONED",
    "CallTimeout",
    "StuckCallsError",
    "UserCodeExit",
    "call_with_timeout",
    "error_text",
    "guarded",
    "run_async",
    "is_async_callable",
]

# Timed-out sync calls of tools and environments still running, over the whole process. Many
# more than rewards' 4: a step runs one call per sample at once, and a slow (not hung) call
# returns soon after its deadline; well below what a machine's threads and memory allow.
MAX_ABANDONED = 32

_abandoned = Abandoned()
_warned: set[str] = set()
_sigint = threading.Event()  # a real Ctrl-C reached the main thread during run_async


class CallTimeout(TimeoutError):
    """A tool or environment call did not return within its ``timeout_s``."""


class StuckCallsError(ValueError):
    """Too many timed-out sync calls of tools or environments are still running: the run stops.

    A ValueError like the other errors a user fixes in their own code (shown without a
    traceback by the CLI); never a per-sample failure.
    """


class UserCodeExit(Exception):
    """User code raised a ``BaseException`` that is not an ``Exception`` (``SystemExit``,
    ``KeyboardInterrupt``, ...); ``original`` is it, and the message reads ``Type: message``."""

    def __init__(self, original: BaseException):
        self.original = original
        super().__init__(error_text(original))


def error_text(exc: BaseException) -> str:
    """``Type: message`` of what user code raised (the original type for a UserCodeExit)."""
    if isinstance(exc, UserCodeExit):
        return str(exc)
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def is_async_callable(fn: Callable[..., Any]) -> bool:
    target = fn.func if isinstance(fn, functools.partial) else fn
    # an object whose __call__ is a coroutine function (e.g. a bound async method's owner)
    call = None if inspect.isroutine(target) else type(target).__dict__.get("__call__")
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(call)


def abandoned_calls() -> list[str]:
    """Names of the timed-out sync calls whose threads are still running."""
    return _abandoned.alive()


def _check_abandoned() -> None:
    stuck = _abandoned.alive()
    if len(stuck) >= MAX_ABANDONED:
        raise StuckCallsError(
            f"{len(stuck)} timed-out calls are still running in background threads: "
            f"{Abandoned.summary(stuck)}. A sync tool or environment cannot be stopped once "
            "started, so the run stops before they pile up. Fix the function (or make it "
            "`async def`: an async call is cancelled at its deadline), or raise "
            "rollout.tool_timeout_s (or the tool's timeout_s) / rollout.env_timeout_s if it is "
            "only slow"
        )


def _abandon(name: str, thread: threading.Thread, timeout_s: float | None) -> None:
    """``thread`` ran past its deadline: tracked until it returns; warned once per name."""
    _abandoned.add(name, thread)
    if name not in _warned and thread.is_alive():
        _warned.add(name)
        log.warning(
            "%s did not return within %s s and keeps running in a background thread (a sync "
            "call cannot be stopped; its result is dropped); the run stops once %d such calls "
            "are alive at once",
            name, "?" if timeout_s is None else f"{timeout_s:g}", MAX_ABANDONED,
        )  # fmt: skip


def _contain(exc: BaseException) -> Exception:
    return exc if isinstance(exc, Exception) else UserCodeExit(exc)


async def _guarded(awaitable: Any) -> Any:
    """Await user code; a BaseException it raises itself comes back as an Exception."""
    try:
        return await awaitable
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)  # Python >= 3.11
        if cancelling is None or cancelling():  # our deadline, or the run stopping
            raise
        raise UserCodeExit(exc) from exc  # the code raised it without being cancelled
    except KeyboardInterrupt as exc:
        if _sigint.is_set():  # the user's Ctrl-C, landing in this coroutine's frame
            raise
        raise UserCodeExit(exc) from exc
    except Exception:
        raise
    except BaseException as exc:  # SystemExit, GeneratorExit, ...
        raise UserCodeExit(exc) from exc


guarded = _guarded  # for callers that await user code themselves (the agent workflow)


def _in_thread(name: str, call: Callable[[], Any]) -> tuple[asyncio.Future, threading.Thread]:
    """``call()`` in a daemon thread; the future gets its result or its (contained) error."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():  # a call given up on (timed out, cancelled) stays unanswered
            future.set_result(value) if ok else future.set_exception(value)

    def target() -> None:
        try:
            ok, value = True, call()
        except BaseException as exc:  # noqa: BLE001 - a signal never lands in this thread
            ok, value = False, _contain(exc)
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop is closed: nobody waits for this call any more
            pass

    return future, start_daemon(f"groupflow-call {name}", target)


async def call_with_timeout(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    timeout_s: float | None,
    name: str | None = None,
) -> Any:
    """``fn(*args, **kwargs)``, awaited if it is (or returns) a coroutine; :class:`CallTimeout`
    after ``timeout_s`` seconds (None: no limit). ``name`` (e.g. ``tool 'calc'``) names the call
    in the warning and the error about abandoned calls. Raises :class:`StuckCallsError` instead
    of calling when :data:`MAX_ABANDONED` abandoned calls are still running."""
    _check_abandoned()
    label: str = name or getattr(fn, "__qualname__", None) or type(fn).__qualname__
    kwargs = dict(kwargs or {})
    thread = None
    if is_async_callable(fn):
        try:
            work = _guarded(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - raised while creating the coroutine
            raise _contain(exc) from None
    else:
        work, thread = _in_thread(label, functools.partial(fn, *args, **kwargs))
    try:
        result = await asyncio.wait_for(work, timeout_s)
        if inspect.isawaitable(result):  # a sync function that returned a coroutine
            result = await asyncio.wait_for(_guarded(result), timeout_s)
        return result
    except asyncio.TimeoutError:
        if thread is not None:
            _abandon(label, thread, timeout_s)
        raise CallTimeout(f"no result after {timeout_s:g} s") from None
    except BaseException:  # the run is stopping (Ctrl-C, a failed gather): no more waiting
        if thread is not None:
            _abandoned.add(label, thread)
        raise


@contextlib.contextmanager
def _noting_sigint() -> Iterator[None]:
    """While the main thread runs a loop: a Ctrl-C is noted (for :func:`_guarded`), then raised
    as usual. Elsewhere (another thread, a handler of the user's own): nothing changes."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    _sigint.clear()

    def note(signum, frame):
        _sigint.set()
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def run_async(coro: Any) -> Any:
    """Run a coroutine to completion from synchronous code, also when an event loop is already
    running in this thread (a notebook): then it runs on a fresh loop in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        with _noting_sigint():
            return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
