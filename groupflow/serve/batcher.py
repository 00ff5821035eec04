"""The batchers: concurrent requests share decode steps — continuously (HF) or per engine call.

This module holds the dynamic batcher and picks a run's batcher (``group_batcher``); the
continuous one is ``serve.continuous_batcher`` and what both share (the completion, the queue
entry, the room check, the wait for a burst) is ``serve.queue``; the names are re-exported here.

``ContinuousBatcher`` (the HF engine on a model ``rollout.continuous`` drives): requests join the
running decode at its next step and leave when they end, so a request never waits for another
request's tokens; it also hands each request its tokens as they are decoded (token-by-token
streaming). ``DynamicBatcher`` (any other engine: a Ray or vLLM rollout group, a vision model)
batches per engine call, as described below; its requests get their tokens when the call ends.
Both have the same interface: ``await submit(prompts, params, seeds, listener)``, or
``enqueue`` (the same, queued at once and returning the future: a request of several prompts
queues them all in one go, or — past ``max_pending_samples`` — none); ``await score(jobs, k)``
runs a scoring forward (``serve.scoring``) on the engine's thread. A request's failure stays
its own: when an engine call or a join fails for several requests, each is retried alone, and
only the ones that fail alone get the error. A request whose future is cancelled (its client
went away) is dropped from the queue, and the continuous batcher drops its rows mid-decode.

The dynamic batcher:

Design decision: the rollout engine decodes a batch of prompts at once (``RolloutEngine.generate``
— one prefill, then one forward per step for all rows), and a sample's tokens depend only on its
prompt and seed, never on its batch-mates (``rollout.hf``). So the server need not decode
requests one after another: while one engine call runs, arriving requests queue; when it
returns, everything queued with the same sampling settings goes into the next call (up to
``max_batch_samples``), each request cut back to its own ``max_tokens`` afterwards. An idle
batcher that gets a request waits while more keep arriving (``wait_s`` without one ends the
wait, at most ``10 × wait_s``): agents started together send their calls a few milliseconds
apart, and one call for all of them decodes far faster than several small ones. Engine calls
run one at a time on one thread — the model is not shared across threads — while the event loop
keeps accepting requests. This is request-level batching: a request that arrives mid-call waits
for that call to end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from groupflow.batch import Batch
from groupflow.rollout.engines.batching import prompts_batch
from groupflow.rollout.engines.continuous import ContinuousDecoder, continuous_reason
from groupflow.rollout.engines.hf import GenerationOutput, SamplingParams
from groupflow.serve.continuous_batcher import ContinuousBatcher
from groupflow.serve.queue import (
    Batcher,
    Completion,
    GenerateFn,
    Listener,
    Overloaded,
    Pending,
    Unsupported,
    gather,
    pending_entry,
    waiting,
)
from groupflow.serve.scoring import ScoreFn, ScoreJob, TokenScores, model_scorer

__all__ = [
    "Completion",
    "GenerateFn",
    "DynamicBatcher",
    "ContinuousBatcher",
    "Listener",
    "Overloaded",
    "Unsupported",
    "engine_generate",
    "group_generate",
    "group_batcher",
]


def _completions(responses, mask, logprobs, finishes: Sequence[str],
                 versions=None) -> list[Completion]:  # fmt: skip
    out = []
    for k in range(responses.shape[0]):
        m = mask[k].bool()
        v = None if versions is None else versions[k][m].tolist()
        out.append(Completion(responses[k][m].tolist(), logprobs[k][m].tolist(), finishes[k], v))
    return out


def engine_generate(engine) -> GenerateFn:
    """A ``RolloutEngine`` (``groupflow.rollout.engines.base``) as the batcher's generate function."""

    def generate(prompts, params, seeds):
        out: GenerationOutput = engine.generate(prompts, params, seeds=seeds)
        return _completions(out.responses, out.response_mask, out.logprobs, out.finish_reasons,
                            out.token_versions)  # fmt: skip

    return generate


def group_generate(group) -> GenerateFn:
    """A policy's rollout worker group (``policy.rollout``: local or Ray, any engine)."""

    def generate(prompts, params, seeds):
        batch = prompts_batch(prompts, [[s] for s in seeds], list(range(len(prompts))))
        out: Batch = group.generate(batch, params, 0)
        versions = out["token_versions"] if "token_versions" in out else None
        return _completions(out["responses"], out["response_mask"], out["rollout_logprobs"],
                            out["finish_reason"], versions)  # fmt: skip

    return generate


def group_batcher(
    group, *, continuous: bool = True, prefix_tokens: int = 16384, **options
) -> DynamicBatcher | ContinuousBatcher:
    """The batcher for a policy's rollout group: continuous over the HF engine of a one-worker
    local group whose model ``ContinuousDecoder`` supports (with ``continuous``; its prefix cache
    keeps ``prefix_tokens``), else per engine call through ``group.generate`` (Ray, several
    workers, vLLM, other models)."""
    engine = worker = None
    if getattr(group, "backend", None) == "local" and group.world_size == 1:
        worker = group.local_worker()
        engine = getattr(worker, "engine", None)
    local = engine.local_model() if engine is not None else None
    if continuous and local is not None and continuous_reason(local.model) is None:
        decoder = ContinuousDecoder(local.model, local.tokenizer, eos_ids=local.eos_ids,
                                    pad_id=local.pad_id, prefix_tokens=prefix_tokens)  # fmt: skip

        hf: Any = engine  # the group's HF engine (local is its model)

        def between() -> int | None:
            # in-flight updates reach the engine after the server is built (rollout.side)
            return hf.take_update() if getattr(hf, "updates", None) else None

        return ContinuousBatcher(decoder, score=model_scorer(local.model, local.pad_id),
                                 between=between, **options)  # fmt: skip
    return DynamicBatcher(group_generate(group), score=_worker_scorer(worker, local), **options)


