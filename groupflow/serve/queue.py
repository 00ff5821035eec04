"""What both batchers share: the completion a request gets, its queue entry, the room check and
the wait for a burst of requests.

Design decision: the two batchers (``serve.batcher.DynamicBatcher``, per engine call, and
``serve.continuous_batcher.ContinuousBatcher``, decode-step by decode-step) differ in how they
decode and agree on everything a request meets before that — the checks on ``submit``, the
``Overloaded`` answer past ``max_pending_samples``, and the short wait that lets agents started
together arrive as one batch — so those live here once, as functions over either batcher.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from groupflow.rollout.engines.hf import SamplingParams

__all__ = [
    "Batcher",
    "Completion",
    "GenerateFn",
    "Listener",
    "Overloaded",
    "Pending",
    "Unsupported",
    "check_room",
    "gather",
    "pending_entry",
    "waiting",
]


@dataclass(frozen=True)
class Completion:
    ids: list[int]  # sampled ids, the EOS or stop string included
    logprobs: list[float]  # their sampling log-probs
    finish: str  # "stop" (EOS or a stop string) or "length"
    versions: list[int] | None = None  # in-flight updates: the version that sampled each id


# prompts, params (n = 1), one seed per prompt -> one completion per prompt
GenerateFn = Callable[[list[list[int]], SamplingParams, list[int]], list[Completion]]
# (sample index within the request, its newly decoded ids), called on the event loop
Listener = Callable[[int, list[int]], None]


class Overloaded(RuntimeError):
    """More samples are waiting than ``max_pending_samples``."""


class Unsupported(RuntimeError):
    """The batcher's engine cannot do this (a scoring forward without a model in this process)."""


@dataclass(eq=False)  # hashed by identity: the continuous decoder's row tags
class Pending:
    prompts: list[list[int]]
    params: SamplingParams  # n = 1
    seeds: list[int]
    future: asyncio.Future
    listener: Listener | None = None
    results: list[Completion | None] = dataclasses.field(default_factory=list)


def waiting(items: list[Pending]) -> int:
    """Samples of ``items`` someone still waits for."""
    return sum(len(p.prompts) for p in items if not p.future.cancelled())


class Batcher:
    """The interface both batchers give alike (see the module docstring): ``submit`` is
    ``enqueue`` awaited, and a request's room in the queue is checked the same way; each
    batcher queues (``enqueue``) and decodes in its own way."""

    def enqueue(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int],
                listener: Listener | None = None) -> asyncio.Future:  # fmt: skip
        """The future of the request's completions, queued now (each batcher's own)."""
        raise NotImplementedError

    def check_room(self, samples: int) -> None:
        """``Overloaded`` unless ``samples`` more fit in the queue now."""
        check_room(self, samples)

    async def submit(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int],
                     listener: Listener | None = None) -> list[Completion]:  # fmt: skip
        """The completions (``enqueue``, awaited)."""
        return await self.enqueue(prompts, params, seeds, listener)


def check_room(batcher, samples: int) -> None:
    waiting = batcher.pending_samples
    if waiting + samples > batcher.max_pending_samples:
        raise Overloaded(
            f"{waiting} samples are waiting and this request adds {samples} "
            f"(serve.max_pending_samples={batcher.max_pending_samples}); retry later"
        )


def pending_entry(batcher, prompts, params: SamplingParams, seeds, listener) -> Pending:
    """A request's queue entry, after the checks every batcher makes."""
    if len(prompts) != len(seeds):
        raise ValueError(f"submit: {len(prompts)} prompts but {len(seeds)} seeds")
    check_room(batcher, len(prompts))
    future = asyncio.get_running_loop().create_future()
    return Pending([list(p) for p in prompts], dataclasses.replace(params, n=1), list(seeds),
                    future, listener, [None] * len(prompts))  # fmt: skip


async def gather(batcher) -> None:
    """Requests sent together arrive a moment apart (each client builds its own): wait while
    they keep coming — until ``wait_s`` passes without one, the batch is full, or
    ``10 × wait_s`` in all. With ``expected`` (a training run: its open episodes, each of
    which will send a request), until that many are queued, or ``4 × wait_s`` without a new
    one, or ``20 × wait_s``. Each arrival wakes the wait (``submit`` sets ``_wake``), so the
    batch starts as soon as it is complete, not at the next poll."""
    b = batcher
    quiet, limit = (4, 20) if b.expected is not None else (1, 10)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit * b.wait_s
    while True:
        pending = b.pending_samples
        if pending >= b.max_batch_samples or (b.expected is not None and pending >= b.expected()):
            return
        timeout = min(quiet * b.wait_s, deadline - loop.time())
        if timeout <= 0:
            return
        b._wake.clear()  # nothing arrives between the count above and this (one event loop)
        try:
            await asyncio.wait_for(b._wake.wait(), timeout)
        except TimeoutError:
            return
