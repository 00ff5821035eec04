"""serve.queue: what both batchers check and count alike, on a stand-in batcher."""

from __future__ import annotations

import asyncio
import time

import pytest

from groupflow.rollout.engines.hf import SamplingParams
from groupflow.serve.queue import Overloaded, check_room, gather, pending_entry, waiting


class Stub:
    """The attributes the queue functions read off a batcher."""

    def __init__(self, max_pending: int = 4, wait_s: float = 0.01, expected=None):
        self.queue: list = []
        self.max_pending_samples, self.max_batch_samples = max_pending, 64
        self.wait_s, self.expected = wait_s, expected
        self._wake = asyncio.Event()

    @property
    def pending_samples(self) -> int:
        return waiting(self.queue)


def test_an_entry_has_one_seed_per_prompt_and_n_1():
    async def go():
        b = Stub()
        entry = pending_entry(b, [[1, 2], [3]], SamplingParams(n=4), [7, 8], None)
        assert entry.params.n == 1 and entry.results == [None, None]
        with pytest.raises(ValueError, match="2 prompts but 1 seeds"):
            pending_entry(b, [[1], [2]], SamplingParams(), [7], None)

    asyncio.run(go())


def test_a_request_past_max_pending_samples_is_overloaded_and_cancelled_ones_do_not_count():
    async def go():
        b = Stub(max_pending=3)
        b.queue = [pending_entry(b, [[1], [2]], SamplingParams(), [0, 1], None)]
        with pytest.raises(
            Overloaded, match=r"2 samples are waiting .* adds 2 .*max_pending_samples=3"
        ):
            check_room(b, 2)
        b.queue[0].future.cancel()
        assert b.pending_samples == 0
        check_room(b, 3)

    asyncio.run(go())


def test_the_burst_wait_ends_once_the_expected_requests_are_queued_else_after_the_quiet_time():
    async def go():
        b = Stub(wait_s=0.05, expected=lambda: 1)
        b.queue = [pending_entry(b, [[1]], SamplingParams(), [0], None)]
        start = time.perf_counter()
        await gather(b)  # one expected, one queued: no wait
        assert time.perf_counter() - start < 0.04
        b.expected = None
        start = time.perf_counter()
        await gather(b)  # nothing arrives: wait_s of quiet
        assert 0.04 <= time.perf_counter() - start < 0.5

    asyncio.run(go())
