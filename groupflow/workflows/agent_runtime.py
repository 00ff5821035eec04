"""What agent episodes run on: the run's in-process server and one event loop in a thread.

Design decision: the agent workflow (``workflows.agent``) decides *what* an episode is and when
it failed; this module only provides the two long-lived things its episodes share, and knows
nothing of rewards or samples. ``AgentServer`` is ``groupflow.serve``'s app over the policy's
rollout group, with an episode recorder, in a uvicorn thread on 127.0.0.1 (a free port).
``AgentLoop`` is one event loop for every episode of the run, in a daemon thread: agent
libraries keep loop-bound objects between calls, so the loop must outlive a step; it carries a
heartbeat and knows which episode's task runs (``CURRENT_EPISODE``), so the workflow can watch,
from its own thread, for an agent whose sync code blocks it. Every episode's
``openai.AsyncOpenAI`` shares one HTTP client (``shared_http_client``), made on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import sys
import sysconfig
import threading
import time
import weakref
from dataclasses import replace
from typing import Any

from groupflow.config import Config
from groupflow.serve.app import build_app
from groupflow.serve.build import server_core
from groupflow.serve.recording import EpisodeRecorder
from groupflow.serve.thread import ServerThread

log = logging.getLogger("groupflow")

__all__ = ["AgentServer", "AgentLoop", "shared_http_client", "require_openai", "CURRENT_EPISODE"]

# The episode whose task runs (set by the workflow in each episode's task; a task copies its
# creator's context, so an agent's helper tasks carry it too), read by AgentLoop.running_episode.
CURRENT_EPISODE: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "groupflow_episode", default=None
)


# Where Python's own and installed code lives: a blocked loop is reported at the first frame
# outside these (the agent's line), not inside threading.py or an HTTP library.
_LIBRARY_PATHS = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def _frame_text(frame) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def require_openai():
    try:
        import openai
    except ImportError:
        raise ImportError(
            "rollout.workflow=agent needs the openai package: pip install 'groupflow[serve]'"
        ) from None
    return openai


class AgentServer:
    """The run's in-process server over the policy's rollout group, with an episode recorder."""

    def __init__(self, cfg: Config, policy):
        self.rollout = policy.rollout  # the group this server's engine calls go to
        self.recorder = EpisodeRecorder()
        core = server_core(
            cfg, policy.tokenizer, policy.rollout,
            replace(policy.sampling, n=1), self.recorder,
        )  # fmt: skip
        self.core = core
        core.batcher.expected = self.recorder.open_count  # each open episode will call
        self.thread = ServerThread(build_app(core), "127.0.0.1", 0).start()
        self.url = self.thread.url

    def close(self) -> None:
        self.thread.stop()
        self.core.close()


def shared_http_client(timeout_s: float):
    """The HTTP client every episode's ``openai.AsyncOpenAI`` shares: the ``openai`` package's
    aiohttp transport where aiohttp is installed — its C HTTP parser costs ≈0.3 ms less CPU per
    call than httpx's, CPU the agents take from decoding (``benchmarks/bench_serve.py``) —
    else its default httpx one. Made on the event loop that will use it."""
    openai = require_openai()
    try:
        return openai.DefaultAioHttpClient(timeout=timeout_s)
    except (AttributeError, RuntimeError):  # an older openai, or aiohttp missing
        return openai.DefaultAsyncHttpxClient(timeout=timeout_s)


class AgentLoop:
    """One event loop for every episode of the run, in a thread of its own: agent libraries keep
    loop-bound objects between calls (langchain-openai caches its async HTTP client), so a fresh
    loop per step (``asyncio.run``) would break them from the second step on."""

    def __init__(self, beat_s: float = 0.25):
        self._loop = asyncio.new_event_loop()
        # Who runs now, readable from another thread: every task's context (a task copies its
        # creator's, so an agent's helper tasks carry the episode of the agent that made them).
        self._contexts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        if sys.version_info >= (3, 11):  # Task(context=...); before, a culprit goes unnamed
            self._loop.set_task_factory(self._task)
        self.beat_s = beat_s
        self.last_beat = time.monotonic()  # the loop's heartbeat: stale while code blocks it
        self.abandoned = False
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name="groupflow-agents")  # fmt: skip
        self._thread.start()
        self._loop.call_soon_threadsafe(self._beat)
        self.http = None  # one connection pool for every episode's client (made on the loop)

    def _task(self, loop, coro, context=None, **kwargs):
        context = context if context is not None else contextvars.copy_context()
        task = asyncio.Task(coro, loop=loop, context=context, **kwargs)
        self._contexts[task] = context
        return task

    def _beat(self) -> None:
        self.last_beat = time.monotonic()
        self._loop.call_later(self.beat_s, self._beat)

    def blocked_s(self) -> float:
        """Seconds since the loop last ran its heartbeat (≈0 unless code blocks it)."""
        return time.monotonic() - self.last_beat

    def running_episode(self) -> Any:
        """The episode whose code runs on the loop now (from another thread), or None."""
        task = asyncio.current_task(self._loop)
        context = self._contexts.get(task) if task is not None else None
        return context.get(CURRENT_EPISODE) if context is not None else None

    def where(self) -> str:
        """Where the loop's thread is now: the innermost frame of code outside Python's standard
        library and installed packages (the agent's own line), and the innermost frame."""
        ident = self._thread.ident
        frame = sys._current_frames().get(ident) if ident is not None else None
        if frame is None:
            return "?"
        innermost, own = _frame_text(frame), None
        while frame is not None and own is None:
            if not frame.f_code.co_filename.startswith(_LIBRARY_PATHS):
                own = _frame_text(frame)
            frame = frame.f_back
        return innermost if own in (None, innermost) else f"{own} (blocked in {innermost})"

    def alive(self) -> bool:
        return self._thread.is_alive()

    def abandon(self) -> None:
        """Give the loop up (an agent blocks it): it stops and closes once the code lets go."""
        self.abandoned = True
        self._loop.call_soon_threadsafe(self._loop.stop)

    def _serve(self) -> None:
        """Run the loop until :meth:`close` stops it. asyncio lets a task's SystemExit or
        KeyboardInterrupt out of the loop itself (after storing it in the task, whose awaiter
        sees it): an agent's helper task raising one must not end every episode's loop."""
        while True:
            try:
                self._loop.run_forever()
                break
            except BaseException as exc:  # noqa: BLE001 - user code's, kept in its task
                log.debug("an agent task raised %r out of the event loop; the loop goes on", exc)
        if self.abandoned:  # nobody waits for its episodes: cancel them, then close
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            try:
                if tasks:
                    self._loop.run_until_complete(asyncio.wait(tasks, timeout=1.0))
                if self.http is not None:
                    self._loop.run_until_complete(asyncio.wait_for(self.http.aclose(), 1.0))
                self._loop.close()
            except BaseException as exc:  # noqa: BLE001 - an abandoned loop's last words
                log.debug("an abandoned agent loop did not close: %r", exc)

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro, timeout_s: float | None = None) -> Any:
        return self.submit(coro).result(timeout_s)

    def client(self, url: str, key: str, timeout_s: float):
        """An ``openai.AsyncOpenAI`` for one episode. They share one HTTP client: building an
        HTTP client per episode (its TLS context) cost more than the episode's calls."""
        openai = require_openai()
        if self.http is None:
            self.http = shared_http_client(timeout_s)
        return openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=timeout_s,
                                  http_client=self.http)  # fmt: skip

    def close(self, timeout_s: float = 10.0) -> None:
        """Bounded: an agent that blocks the loop (sync code in an ``async def``) must not hang
        the rollout side's shutdown; the thread is a daemon."""
        if self._loop.is_closed():  # closed before
            return
        http, self.http = self.http, None
        try:
            if http is not None:
                self.run(http.aclose(), timeout_s)
        except Exception as e:  # noqa: BLE001 - closing: a stuck or broken pool is let go
            log.debug("agent HTTP client not closed: %r", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():  # a loop still running (a stuck agent) cannot be closed
            self._loop.close()
