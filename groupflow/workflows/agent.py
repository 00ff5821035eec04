"""The agent workflow: your own agent code, trained through the run's OpenAI-compatible server.

Design decision: the agent is ordinary code — ``async def agent(client, row) -> float | dict`` —
that talks to an ``openai.AsyncOpenAI`` client; groupflow never sees inside it. The run starts
its server in-process (``groupflow.serve``, uvicorn in a thread, 127.0.0.1, a free port) over the
policy's rollout group, and gives every episode a client with an API key of its own, so the
server records each call — prompt ids, sampled ids, log-probs — under that episode
(``serve.recording``). After the agent returns, the episode's calls become training samples:

- one sample when each call's prompt extends the previous call's prompt + completion (the usual
  case: the agent sends the conversation back, and the server continues it on the ids it
  sampled; the tokens between completions — tool results, user turns — are masked out);
- otherwise one sample per call (step-wise, as PRIME-RL and SkyRL do), all sharing the
  episode's advantage: the credit stage computes advantages per episode (``episode_ids``), so a
  split episode counts once in its group. Counted in ``rollout/agent/split_episodes``.

Rewards (``rollout.agent_reward``): the agent's return value (a float, or a dict with ``reward``
and extra fields, logged as ``rollout/agent/<field>`` means), the configured reward functions on
the final conversation (they get ``completions`` = the last assistant text, ``messages`` = the
whole conversation, and the dataset's fields), or their sum. An episode whose agent raised,
passed ``rollout.agent_timeout_s``, made no call, made more than ``rollout.agent_max_calls``
calls (those beyond are refused: each call is a sample at worst) or returned no usable reward gets
``reward.failure_value`` — counted in ``rollout/agent/failures`` (per kind), logged once per
kind; the step goes on. Episodes run concurrently (``rollout.agent_concurrency``) on one event
loop while the server decodes their requests in shared batches. Server and episodes live where
the workflow's ``collect`` runs: synchronously on the driver (with a Ray rollout pool the server's
engine calls go to the pool's workers); asynchronously (``rollout.max_staleness >= 1``) on the
rollout side — the local child process, or with a Ray rollout pool the pool's loop actor on the
pool's node (``groupflow.rollout.ray_host``), so the agents' traffic never reaches the driver.

The run's sampling settings hold for every call (the training forward assumes them): a request's
own temperature/top-p is replaced and counted (``rollout/agent/sampling_overrides``). The warm
start (``sft.steps``) plays the rows' demonstrations through the agent itself: the server answers
the agent's k-th call with the k-th demonstrated turn, so what lies between the turns (tool
results, the template's turns) is real. All episodes of the run share one event loop in a thread
of their own (``AgentLoop``) and one HTTP connection pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import json
import logging
import math
import statistics
import sys
import sysconfig
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from groupflow.agents.calls import error_text, guarded, is_async_callable
from groupflow.batch import Batch
from groupflow.builders import EncodedPrompts
from groupflow.config import Config
from groupflow.contracts import validate
from groupflow.data import PromptRow
from groupflow.envs import build_env_agent
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.serve.access import CallRecord
from groupflow.serve.app import build_app
from groupflow.serve.build import server_core
from groupflow.serve.recording import Chain, EpisodeRecorder, merge_calls
from groupflow.serve.thread import ServerThread
from groupflow.sft import warm_start
from groupflow.utils.daemon_calls import Abandoned
from groupflow.utils.imports import resolve_import_path
from groupflow.utils.seeds import step_seeds
from groupflow.workflows.episodes import Episode, episodes_batch
from groupflow.workflows.llm import (
    build_rewards,
    finite_metrics,
    llm_step_metrics,
    row_fields,
    sft_turns,
)

log = logging.getLogger("groupflow")

__all__ = [
    "AgentBlockedError",
    "AgentWorkflow",
    "AgentEpisode",
    "resolve_agent",
    "AgentServer",
    "AGENT_FIELDS",
    "shared_http_client",
]

_MAX_DEMOS = 1024  # rows whose demonstrations the warm start plays through the agent

# Why an episode failed (rollout/agent/failures/<kind>); "blocked": its sync code held the event
# loop past its rollout.agent_timeout_s.
FAILURE_KINDS = ("raised", "timeout", "blocked", "no_call", "invalid", "max_calls")
# Abandoned event loops (each blocked by an agent's sync code) still blocked at once: the run stops.
MAX_BLOCKED_LOOPS = 4
_EPISODE: contextvars.ContextVar[Any] = contextvars.ContextVar("groupflow_episode", default=None)


# Where Python's own and installed code lives: a blocked loop is reported at the first frame
# outside these (the agent's line), not inside threading.py or an HTTP library.
_LIBRARY_PATHS = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def _frame_text(frame) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


class AgentBlockedError(ValueError):
    """Agents keep blocking their event loop with sync code (a ValueError: the user fixes the
    agent; shown without a traceback by the CLI)."""


# Per-episode fields a reward function may ask for by name (besides the dataset's).
AGENT_FIELDS = ("messages", "agent_calls")


def resolve_agent(spec: str):
    """The ``rollout.agent`` callable: async, taking ``(client, row)``."""
    fn = resolve_import_path(spec, "rollout.agent")
    if not is_async_callable(fn):
        raise ValueError(
            f"rollout.agent: {spec!r} must be an async function `async def agent(client, row)`"
        )
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise ValueError(
            f"rollout.agent: {spec!r} must take two arguments (client, row); its signature is "
            f"{inspect.signature(fn)}"
        ) from None
    return fn


def _openai():
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
    openai = _openai()
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
        return context.get(_EPISODE) if context is not None else None

    def where(self) -> str:
        """Where the loop's thread is now: the innermost frame of code outside Python's standard
        library and installed packages (the agent's own line), and the innermost frame."""
        frame = sys._current_frames().get(self._thread.ident)
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
        openai = _openai()
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


@dataclass
class AgentEpisode:
    row: PromptRow
    seed: int
    group: int
    calls: list[CallRecord] = field(default_factory=list)
    reward: float | None = None  # from the agent's return value
    extras: dict[str, float] = field(default_factory=dict)
    failure: str | None = None
    failure_kind: str | None = None
    # the run of it on an event loop: its server key, when its agent started, whether it is done
    key: str | None = None
    started: float | None = None
    finished: bool = False

    def fail(self, kind: str, message: str) -> None:
        self.failure_kind, self.failure = kind, message

    def fresh(self) -> AgentEpisode:
        """The same episode, not run yet."""
        return AgentEpisode(self.row, self.seed, self.group)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The final conversation: the last chat call's messages and the answer it got."""
        for call in reversed(self.calls):
            if call.messages is not None:
                return [*call.messages, *call.responses[:1]]
        return []

    @property
    def completion(self) -> str:
        for call in reversed(self.calls):
            if call.responses:
                r = call.responses[0]
                return r if isinstance(r, str) else (r.get("content") or "")
        return ""

    @property
    def tool_calls(self) -> int:
        return sum(c.tool_calls for c in self.calls)


def _describe(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def _row_dict(row: PromptRow) -> dict[str, Any]:
    return {"prompt": row.prompt, **row.fields}


def _prompt_key(row: PromptRow) -> str:
    return row.prompt if isinstance(row.prompt, str) else json.dumps(row.prompt, sort_keys=True)


class AgentWorkflow:
    """Prompt rows → G agent episodes each (through the server) → samples → rewards."""

    provided_fields = AGENT_FIELDS

    def __init__(self, cfg: Config, policy, train_rows: list[PromptRow],
                 val_rows: list[PromptRow], rewards=None):  # fmt: skip
        _openai()
        # the agents' HTTP clients log every request at INFO: one line per call would bury the
        # run's console (a level set explicitly by the user is kept)
        for name in ("httpx", "httpx2", "openai"):
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
        self.cfg, self.policy = cfg, policy
        # an environment adapter (rollout.openenv) is the agent, else the user's own function
        self.agent = build_env_agent(cfg.rollout) or resolve_agent(cfg.rollout.agent)
        self._train_rows, self.val_rows = list(train_rows), list(val_rows)
        if hasattr(self.agent, "rows"):  # an environment's own tasks (a verifiers taskset)
            self._train_rows, self.val_rows = self.agent.rows()
            train_rows, val_rows = self._train_rows, self.val_rows
        self.reward_fn = None
        if cfg.rollout.agent_reward != "return":
            self.reward_fn = build_rewards(cfg, policy, rewards, [])
        self.contracts = policy.contracts
        self.data_stats = {"data/train_prompts": float(len(train_rows)),
                           "data/val_prompts": float(len(val_rows))}  # fmt: skip
        r = cfg.rollout
        self.width = r.max_response_tokens or r.max_new_tokens * r.max_turns
        self._server: AgentServer | None = None
        self._loop: AgentLoop | None = None
        self._blocked = Abandoned()  # loops given up on, while their agent's code still blocks
        self._logged: set[str] = set()

    @property
    def train_rows(self) -> list[PromptRow]:
        return self._train_rows

    @staticmethod
    def tokenizer_texts(cfg: Config) -> list[str]:
        """A tiny model's characters must spell what agents send: chat templates, tool calls, JSON
        and capitalised instructions."""
        import string

        from groupflow.data.tokenizer import DEFAULT_ALPHABET

        return [DEFAULT_ALPHABET, string.ascii_uppercase]

    @property
    def server(self) -> AgentServer:
        """Started where collect runs (the trainer or the rollout side), over the policy's rollout
        group *now*: an asynchronous rollout hands a Ray rollout pool to its side
        (``policy.start_async``), after which the trainer's process validates with the actor's
        current weights — a server built before (a baseline validation, the warm start) would
        keep sending its calls to the pool and its older weights."""
        if self._server is not None and self._server.rollout is not self.policy.rollout:
            self._server.close()
            self._server = None
        if self._server is None:
            self._server = AgentServer(self.cfg, self.policy)
        return self._server

    @property
    def loop(self) -> AgentLoop:
        if self._loop is None:
            self._loop = AgentLoop()
        return self._loop

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        if hasattr(self.agent, "close"):  # an environment adapter's server
            self.agent.close()

    # ----- the trainer's calls ------------------------------------------------------------------
    def collect(self, rows: list[PromptRow], step: int, round_: int,
                version: int) -> tuple[Batch, dict[str, float]]:  # fmt: skip
        params = self.policy.sampling
        n = params.n
        seeds, group_ids = step_seeds(self.cfg.run.seed, step, round_, len(rows), n)
        episodes = [
            AgentEpisode(row, seeds[i][j], group_ids[i]) for i, row in enumerate(rows)
            for j in range(n)
        ]  # fmt: skip
        overrides = self.server.recorder.overrides
        batcher = self.server.core.batcher
        calls, samples, seconds = batcher.engine_calls, batcher.samples, batcher.engine_seconds
        reused = batcher.reused_tokens
        self.run(episodes, params)
        rewards, reward_metrics = self.rewards(episodes, train=True)
        batch, counts = self.samples_batch(episodes, rewards, f"{step}-{round_}", version)
        validate(batch, self.contracts["rollout"])
        metrics = {**agent_metrics(episodes, counts), **reward_metrics}
        metrics["rollout/agent/sampling_overrides"] = float(
            self.server.recorder.overrides - overrides
        )
        # how well concurrent calls shared decode steps, and the engine's share of the time
        engine_calls = batcher.engine_calls - calls
        metrics["rollout/agent/engine_calls"] = float(engine_calls)
        metrics["rollout/agent/samples_per_engine_call"] = (batcher.samples - samples) / max(
            engine_calls, 1
        )
        metrics["time/agent_engine"] = batcher.engine_seconds - seconds
        # prompt tokens a continued conversation did not prefill again (serve.prefix_cache_tokens)
        metrics["rollout/agent/prefix_cached_tokens"] = float(batcher.reused_tokens - reused)
        return validate(batch, self.contracts["rewarded"]), metrics

    def step_metrics(self, batch: Batch, seconds: float) -> dict[str, float]:
        return llm_step_metrics(batch, seconds)

    def validate(self, step: int, return_records: bool = False, progress_label="validation"):
        """Held-out rows through the agent: greedy (one episode each) and sampled
        (``validation.samples_per_prompt`` at ``validation.temperature``); accuracy is the share
        of episodes with reward >= 1 (as ``acc/train``)."""
        if not self.val_rows:
            return ({}, {}) if return_records else {}
        v = self.cfg.validation
        modes = []
        if v.greedy:
            modes.append(("greedy", 1, 0.0))
        modes.append(("sampled", v.samples_per_prompt, v.temperature))
        metrics, records = {}, {}
        for mode, k, temperature in modes:
            params = replace(self.policy.sampling, temperature=temperature, n=k)
            episodes = [
                AgentEpisode(row, self.cfg.run.seed * 7919 + i * k + j, i)
                for i, row in enumerate(self.val_rows) for j in range(k)
            ]  # fmt: skip
            self.run(episodes, params)
            rewards, _ = self.rewards(episodes)
            metrics[f"val/{mode}/acc"] = float((rewards >= 1.0).float().mean())
            metrics[f"val/{mode}/reward_mean"] = float(rewards.mean())
            metrics[f"val/{mode}/tool_call_rate"] = sum(e.tool_calls > 0 for e in episodes) / len(
                episodes
            )
            metrics[f"val/{mode}/failures"] = float(sum(e.failure is not None for e in episodes))
            records[mode] = [
                {"prompt": _prompt_key(e.row), "reward": float(r), "completion": e.completion,
                 "tool_calls": e.tool_calls, "calls": len(e.calls), "failure": e.failure}
                for e, r in zip(episodes, rewards.tolist())
            ]  # fmt: skip
        return (metrics, records) if return_records else metrics

    def warm_start(self) -> dict[str, float]:
        """The supervised warm start (``sft.steps``) on demonstrations played through the agent
        (``sft_examples``), probed with greedy episodes of the agent."""
        if not self.cfg.sft.steps:
            return {}
        rows = self._train_rows
        train = EncodedPrompts(rows, [_prompt_key(r) for r in rows], [[0] for _ in rows])
        greedy = replace(self.policy.sampling, temperature=0.0, n=1)
        return warm_start(
            self.policy, self.sft_examples, lambda probe: self.score(probe.rows, greedy), train,
            self.cfg.sft, self.cfg.run.seed, sync=self.policy.sync,
        )  # fmt: skip

    def score(self, rows: list[PromptRow], params: SamplingParams) -> list[dict[str, Any]]:
        """One episode per row; records with the episode's reward."""
        episodes = [AgentEpisode(r, self.cfg.run.seed + i, i) for i, r in enumerate(rows)]
        self.run(episodes, params)
        rewards, _ = self.rewards(episodes)
        return [{"reward": float(r)} for r in rewards.tolist()]

    def sft_examples(self, encoded) -> list[tuple[list[int], list[int], list[int]]]:
        """Demonstrations from the rows' ``sft.target_field`` (a list of model turns, or one
        string), each played through the agent: the server answers the agent's k-th call with
        the k-th turn instead of a sample, so the tool results, the chat template and the
        agent's own messages in between are real — and masked out of the loss. Up to
        ``_MAX_DEMOS`` rows; a demonstration the agent does not follow to its end (it stops
        calling early, or the calls do not form one conversation) is left out and counted."""
        field = self.cfg.sft.target_field
        tok = self.policy.tokenizer
        rows = encoded.rows[:_MAX_DEMOS]
        scripts = []
        for row in rows:
            turns = sft_turns(row, field)
            ids = [tok(t, add_special_tokens=False)["input_ids"] for t in turns]
            ids[-1] = ids[-1] + [tok.eos_token_id]
            scripts.append(ids)
        episodes = [AgentEpisode(r, self.cfg.run.seed + i, i) for i, r in enumerate(rows)]
        left = self._run_episodes(episodes, self.policy.sampling, scripts)
        examples = []
        for e, remaining in zip(episodes, left):
            chains = merge_calls(e.calls)
            if e.failure is None and remaining == 0 and len(chains) == 1:
                examples.append((chains[0].prompt_ids, chains[0].ids, chains[0].mask))
        skipped = len(episodes) - len(examples)
        if not examples:
            raise ValueError(
                f"sft: none of {len(episodes)} demonstrations was followed by the agent to its end "
                f"(field '{field}'); e.g. {episodes[0].failure or 'it stopped calling early'}"
            )
        if skipped:
            log.warning("sft: %d of %d demonstrations were not followed by the agent to their "
                        "end and are left out", skipped, len(episodes))  # fmt: skip
        return examples

    # ----- episodes -----------------------------------------------------------------------------
    def run(self, episodes: list[AgentEpisode], params: SamplingParams) -> None:
        self._run_episodes(episodes, params)
        if hasattr(self.agent, "check"):  # an adapter's environment died: not the episodes' fault
            self.agent.check()
        for e in episodes:
            if e.failure is not None and e.failure_kind not in self._logged:
                self._logged.add(e.failure_kind)
                log.warning(
                    "agent episode failed (%s) on row %d of %s: %s — it gets reward.failure_value; "
                    "further failures are counted in rollout/agent/failures",
                    e.failure_kind, e.row.index, e.row.source, e.failure,
                )  # fmt: skip

    def _run_episodes(self, episodes: list[AgentEpisode], params: SamplingParams,
                      scripts: list | None = None) -> list[int]:  # fmt: skip
        """Run ``episodes`` (replaced in the list by their runs); each one's unused scripted turns.

        Sync code in an ``async def`` agent blocks the one event loop, and with it every episode
        and their deadlines: ``asyncio.wait_for`` cannot fire. So the loop is watched from here
        (its heartbeat): once the episode whose code blocks it is past ``rollout.agent_timeout_s``,
        that episode alone fails (``blocked``), the loop is abandoned to the code, and the episodes
        it had not finished run again from the start on a fresh loop. Abandoned loops still
        blocked count against :data:`MAX_BLOCKED_LOOPS`, after which the run stops."""
        scripts = scripts or [None] * len(episodes)
        left = [0] * len(episodes)
        pending = list(range(len(episodes)))
        while pending:
            loop = self.loop
            runs = {i: episodes[i].fresh() for i in pending}
            future = loop.submit(self._run_all(
                loop, [runs[i] for i in pending], params, [scripts[i] for i in pending]
            ))  # fmt: skip
            culprit = self._watch(loop, future)
            if culprit is None:
                for i, unused in zip(pending, future.result()):
                    episodes[i], left[i] = runs[i], unused
                return left
            where = loop.where()
            loop.abandon()
            self._loop = None  # the next round runs on a fresh loop
            self._blocked.add(where, loop._thread)
            timeout = self.cfg.rollout.agent_timeout_s
            for i in list(pending):
                run = runs[i]
                if run.finished:  # done before the block: final, the blocked loop cannot touch it
                    episodes[i] = run
                    pending.remove(i)
                    continue
                calls = self._forget(run.key)  # a run given up on: its later calls are refused
                if run is culprit:
                    failed = run.fresh()
                    failed.calls = calls
                    failed.fail("blocked", f"its code blocked the event loop past "
                                f"rollout.agent_timeout_s={timeout:g} s (at {where}); use `await` "
                                "for waits and asyncio.to_thread for blocking calls")  # fmt: skip
                    episodes[i] = failed
                    pending.remove(i)
            self._check_blocked()
        return left

    def _watch(self, loop: AgentLoop, future: concurrent.futures.Future) -> Any:
        """Wait for ``future``; the episode blocking ``loop`` past its deadline if one does first
        (``AgentWorkflow`` itself when the code blocks outside any episode's task)."""
        timeout = self.cfg.rollout.agent_timeout_s
        while True:
            try:
                future.result(timeout=loop.beat_s)
                return None
            except concurrent.futures.TimeoutError:
                pass
            stalled = loop.blocked_s()
            if stalled < 2 * loop.beat_s:
                continue
            run = loop.running_episode()
            if run is not None and run.started is not None:
                if time.monotonic() - run.started > timeout:
                    return run
            elif stalled > timeout:  # blocked by code of no episode (a callback): all rerun
                return self

    def _forget(self, key: str | None) -> list[CallRecord]:
        if key is None:
            return []
        calls = self.server.recorder.close(key)
        if self.server.core.chat_prompts is not None:
            self.server.core.chat_prompts.forget(key)
        return calls

    def _check_blocked(self) -> None:
        stuck = self._blocked.alive()
        if len(stuck) >= MAX_BLOCKED_LOOPS:
            raise AgentBlockedError(
                f"rollout.agent {_describe(self.agent)} keeps blocking its event loop with sync "
                f"code: {len(stuck)} abandoned loops are still blocked, at "
                f"{Abandoned.summary(stuck)}. An `async def` agent must not call blocking "
                "functions (time.sleep, requests, a sync client): await their async versions, or "
                "run them with `await asyncio.to_thread(fn, ...)`"
            )

    async def _run_all(self, loop: AgentLoop, episodes: list[AgentEpisode],
                       params: SamplingParams, scripts: list) -> list[int]:  # fmt: skip
        gate = asyncio.Semaphore(self.cfg.rollout.agent_concurrency)
        return await asyncio.gather(
            *(self._episode(loop, e, params, gate, s) for e, s in zip(episodes, scripts))
        )

    async def _episode(self, loop: AgentLoop, e: AgentEpisode, params: SamplingParams, gate,
                       script=None) -> int:  # fmt: skip
        """Run one episode; returns how many scripted turns it left unused."""
        r = self.cfg.rollout
        left = 0
        async with gate:
            _EPISODE.set(e)  # this task's (and its helper tasks') episode, for the loop's watch
            key = self.server.recorder.open(e.seed, replace(params, n=1), script,
                                            r.agent_max_calls)  # fmt: skip
            e.key, e.started = key, time.monotonic()
            client = loop.client(self.server.url, key, r.agent_timeout_s)
            result = None
            try:
                # guarded: SystemExit, KeyboardInterrupt (any BaseException but our own
                # cancellation) arrive as an Exception, the episode's failure like any other
                result = await asyncio.wait_for(guarded(self.agent(client, _row_dict(e.row))),
                                                r.agent_timeout_s)  # fmt: skip
            except asyncio.TimeoutError:
                e.fail(
                    "timeout", f"no result after rollout.agent_timeout_s={r.agent_timeout_s:g} s"
                )
            except Exception as exc:  # user code: counted and logged, the step goes on
                e.fail("raised", error_text(exc))
            finally:
                refused = self.server.recorder.refused(key)
                if refused:  # the cause, whatever the agent made of the refusal
                    e.fail("max_calls", f"it made more than rollout.agent_max_calls="
                           f"{r.agent_max_calls} calls ({refused} refused)")  # fmt: skip
                left = self.server.recorder.remaining_script(key)
                e.calls = self.server.recorder.close(key)  # later calls of this key: refused
                if self.server.core.chat_prompts is not None:  # its conversations are done
                    self.server.core.chat_prompts.forget(key)
        if e.failure is None and not e.calls:
            e.fail("no_call", "the agent made no call to the server")
        if e.failure is None:
            self._take_result(e, result)
        e.finished = True  # last: a finished run is final (see _run_episodes)
        return left

    def _take_result(self, e: AgentEpisode, result: Any) -> None:
        wants_value = self.cfg.rollout.agent_reward != "functions"
        if isinstance(result, dict):
            extras = {k: v for k, v in result.items() if k != "reward"}
            e.extras = {k: float(v) for k, v in extras.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)}  # fmt: skip
            result = result.get("reward")
        if isinstance(result, bool) or not isinstance(result, (int, float, type(None))):
            e.fail("invalid", f"the agent returned {type(result).__name__}; expected a float, a "
                   "dict with 'reward', or None (rollout.agent_reward: functions)")  # fmt: skip
        elif result is None and wants_value:
            e.fail("invalid", "the agent returned no reward (rollout.agent_reward="
                   f"{self.cfg.rollout.agent_reward!r} needs a float or a dict with 'reward')")  # fmt: skip
        elif result is not None and not math.isfinite(result):
            e.fail("invalid", f"the agent returned a reward of {result}")
        else:
            e.reward = None if result is None else float(result)

    # ----- rewards and samples ----------------------------------------------------------------
    def rewards(
        self, episodes: list[AgentEpisode], train: bool = False
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """One reward per episode (see the module docstring); ``train``: a training batch, whose
        groups ``reward.normalize: group`` uses (validation reports the plain weighted sum)."""
        how = self.cfg.rollout.agent_reward
        total = torch.tensor([e.reward or 0.0 for e in episodes], dtype=torch.float32)
        metrics: dict[str, float] = {}
        if how != "return":
            fields = {"messages": [e.messages for e in episodes],
                      "agent_calls": [len(e.calls) for e in episodes]}  # fmt: skip
            result = self.reward_fn(
                [_prompt_key(e.row) for e in episodes], [e.completion for e in episodes],
                completion_lengths=[sum(len(c.ids) for call in e.calls for c in call.completions)
                                    for e in episodes],
                group_ids=[e.group for e in episodes] if train else None,
                **row_fields([e.row for e in episodes]), **fields,
            )  # fmt: skip
            total = total + result.total.float() if how == "both" else result.total.float()
            metrics = finite_metrics(result.metrics)
        failed = torch.tensor([e.failure is not None for e in episodes])
        total = torch.where(failed, torch.tensor(self.cfg.reward.failure_value), total)
        return total, metrics

    def samples_batch(self, episodes: list[AgentEpisode], rewards: torch.Tensor, uid: str,
                      version: int) -> tuple[Batch, Counter]:  # fmt: skip
        """The episodes' samples (``merge_calls``), each with its episode's reward and id."""
        tok = self.policy.tokenizer
        samples, owner, counts = [], [], Counter()
        for k, e in enumerate(episodes):
            chains = merge_calls(e.calls) or [self._placeholder(e)]
            counts["samples"] += len(chains)
            counts["split_episodes"] += len(chains) > 1
            for chain in chains:
                if len(chain.ids) > self.width:  # the sample's width: rollout.max_response_tokens
                    counts["truncated"] += 1
                    chain = Chain(chain.prompt_ids, chain.ids[: self.width],
                                  chain.mask[: self.width], chain.logprobs[: self.width], "length")  # fmt: skip
                samples.append(Episode(e.row, None, e.seed, e.group, chain.prompt_ids, chain.ids,
                                       chain.mask, chain.logprobs, finish=chain.finish))  # fmt: skip
                owner.append(k)
        batch = episodes_batch(samples, tok.pad_token_id, self.width)
        batch["uid"] = [f"{uid}-{i}" for i in range(len(samples))]
        batch["prompt"] = [_prompt_key(episodes[k].row) for k in owner]
        batch["row"] = [episodes[k].row for k in owner]
        batch["version"] = torch.full((len(samples),), version, dtype=torch.long)
        batch["episode_ids"] = torch.tensor(owner, dtype=torch.long)
        batch["completion"] = [episodes[k].completion for k in owner]
        batch["messages"] = [episodes[k].messages for k in owner]
        batch["rewards"] = rewards[torch.tensor(owner, dtype=torch.long)]
        return batch, counts

    def _placeholder(self, e: AgentEpisode) -> Chain:
        """An episode without a call still counts in its group (reward.failure_value): its row's
        prompt with one masked-out token, so it trains nothing itself."""
        tok = self.policy.tokenizer
        text = _prompt_key(e.row)
        if getattr(tok, "chat_template", None) and isinstance(e.row.prompt, (str, list)):
            msgs = [{"role": "user", "content": e.row.prompt}] if isinstance(e.row.prompt, str) \
                else e.row.prompt  # fmt: skip
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = list(tok(text, add_special_tokens=False)["input_ids"]) or [tok.pad_token_id]
        return Chain(ids, [tok.pad_token_id], [0], [0.0], "stop")


def agent_metrics(episodes: list[AgentEpisode], counts: Counter) -> dict[str, float]:
    """Calls, samples per episode, tool use and failures of one collect round."""
    n = len(episodes)
    failures = Counter(e.failure_kind for e in episodes if e.failure is not None)
    m = {
        "rollout/agent/episodes": float(n),
        "rollout/agent/calls/mean": sum(len(e.calls) for e in episodes) / n,
        "rollout/agent/samples_per_episode": counts["samples"] / n,
        "rollout/agent/split_episodes": float(counts["split_episodes"]),
        "rollout/agent/truncated_samples": float(counts["truncated"]),
        "rollout/agent/tool_calls/mean": sum(e.tool_calls for e in episodes) / n,
        "rollout/agent/tool_call_rate": sum(e.tool_calls > 0 for e in episodes) / n,
        "rollout/agent/failures": float(sum(failures.values())),
    }
    for kind in FAILURE_KINDS:
        m[f"rollout/agent/failures/{kind}"] = float(failures.get(kind, 0))
    extras = {k for e in episodes for k in e.extras}
    for k in sorted(extras):
        values = [e.extras[k] for e in episodes if k in e.extras]
        m[f"rollout/agent/{k}"] = statistics.fmean(values)
    return m
