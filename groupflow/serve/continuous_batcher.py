"""The continuous batcher: requests join the running decode at its next step and leave when they
end, so a request never waits for another request's tokens.

Design decision: the HF engine's model (one a ``ContinuousDecoder`` supports,
``rollout.continuous``) is driven from one decode thread of the batcher's own, which takes each
request that arrived during a step into the next one and hands each request its tokens as they
are decoded (token-by-token streaming); the event loop only queues requests and delivers results
(``call_soon_threadsafe``). A failed join fails only the requests that fail alone, and a request
whose future is cancelled (its client went away) has its rows dropped mid-decode.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import cast

from groupflow.rollout.engines.continuous import ContinuousDecoder, Finished
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.serve.queue import (
    Batcher,
    Completion,
    Listener,
    Pending,
    gather,
    pending_entry,
    waiting,
)
from groupflow.serve.scoring import ScoreFn, ScoreJob, TokenScores, model_scorer

__all__ = ["ContinuousBatcher"]


class ContinuousBatcher(Batcher):
    """``await submit(prompts, params, seeds, listener)`` → completions, decoded by a
    ``ContinuousDecoder`` on a thread of its own (see ``serve.batcher``'s docstring).

    An idle decoder waits for a burst of requests as ``DynamicBatcher`` does (one prefill for
    all of them); a busy one takes every request that arrived during a step into the next one.
    ``engine_calls`` counts prefills (the times requests joined), ``samples`` the samples
    decoded, ``engine_seconds`` the decode thread's busy time, ``reused_tokens`` the prompt
    tokens the decoder's prefix cache spared. The decoder's row slots grow to
    ``max_batch_samples``; its buffer is freed after ``release_s`` without a request (kept
    between an agent's calls, given back while a trainer updates the model). ``between``: called
    on the decode thread before every join and step; it may load newer weights into the model
    in place and answers their version (recorded per token) or None (in-flight weight updates:
    ``HFEngine.take_update``)."""

    def __init__(self, decoder: ContinuousDecoder, *, score: ScoreFn | None = None,
                 max_batch_samples: int = 64, max_pending_samples: int = 1024,
                 wait_s: float = 0.005, release_s: float = 2.0,
                 between: Callable[[], int | None] | None = None):  # fmt: skip
        self.decoder, self.between = decoder, between
        self.score_fn = score or model_scorer(decoder.model, decoder.pad_id)
        decoder.max_rows = max_batch_samples
        self.release_s = release_s
        self.max_batch_samples, self.max_pending_samples = max_batch_samples, max_pending_samples
        self.wait_s = wait_s
        self.expected: Callable[[], int] | None = None
        self._queue: list[Pending] = []  # on the event loop, not yet handed to the thread
        self._inbox: list[Pending] = []  # handed over (under _cv), not yet decoding
        self._jobs: list[tuple] = []  # (fn, args, future): run on the decode thread (under _cv)
        self._cv = threading.Condition()
        self._busy = False  # the thread has rows or an inbox (under _cv)
        self._closed = False
        self._wake = asyncio.Event()  # replaced for each event loop that runs the batcher
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.engine_calls = 0
        self.samples = 0
        self.engine_seconds = 0.0
        self.decoded_tokens = 0  # tokens sampled (rows dropped mid-decode count what they got)

    @property
    def pending_samples(self) -> int:
        return waiting(self._queue) + waiting(self._inbox)

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens the decoder's prefix cache spared prefilling."""
        return self.decoder.reused_tokens

    def enqueue(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int],
                listener: Listener | None = None) -> asyncio.Future:  # fmt: skip
        """Queue a request now (``Overloaded`` when it does not fit) and return the future of its
        completions; ``listener`` gets each sample's ids as they are decoded. Cancelling the
        future drops the request, its rows within a few decode steps."""
        item = pending_entry(self, prompts, params, seeds, listener)
        self._start()
        self._queue.append(item)
        self._wake.set()
        return item.future

    async def score(self, jobs: list[ScoreJob], k: int) -> list[TokenScores]:
        """A scoring forward (``serve.scoring``) on the decode thread, between two steps."""
        self._start()
        assert self._loop is not None, "_start sets the loop"
        future = self._loop.create_future()
        with self._cv:
            self._jobs.append((self.score_fn, (jobs, k), future))
            self._cv.notify()
        return await future

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop, self._wake = loop, asyncio.Event()
            self._task = loop.create_task(self._run())
        if self._thread is None:
            self._thread = threading.Thread(target=self._decode_loop, daemon=True,
                                            name="groupflow-decode")  # fmt: skip
            self._thread.start()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            with self._cv:
                busy = self._busy
            if not busy:  # a fresh burst: let it arrive, so one prefill takes it
                await gather(self)
            with self._cv:
                self._inbox += self._queue
                self._queue = []
                self._busy = True
                self._cv.notify()

    def _decode_loop(self) -> None:
        model = self.decoder.model
        was_training: bool | None = None
        steps = 0
        while True:
            with self._cv:
                while (not self._inbox and not self.decoder.active and not self._jobs
                       and not self._closed):  # fmt: skip
                    if was_training is not None:  # idle: give the model back as it was
                        model.train(was_training)
                        was_training = None
                    self._busy = False
                    if not self._cv.wait(self.release_s if self.decoder.slots else None):
                        self.decoder.release()  # idle for release_s: the buffer's memory back
                if self._closed:
                    return
                admit = self._admit()
                jobs, self._jobs = self._jobs, []
            if was_training is None:
                was_training = model.training
                model.eval()
            start = time.perf_counter()
            for fn, args, future in jobs:  # scoring forwards, between two steps
                self._run_job(fn, args, future)
            progress: list = []
            finished: list[Finished] = []
            try:
                if self.between is not None and (admit or self.decoder.active):
                    version = self.between()
                    if version is not None:
                        self.decoder.version = version
                if admit:
                    p, f = self._join(admit)
                    progress += p
                    finished += f
                elif self.decoder.active:
                    steps += 1
                    if steps % 8 == 0:  # a client that went (or an agent timed out) frees its rows
                        self.decoder.drop(lambda tag: cast(tuple, tag)[0].future.cancelled())
                    progress, finished = self.decoder.step()
                    self.decoded_tokens += len(progress)
            except Exception as exc:  # a failed step: its error goes to every row's request
                failed = {item for item, _ in _tags(self.decoder.reset())}
                self._post(self._fail, failed, exc)
                continue
            finally:
                self.engine_seconds += time.perf_counter() - start
            with self._cv:
                idle = not self._inbox and not self.decoder.active
            if idle:  # the model back as it was before the answers go out (the trainer may
                model.train(was_training)  # use it as soon as its episodes are answered)
                was_training = None
            progress = [(tag, t) for tag, t in progress if tag[0].listener is not None]
            if progress or finished:
                self._post(self._deliver, progress, finished)

    def _join(self, admit: list[Pending]) -> tuple[list, list[Finished]]:
        """Prefill the admitted requests into the running decode. If that fails, each request
        alone: a failed join leaves the live rows as they were (``ContinuousDecoder.add`` changes
        them only once the new rows are prefilled), so one request's bad input fails only it."""
        rows = [(item, j) for item in admit for j in range(len(item.prompts))]
        live = len(self.decoder.rows)
        try:
            progress, finished = self.decoder.add(
                [item.prompts[j] for item, j in rows], [item.params for item, _ in rows],
                [item.seeds[j] for item, j in rows], rows,
            )  # fmt: skip
        except Exception as exc:
            if len(self.decoder.rows) != live:  # it failed while joining: the batch is unknown
                failed = {item for item, _ in _tags(self.decoder.reset())} | set(admit)
                self._post(self._fail, failed, exc)
                return [], []
            if len(admit) == 1:
                self._post(self._fail, admit, exc)
                return [], []
            progress, finished = [], []
            for item in admit:
                p, f = self._join([item])
                progress += p
                finished += f
            return progress, finished
        self.engine_calls += 1
        self.samples += len(rows)
        self.decoded_tokens += len(progress)
        return progress, finished

    def _run_job(self, fn, args, future) -> None:
        try:
            result = fn(*args)
        except Exception as exc:
            self._post(_settle, future, None, exc)
        else:
            self._post(_settle, future, result, None)

    def _admit(self) -> list[Pending]:
        """The inbox's oldest requests that fit beside the running rows (at least one)."""
        room = self.max_batch_samples - self.decoder.active
        taken, size = 0, 0
        for item in self._inbox:
            if size + len(item.prompts) > room and (taken or self.decoder.active):
                break
            taken += 1
            size += len(item.prompts)
        admit, self._inbox = self._inbox[:taken], self._inbox[taken:]
        return [item for item in admit if not item.future.cancelled()]

    def _post(self, fn, *args) -> None:
        assert self._loop is not None, "the decode thread runs after _start"
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody waits for these
            pass

    @staticmethod
    def _deliver(progress, finished: list[Finished]) -> None:
        for (item, j), token in progress:
            if not item.future.done():
                item.listener(j, [token])
        for f in finished:
            item, j = cast(tuple, f.tag)  # (request, sample): the batcher's own tags
            item.results[j] = Completion(f.ids, f.logprobs, f.finish, f.versions)
            if not item.future.done() and all(r is not None for r in item.results):
                item.future.set_result(list(item.results))

    @staticmethod
    def _fail(items, exc: Exception) -> None:
        for item in items:
            if not item.future.done():
                item.future.set_exception(exc)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        with self._cv:
            self._closed = True
            self._cv.notify()


def _tags(tags: list) -> list[tuple]:
    """The decoder's row tags, which the continuous batcher makes (request, sample index)."""
    return cast(list[tuple], tags)


def _settle(future: asyncio.Future, result, exc: Exception | None) -> None:
    if future.done():  # cancelled: nobody waits
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
