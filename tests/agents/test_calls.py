"""Calling tools and environments: a hung sync call is abandoned in a daemon thread and counted,
too many of them stop the run naming them, whatever user code raises becomes an ordinary error,
a real Ctrl-C still stops, and the process always exits.

In-process "hangs" wait on an Event the test sets at its end, so no thread outlives its test;
what could hang for real (process exit, a signal) runs in a subprocess with a hard timeout.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from groupflow.agents import calls
from groupflow.agents.calls import (
    CallTimeout,
    StuckCallsError,
    UserCodeExit,
    call_with_timeout,
    error_text,
    run_async,
)
from groupflow.utils.daemon_calls import Abandoned

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def release(monkeypatch):
    """An Event every hanging call waits on; set when the test ends (and its threads gone). The
    abandoned calls counted are this test's own."""
    monkeypatch.setattr(calls, "_abandoned", Abandoned())
    event = threading.Event()
    yield event
    event.set()
    deadline = time.monotonic() + 5
    while calls.abandoned_calls() and time.monotonic() < deadline:
        time.sleep(0.01)


def _call(fn, timeout_s=1.0, name=None, **kwargs):
    return run_async(call_with_timeout(fn, kwargs=kwargs, timeout_s=timeout_s, name=name))


def test_a_hung_sync_call_times_out_in_a_daemon_thread_and_is_counted_until_it_returns(release):
    threads = []

    def hang(x):
        threads.append(threading.current_thread())
        release.wait(30)
        return x

    start = time.monotonic()
    with pytest.raises(CallTimeout, match="no result after 0.05 s"):
        _call(hang, 0.05, name="tool 'calc'", x=1)
    assert time.monotonic() - start < 2
    assert threads[0].daemon and threads[0] is not threading.main_thread()
    assert calls.abandoned_calls() == ["tool 'calc'"]
    release.set()
    threads[0].join(5)
    assert calls.abandoned_calls() == []  # returned: no longer counted
    assert _call(lambda: "fine") == "fine"


def test_too_many_abandoned_calls_stop_the_run_naming_the_functions(release, monkeypatch):
    monkeypatch.setattr(calls, "MAX_ABANDONED", 3)

    def hang():
        release.wait(30)

    for name in ("tool 'calc'", "tool 'calc'", "Env.step"):
        with pytest.raises(CallTimeout):
            _call(hang, 0.02, name=name)
    started = []
    with pytest.raises(StuckCallsError, match=r"3 timed-out calls .*tool 'calc' \(2\), Env.step \(1\)"):  # fmt: skip
        _call(lambda: started.append(1))
    assert started == []  # the next call is not even started
    release.set()  # once they return, calls run again
    deadline = time.monotonic() + 5
    while calls.abandoned_calls() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _call(lambda: "again") == "again"


def _exit(code):
    sys.exit(code)


def _interrupt():
    raise KeyboardInterrupt


async def _async_exit():
    sys.exit(3)


async def _async_interrupt():
    raise KeyboardInterrupt("pressed by the tool")


async def _async_cancelled():
    raise asyncio.CancelledError  # made up by user code: nobody cancelled it


class _AsyncCallable:
    async def __call__(self):
        raise GeneratorExit


@pytest.mark.parametrize(
    "fn, text",
    [(lambda: _exit(2), "SystemExit: 2"), (_interrupt, "KeyboardInterrupt"),
     (_async_exit, "SystemExit: 3"), (_async_interrupt, "KeyboardInterrupt: pressed by the tool"),
     (_async_cancelled, "CancelledError"), (_AsyncCallable(), "GeneratorExit")],
)  # fmt: skip
def test_whatever_user_code_raises_comes_back_as_an_ordinary_error(fn, text):
    with pytest.raises(UserCodeExit) as info:
        _call(fn)
    assert isinstance(info.value, Exception) and error_text(info.value) == text
    # an ordinary exception is left as it is
    with pytest.raises(ZeroDivisionError):
        _call(lambda: 1 / 0)


def _python(script: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


def test_the_process_exits_while_a_timed_out_call_hangs_forever():
    out = _python(
        """
        import time
        from groupflow.agents.calls import CallTimeout, call_with_timeout, run_async

        def forever():
            time.sleep(3600)

        for _ in range(3):
            try:
                run_async(call_with_timeout(forever, timeout_s=0.05))
            except CallTimeout:
                pass
        print("finished")
        """,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "finished" in out.stdout


@pytest.mark.parametrize("kind", ["sync", "async_sleep", "async_busy"])
def test_a_real_ctrl_c_still_stops_the_calls(kind):
    # the signal lands in the selector (sync: the call is in a thread; async_sleep) or inside the
    # user coroutine's own frame (async_busy): either way the run stops with KeyboardInterrupt
    out = _python(
        f"""
        import asyncio, os, signal, sys, threading, time
        from groupflow.agents.calls import call_with_timeout, run_async

        def sync():
            time.sleep(3600)

        async def async_sleep():
            await asyncio.sleep(3600)

        async def async_busy():
            while True:
                sum(range(100))

        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            run_async(call_with_timeout({kind}, timeout_s=60))
        except KeyboardInterrupt:
            print("stopped")
            sys.exit(130)
        """,
        timeout=60,
    )
    assert out.returncode == 130 and "stopped" in out.stdout, out.stderr
