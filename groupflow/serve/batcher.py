"""The dynamic batcher: concurrent requests share one engine call, so they share decode steps.

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
keeps accepting requests. This is request-level batching, not continuous batching: a request
that arrives mid-call waits for that call to end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from groupflow.batch import Batch
from groupflow.rollout.batching import prompts_batch
from groupflow.rollout.hf import GenerationOutput, SamplingParams

__all__ = [
    "Completion",
    "GenerateFn",
    "DynamicBatcher",
    "Overloaded",
    "engine_generate",
    "group_generate",
]


@dataclass(frozen=True)
class Completion:
    ids: list[int]  # sampled ids, the EOS or stop string included
    logprobs: list[float]  # their sampling log-probs
    finish: str  # "stop" (EOS or a stop string) or "length"


# prompts, params (n = 1), one seed per prompt -> one completion per prompt
GenerateFn = Callable[[list[list[int]], SamplingParams, list[int]], list[Completion]]


class Overloaded(RuntimeError):
    """More samples are waiting than ``max_pending_samples``."""


def _completions(responses, mask, logprobs, finishes: Sequence[str]) -> list[Completion]:
    out = []
    for k in range(responses.shape[0]):
        m = mask[k].bool()
        out.append(Completion(responses[k][m].tolist(), logprobs[k][m].tolist(), finishes[k]))
    return out


def engine_generate(engine) -> GenerateFn:
    """A ``RolloutEngine`` (``groupflow.rollout.engine``) as the batcher's generate function."""

    def generate(prompts, params, seeds):
        out: GenerationOutput = engine.generate(prompts, params, seeds=seeds)
        return _completions(out.responses, out.response_mask, out.logprobs, out.finish_reasons)

    return generate


def group_generate(group) -> GenerateFn:
    """A policy's rollout worker group (``policy.rollout``: local or Ray, any engine)."""

    def generate(prompts, params, seeds):
        batch = prompts_batch(prompts, [[s] for s in seeds], list(range(len(prompts))))
        out: Batch = group.generate(batch, params, 0)
        return _completions(
            out["responses"], out["response_mask"], out["rollout_logprobs"], out["finish_reason"]
        )

    return generate


@dataclass
class _Pending:
    prompts: list[list[int]]
    params: SamplingParams  # n = 1
    seeds: list[int]
    future: asyncio.Future


def _sampling_key(p: SamplingParams) -> SamplingParams:
    """What must agree for requests to share an engine call (``max_new_tokens`` need not)."""
    return dataclasses.replace(p, max_new_tokens=1, n=1)


class DynamicBatcher:
    """``await submit(prompts, params, seeds)`` → completions; see the module docstring."""

    def __init__(self, generate: GenerateFn, *, max_batch_samples: int = 64,
                 max_pending_samples: int = 1024, wait_s: float = 0.005):  # fmt: skip
        self.generate = generate
        self.max_batch_samples, self.max_pending_samples = max_batch_samples, max_pending_samples
        self.wait_s = wait_s
        self.expected: Callable[[], int] | None = None  # requests to wait for (see _gather)
        self._queue: list[_Pending] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="groupflow-decode")
        self.engine_calls = 0
        self.samples = 0
        self.engine_seconds = 0.0  # wall time inside the engine (the rest is HTTP and clients)

    @property
    def pending_samples(self) -> int:
        return sum(len(p.prompts) for p in self._queue)

    async def submit(self, prompts: list[list[int]], params: SamplingParams,
                     seeds: list[int]) -> list[Completion]:  # fmt: skip
        if len(prompts) != len(seeds):
            raise ValueError(f"submit: {len(prompts)} prompts but {len(seeds)} seeds")
        if self.pending_samples + len(prompts) > self.max_pending_samples:
            raise Overloaded(
                f"{self.pending_samples} samples are waiting (serve.max_pending_samples="
                f"{self.max_pending_samples}); retry later"
            )
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run())
        item = _Pending([list(p) for p in prompts], dataclasses.replace(params, n=1),
                        list(seeds), loop.create_future())  # fmt: skip
        self._queue.append(item)
        self._wake.set()
        return await item.future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._gather()
            while self._queue:
                group = self._take()
                prompts = [p for item in group for p in item.prompts]
                seeds = [s for item in group for s in item.seeds]
                width = max(item.params.max_new_tokens for item in group)
                params = dataclasses.replace(group[0].params, max_new_tokens=width)
                start = time.perf_counter()
                try:
                    outs = await loop.run_in_executor(
                        self._executor, self.generate, prompts, params, seeds
                    )
                except Exception as exc:  # every waiting request gets the engine's error
                    for item in group:
                        if not item.future.done():
                            item.future.set_exception(exc)
                    continue
                self.engine_seconds += time.perf_counter() - start
                self.engine_calls += 1
                self.samples += len(prompts)
                first = 0
                for item in group:
                    mine = outs[first : first + len(item.prompts)]
                    first += len(item.prompts)
                    if not item.future.done():  # the client may have gone
                        item.future.set_result([_cut(c, item.params.max_new_tokens) for c in mine])
                await self._gather()  # the answered conversations' next calls are on their way

    async def _gather(self) -> None:
        """Requests sent together arrive a moment apart (each client builds its own): wait while
        they keep coming — until ``wait_s`` passes without one, the batch is full, or
        ``10 × wait_s`` in all. With ``expected`` (a training run: its open episodes, each of
        which will send a request), until that many are queued, or ``4 × wait_s`` without a new
        one, or ``20 × wait_s``."""
        quiet, limit = (4, 20) if self.expected is not None else (1, 10)
        waited, since = 0.0, 0.0
        seen = self.pending_samples
        while waited < limit * self.wait_s and since < quiet * self.wait_s:
            pending = self.pending_samples
            if pending >= self.max_batch_samples or (
                self.expected is not None and pending >= self.expected()
            ):
                return
            await asyncio.sleep(self.wait_s)
            waited += self.wait_s
            since = 0.0 if self.pending_samples != seen else since + self.wait_s
            seen = self.pending_samples

    def _take(self) -> list[_Pending]:
        """The oldest request and the queued ones that sample like it, up to the batch size."""
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
    return Completion(c.ids[:max_tokens], c.logprobs[:max_tokens], "length")
