"""Sync user code in daemon threads, and the calls abandoned at their deadline.

Design decision: Python cannot stop a thread, so a sync call of user code (a reward, a tool, an
environment step) that passes its deadline is *abandoned*: it runs on in its own daemon thread,
its result is dropped, and it is tracked here until it returns. A daemon thread never keeps the
process from exiting (the threads of a ``concurrent.futures`` pool are joined at exit, and a
pool shared by all calls runs out of threads once enough of them hang). Each abandoned call may
still hold a core, memory or a connection, so its owner stops the run with an error naming the
functions once too many are alive at the same time (``groupflow.rewards.calls.MAX_ABANDONED``,
``groupflow.agents.calls.MAX_ABANDONED``).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

__all__ = ["Abandoned", "start_daemon"]


def start_daemon(name: str, target: Callable[[], None]) -> threading.Thread:
    """``target()`` in a new, started daemon thread called ``name``."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


class Abandoned:
    """The abandoned calls whose threads are still running, by name (thread-safe)."""

    def __init__(self) -> None:
        self._calls: list[tuple[str, threading.Thread]] = []
        self._lock = threading.Lock()

    def add(self, name: str, thread: threading.Thread) -> None:
        if thread.is_alive():
            with self._lock:
                self._calls.append((name, thread))

    def alive(self) -> list[str]:
        """The names of the abandoned calls still running (one entry per call)."""
        with self._lock:
            self._calls = [(n, t) for n, t in self._calls if t.is_alive()]
            return [n for n, _ in self._calls]

    @staticmethod
    def summary(names: list[str]) -> str:
        """``"tool 'calc' (3), Env.step (1)"``: each name with its count, most first."""
        return ", ".join(f"{n} ({k})" for n, k in Counter(names).most_common())
