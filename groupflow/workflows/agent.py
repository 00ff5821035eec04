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
The workflow goes there as built (its rows, its environment's own included, and options); the
agent, the server and the loop do not travel (threads, sockets, processes): the side finds the
agent again from a small ``AgentRecipe`` and starts its own server and loop (``AgentWorkflow``).

The run's sampling settings hold for every call (the training forward assumes them): a request's
own temperature/top-p is replaced and counted (``rollout/agent/sampling_overrides``). The warm
start (``sft.steps``) plays the rows' demonstrations through the agent itself: the server answers
the agent's k-th call with the k-th demonstrated turn, so what lies between the turns (tool
results, the template's turns) is real. All episodes of the run share one event loop in a thread
of their own (``AgentLoop``) and one HTTP connection pool.

This module is the workflow and its episode loop (running episodes on the loop, watching it for
blocking code, judging each agent's result); the server and the loop it runs on are
``workflows.agent_runtime``, and the episode record and its assembly into rewards, samples and
metrics are ``workflows.agent_episodes`` — neither knows of the other's side.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import torch

from groupflow.agents.calls import error_text, guarded, is_async_callable
from groupflow.assembly.data import EncodedPrompts
from groupflow.batch import Batch
from groupflow.config import Config, present
from groupflow.contracts import validate
from groupflow.data import PromptRow
from groupflow.data.tokenizer import DEFAULT_ALPHABET
from groupflow.envs import build_env_agent
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.serve.access import CallRecord
from groupflow.serve.recording import merge_calls
from groupflow.sft import warm_start
from groupflow.utils.daemon_calls import Abandoned
from groupflow.utils.imports import resolve_import_path
from groupflow.utils.seeds import step_seeds
from groupflow.workflows.agent_episodes import (
    AgentEpisode,
    agent_metrics,
    episode_rewards,
    episode_samples,
    prompt_key,
)
from groupflow.workflows.agent_runtime import (
    CURRENT_EPISODE,
    AgentLoop,
    AgentServer,
    require_openai,
)
from groupflow.workflows.detach import PolicyParts
from groupflow.workflows.llm import build_rewards, llm_step_metrics, sft_turns

log = logging.getLogger("groupflow")

__all__ = ["AgentBlockedError", "AgentRecipe", "AgentWorkflow", "resolve_agent", "AGENT_FIELDS"]

# Abandoned event loops (each blocked by an agent's sync code) still blocked at once: the run stops.
MAX_BLOCKED_LOOPS = 4


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


def _describe(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def _row_dict(row: PromptRow) -> dict[str, Any]:
    return {"prompt": row.prompt, **row.fields}


@dataclass(frozen=True)
class AgentRecipe:
    """How the run found its agent, small and picklable: what the rollout side finds it again by
    (``AgentWorkflow.attach``). The agent itself cannot travel: an adapter holds an OpenEnv
    server's child process or a verifiers environment's serving resources, and a user's
    function may keep objects bound to the trainer's event loop. The import path and the
    adapters' sections are the workflow's own ``cfg.rollout``; what the recipe adds is a
    verifiers adapter's tasks as the trainer listed them (``VerifiersAgent.built_tasks``), so the
    side runs exactly the trainer's rows without reading the taskset again."""

    # pickled by the adapter, unpickled by the side's adapter once it has put the taskset's
    # directory on sys.path (rollout.verifiers.taskset_dir): the tasks' classes are the taskset's
    tasks: bytes | None = None

    @classmethod
    def of(cls, agent: Any) -> AgentRecipe:
        built_tasks = getattr(agent, "built_tasks", None)
        return cls(built_tasks() if built_tasks is not None else None)

    def build(self, rollout_cfg) -> Any:
        """The agent ``rollout_cfg`` names: an environment adapter, else ``rollout.agent``."""
        return build_env_agent(rollout_cfg, self.tasks) or resolve_agent(
            present(rollout_cfg.agent, "rollout.agent")
        )


def _quiet_clients() -> None:
    """The agents' HTTP clients log every request at INFO: one line per call would bury the
    run's console (a level set explicitly by the user is kept)."""
    require_openai()
    for name in ("httpx", "httpx2", "openai"):
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)


class AgentWorkflow(PolicyParts):
    """Prompt rows → G agent episodes each (through the server) → samples → rewards.

    It travels to the asynchronous rollout side as built (``workflows.detach``): its rows (the
    data section's, or its environment's own) and options go as they are; ``without_policy``
    drops what lives beside the policy — the reward runner, the contracts, the agent, the
    server (a uvicorn thread over the policy's rollout group), the event loop (a thread) and
    the loops abandoned to blocking code — and ``attach`` builds them again over the side's
    policy view, the agent from its ``recipe``."""

    provided_fields = AGENT_FIELDS
    over_policy = (*PolicyParts.over_policy, "agent", "_server", "_loop", "_blocked")
    travels_as_built = True  # to the asynchronous rollout side (workflows.detach)
    recipe: AgentRecipe  # set by without_policy: what the rollout side finds its agent by

    def __init__(self, cfg: Config, policy, train_rows: list[PromptRow],
                 val_rows: list[PromptRow], rewards=None):  # fmt: skip
        self.cfg, self.policy = cfg, policy
        _quiet_clients()
        # an environment adapter (rollout.openenv) is the agent, else the user's own function
        self.agent = build_env_agent(cfg.rollout) or resolve_agent(
            present(cfg.rollout.agent, "rollout.agent")
        )
        self._train_rows, self.val_rows = list(train_rows), list(val_rows)
        if (own_rows := getattr(self.agent, "rows", None)) is not None:
            # an environment's own tasks (a verifiers taskset)
            self._train_rows, self.val_rows = own_rows()
            train_rows, val_rows = self._train_rows, self.val_rows
        self.data_stats = {"data/train_prompts": float(len(train_rows)),
                           "data/val_prompts": float(len(val_rows))}  # fmt: skip
        r = cfg.rollout
        self.width = r.max_response_tokens or r.max_new_tokens * r.max_turns
        self._over_policy(policy, rewards)

    def _over_policy(self, policy, rewards) -> None:
        """The reward runner and the contracts over ``policy``; no server or loop yet (started
        where collect runs: ``server``, ``loop``)."""
        self.reward_fn = None
        if self.cfg.rollout.agent_reward != "return":
            self.reward_fn = build_rewards(self.cfg, policy, rewards, [])
        self.contracts = policy.contracts
        self._server: AgentServer | None = None
        self._loop: AgentLoop | None = None
        self._blocked = Abandoned()  # loops given up on, while their agent's code still blocks
        self._logged: set[str | None] = set()  # the failure kinds logged (once each) here

    def without_policy(self):
        """``PolicyParts.without_policy``, with the ``recipe`` the side finds its agent by."""
        part = super().without_policy()
        part.recipe = AgentRecipe.of(self.agent)
        return part

    def attach(self, policy, rewards) -> None:
        """On the rollout side: the agent found again from ``recipe`` (an OpenEnv adapter starts
        its own server, a verifiers one loads its environment over the trainer's tasks; neither
        reads its row source again: the rows travelled as built), then what ``__init__`` builds
        over the policy."""
        _quiet_clients()
        self.agent = self.recipe.build(self.cfg.rollout)
        try:
            self._over_policy(policy, rewards)
        except BaseException:  # the side gets no workflow to close: the adapter's server goes now
            if hasattr(self.agent, "close"):
                self.agent.close()
            raise

    @property
    def train_rows(self) -> list[PromptRow]:
        return self._train_rows

    @staticmethod
    def tokenizer_texts(cfg: Config) -> list[str]:
        """A tiny model's characters must spell what agents send: chat templates, tool calls, JSON
        and capitalised instructions."""
        import string

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
                {"prompt": prompt_key(e.row), "reward": float(r), "completion": e.completion,
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
        train = EncodedPrompts(rows, [prompt_key(r) for r in rows], [[0] for _ in rows])
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
        ``sft.demonstrations`` rows; a demonstration the agent does not follow to its end (it stops
        calling early, or the calls do not form one conversation) is left out and counted."""
        field = self.cfg.sft.target_field
        tok = self.policy.tokenizer
        rows = encoded.rows[: self.cfg.sft.demonstrations]
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
            CURRENT_EPISODE.set(e)  # its (and its helper tasks') episode, for the loop's watch
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

    # ----- rewards and samples (workflows.agent_episodes) -----------------------------------
    def rewards(
        self, episodes: list[AgentEpisode], train: bool = False
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """One reward per episode (``episode_rewards``)."""
        return episode_rewards(self.cfg, self.reward_fn, episodes, train)

    def samples_batch(self, episodes: list[AgentEpisode], rewards: torch.Tensor, uid: str,
                      version: int) -> tuple[Batch, Counter]:  # fmt: skip
        """The episodes' samples (``episode_samples``), each with its episode's reward and id."""
        return episode_samples(self.policy.tokenizer, self.width, episodes, rewards, uid, version)
