"""A worker in a child process of its own: the ``process`` backend of a worker group.

Design decision: the asynchronous rollout's honest speed-up on a small machine needs generation
and training to run *at the same time* on different cores; threads in one process share the GIL
(a small model's decode loop is mostly Python), so the rollout worker lives in a spawned child
process with one torch thread while the trainer keeps its own. The protocol is a pipe carrying
``(method, args, kwargs)`` one way and ``(ok, value)`` back — the ``_Host`` contract the Ray
backend uses — and every call waits at most ``timeout_s``: a hung child is killed and reported, a
dead one is reported as dead, always as a ``WorkerError`` naming the worker, its role and the
method. Tensors cross the pipe through torch's shared-memory pickling (no copy of the payload).

``ProcessHost`` itself only spawns a child running ``target(conn, *args)``, waits for its
``(ok, value)`` start-up answer and watches it (``wait``: the next message or a clear death);
the asynchronous rollout's child (``groupflow.rollout.side``) speaks its own protocol over it.
The start is under the start-up timeout too: spawn writes what the child needs into a pipe the
child reads only after importing the parent's ``__main__`` script again, so a big payload there
blocks the parent for as long as that import runs (forever, for a script that starts a run at
its top level). The child therefore gets only the pipe at spawn, says when it is up, and then
receives ``target`` and ``args`` through the pipe, while the parent polls with a deadline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

from groupflow.utils.main_guard import mark_worker_child

__all__ = ["ProcessHost", "ChildStartError", "serve_worker"]


def _serve(conn, host_cls, factory, rank: int, world_size: int, env: dict[str, str],
           kwargs: dict) -> None:  # fmt: skip
    """The child's loop: build the worker (in ``host_cls``, the group's ``_Host``), then answer
    calls until the pipe closes."""
    os.environ.update(env)
    try:
        host = host_cls(factory, rank, world_size, env, kwargs)
        conn.send((True, None))
    except BaseException:  # noqa: BLE001 - the parent reports it with the traceback
        import traceback

        conn.send((False, traceback.format_exc()))
        return
    while True:
        try:
            method, args, kw = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(host.call(method, args, kw))


def _bootstrap(conn) -> None:
    """The child's entry: say it is up (the spawn's import of ``__main__`` is done), then run the
    ``target(conn, *args)`` the parent sends."""
    mark_worker_child()
    conn.send("up")
    try:
        target, args = conn.recv()
    except (EOFError, OSError):  # the parent gave up on us
        return
    target(conn, *args)


_NOT_GUARDED = (
    "a script that starts a run must do so under `if __name__ == '__main__':` — the child "
    "process imports it again"
)


class ChildStartError(ChildProcessError):
    """The child's target answered ``(False, value)`` at start-up (``value``: its traceback)."""

    def __init__(self, value: Any):
        self.value = value
        super().__init__(f"its constructor raised; traceback:\n{value}")


def serve_worker(host_cls: type, factory: Callable[..., Any], rank: int, world_size: int,
                 env: dict[str, str], kwargs: dict) -> tuple[Callable, tuple]:  # fmt: skip
    """``(target, args)`` of a worker group's child: a ``_Host`` answering method calls."""
    return _serve, (host_cls, factory, rank, world_size, env, kwargs)


class ProcessHost:
    """A spawned child process running ``target(conn, *args)``, which answers ``(ok, value)`` once
    started. ``call`` (worker groups) returns ``(ok, value)`` like ``_Host.call`` or raises
    ``TimeoutError`` / ``ChildProcessError`` (the group turns them into WorkerErrors)."""

    kind = "process"

    def __init__(self, target: Callable[..., Any], args: tuple, startup_timeout_s: float):
        import torch.multiprocessing  # noqa: F401 - registers the shared-memory tensor pickling

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_bootstrap, args=(child,), daemon=True)
        self.process.start()  # a small payload: returns at once whatever the child does
        child.close()
        deadline = time.monotonic() + startup_timeout_s
        try:
            if self._receive(startup_timeout_s) != "up":
                raise ChildProcessError(self._death("answered out of protocol"))
        except TimeoutError as e:  # the child is still importing the __main__ script
            raise TimeoutError(f"{e} while starting ({_NOT_GUARDED})") from None
        except ChildProcessError as e:  # the usual cause: that import started a run and failed
            raise ChildProcessError(f"{e} while starting ({_NOT_GUARDED})") from None
        try:
            self._conn.send((target, args))
        except (BrokenPipeError, OSError) as e:
            raise ChildProcessError(self._death(f"could not be reached ({e})")) from None
        ok, value = self._receive(max(0.0, deadline - time.monotonic()))
        if not ok:
            self.close()
            raise ChildStartError(value)

    def call(self, method: str, args: tuple, kwargs: dict, timeout_s: float) -> tuple[bool, Any]:
        try:
            self._conn.send((method, args, kwargs))
        except (BrokenPipeError, OSError) as e:
            raise ChildProcessError(self._death(f"could not be reached ({e})")) from None
        return self._receive(timeout_s)

    @property
    def conn(self):
        """The parent's end of the pipe (for a target with a protocol of its own)."""
        return self._conn

    def wait(self, timeout_s: float) -> None:
        """Return once a message can be read; a dead child raises ``ChildProcessError``, no
        message within ``timeout_s`` kills it and raises ``TimeoutError``."""
        # poll in short slices so that a child that dies is reported at once, not at the timeout
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(min(0.2, max(0.0, deadline - time.monotonic()))):
            if not self.process.is_alive():
                raise ChildProcessError(self._death("died"))
            if time.monotonic() >= deadline:
                self.close()  # its state is unknown: a later call must not read a stale answer
                raise TimeoutError(f"no answer within {timeout_s:g} s (timeout); process killed")

    def _receive(self, timeout_s: float) -> tuple[bool, Any]:
        self.wait(timeout_s)
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise ChildProcessError(self._death("died")) from None

    def describe(self, what: str) -> str:
        """The child ``what`` (e.g. "died"), with its pid and exit code, for an error message."""
        return self._death(what)

    def _death(self, what: str) -> str:
        self.process.join(timeout=1.0)
        return (
            f"the worker process (pid {self.process.pid}) {what}, exit code {self.process.exitcode}"
        )

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5.0)