def _worker_scorer(worker, local) -> ScoreFn | None:
    """Scoring over the model a one-worker local group decodes with (the HF engine's) or keeps
    beside a separate engine (vLLM's torch copy); None on Ray or several workers (no model in
    this process)."""
    if worker is None:
        return None
    model = local.model if local is not None else None
    model = model or getattr(worker, "rollout_model", None) or getattr(worker, "model", None)
    pad_id = getattr(worker, "pad_id", None)
    if model is None or pad_id is None or not hasattr(model, "get_output_embeddings"):
        return None
    return model_scorer(model, pad_id)


def _sampling_key(p: SamplingParams) -> SamplingParams:
    """What must agree for requests to share an engine call (``max_new_tokens`` need not)."""
    return dataclasses.replace(p, max_new_tokens=1, n=1)


class DynamicBatcher(Batcher):
    """``await submit(prompts, params, seeds)`` → completions; see the module docstring."""

    def __init__(self, generate: GenerateFn, *, score: ScoreFn | None = None,
                 max_batch_samples: int = 64, max_pending_samples: int = 1024,
                 wait_s: float = 0.005):  # fmt: skip
        self.generate, self.score_fn = generate, score
        self.max_batch_samples, self.max_pending_samples = max_batch_samples, max_pending_samples
        self.wait_s = wait_s
        self.expected: Callable[[], int] | None = (
            None  # requests to wait for (see serve.queue.gather)
        )
        self._queue: list[Pending] = []
        self._wake = asyncio.Event()  # replaced for each event loop that runs the batcher
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="groupflow-decode")
        self.engine_calls = 0
        self.samples = 0
        self.engine_seconds = 0.0  # wall time inside the engine (the rest is HTTP and clients)
        self.reused_tokens = 0  # no prefix cache of its own (an engine may keep one: vLLM's)
        self.decoded_tokens = 0  # completion tokens decoded (a cut completion counts whole)

    @property
    def pending_samples(self) -> int:
        return waiting(self._queue)

    def enqueue(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int],
                listener: Listener | None = None) -> asyncio.Future:  # fmt: skip
        """Queue a request now (``Overloaded`` when it does not fit) and return the future of its
        completions; ``listener`` gets each sample's ids when its engine call ends. Cancelling
        the future takes the request out of the queue."""
        item = pending_entry(self, prompts, params, seeds, listener)
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run())
        self._queue.append(item)
        self._wake.set()
        return item.future

    async def score(self, jobs: list[ScoreJob], k: int) -> list[TokenScores]:
        """A scoring forward (``serve.scoring``) on the engine's thread, between engine calls."""
        if self.score_fn is None:
            raise Unsupported("this server's engine has no model in the server's process")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.score_fn, jobs, k)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            await gather(self)
            while self._queue:
                group = self._take()
                if group:
                    await self._call(loop, group)
                await gather(self)  # the answered conversations' next calls are on their way

    async def _call(self, loop, group: list[Pending]) -> None:
        """One engine call for ``group``; if it fails, each request alone (a request's bad input
        must not fail the others), and a request failing alone gets the error."""
        prompts = [p for item in group for p in item.prompts]
        seeds = [s for item in group for s in item.seeds]
        width = max(item.params.max_new_tokens for item in group)
        params = dataclasses.replace(group[0].params, max_new_tokens=width)
        start = time.perf_counter()
        try:
            outs = await loop.run_in_executor(self._executor, self.generate, prompts, params, seeds)
        except Exception as exc:
            if len(group) == 1:
                if not group[0].future.done():
                    group[0].future.set_exception(exc)
                return
            for item in group:
                if not item.future.done():
                    await self._call(loop, [item])
            return
        finally:
            self.engine_seconds += time.perf_counter() - start
        self.engine_calls += 1
        self.samples += len(prompts)
        self.decoded_tokens += sum(len(c.ids) for c in outs)
        first = 0
        for item in group:
            mine = outs[first : first + len(item.prompts)]
            first += len(item.prompts)
            if not item.future.done():  # the client may have gone
                cut = [_cut(c, item.params.max_new_tokens) for c in mine]
                if item.listener is not None:
                    for j, c in enumerate(cut):
                        item.listener(j, c.ids)
                item.future.set_result(cut)

    def _take(self) -> list[Pending]:
        """The oldest request and the queued ones that sample like it, up to the batch size
        (requests nobody waits for any more are dropped)."""
        self._queue = [item for item in self._queue if not item.future.cancelled()]
        if not self._queue:
            return []
        key = _sampling_key(self._queue[0].params)
        group, rest, size = [], [], 0
        for item in self._queue:
            fits = size + len(item.prompts) <= self.max_batch_samples or not group
            if fits and _sampling_key(item.params) == key:
                group.append(item)
                size += len(item.prompts)
            else:
                rest.append(item)
        self._queue = rest
        return group

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _cut(c: Completion, max_tokens: int) -> Completion:
    """A completion decoded in a call for longer requests, cut back to its own limit."""
    if len(c.ids) <= max_tokens:
        return c
    versions = None if c.versions is None else c.versions[:max_tokens]
    return Completion(c.ids[:max_tokens], c.logprobs[:max_tokens], "length", versions)
