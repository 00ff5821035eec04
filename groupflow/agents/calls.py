"""Calling user code (tools, environments) from a rollout: sync or async, always with a timeout.

Design decision: a multi-turn rollout calls code it does not control, once per sample and turn.
Every such call goes through :func:`call_with_timeout`, which runs coroutine functions on the
event loop and plain functions on a thread pool, and gives up after ``timeout_s``. A coroutine is
cancelled; a thread cannot be killed in Python, so a stuck sync call is abandoned (its thread
finishes on its own, or never) and the rollout goes on — which is why code that can hang for
real (the code sandbox) runs in a subprocess it kills itself. Nothing here catches exceptions:
the callers decide what a failure means (an error observation for a tool, an ended episode for an
environment) and count it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["CallTimeout", "call_with_timeout", "run_async", "is_async_callable"]

# Sync tools and environment steps of all samples share one pool. Threads of calls that timed out
# stay busy until they return, so the pool is larger than the 2-core machines it usually runs on.
_POOL_SIZE = 32
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


class CallTimeout(TimeoutError):
    """A tool or environment call did not return within its ``timeout_s``."""


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                _POOL_SIZE, thread_name_prefix="groupflow-call"
            )
        return _pool


def is_async_callable(fn: Callable[..., Any]) -> bool:
    target = fn.func if isinstance(fn, functools.partial) else fn
    # an object whose __call__ is a coroutine function (e.g. a bound async method's owner)
    call = None if inspect.isroutine(target) else type(target).__dict__.get("__call__")
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(call)


async def call_with_timeout(
    fn: Callable[..., Any], *args: Any, timeout_s: float | None, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)``, awaited if it is (or returns) a coroutine; :class:`CallTimeout`
    after ``timeout_s`` seconds (None: no limit)."""
    if is_async_callable(fn):
        work = fn(*args, **kwargs)
    else:
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(_executor(), functools.partial(fn, *args, **kwargs))
    try:
        result = await asyncio.wait_for(work, timeout_s)
        if inspect.isawaitable(result):  # a sync function that returned a coroutine
            result = await asyncio.wait_for(result, timeout_s)
        return result
    except asyncio.TimeoutError:
        raise CallTimeout(f"no result after {timeout_s:g} s") from None


def run_async(coro: Any) -> Any:
    """Run a coroutine to completion from synchronous code, also when an event loop is already
    running in this thread (a notebook): then it runs on a fresh loop in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
