"""The batchers: concurrent requests share decode steps — continuously (HF) or per engine call.

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
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

from groupflow.batch import Batch
from groupflow.rollout.engines.batching import prompts_batch
from groupflow.rollout.engines.continuous import ContinuousDecoder, Finished, continuous_reason
from groupflow.rollout.engines.hf import GenerationOutput, SamplingParams
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


@dataclass(eq=False)  # hashed by identity: the continuous decoder's row tags
class _Pending:
    prompts: list[list[int]]
    params: SamplingParams  # n = 1
    seeds: list[int]
    future: asyncio.Future
    listener: Listener | None = None
    results: list[Completion | None] = dataclasses.field(default_factory=list)


def _waiting(items: list[_Pending]) -> int:
    """Samples of ``items`` someone still waits for."""
    return sum(len(p.prompts) for p in items if not p.future.cancelled())


def _sampling_key(p: SamplingParams) -> SamplingParams:
    """What must agree for requests to share an engine call (``max_new_tokens`` need not)."""
    return dataclasses.replace(p, max_new_tokens=1, n=1)


class _Batcher:
    """The interface both batchers give alike (see the module docstring): ``submit`` is
    ``enqueue`` awaited, and a request's room in the queue is checked the same way; each
    batcher queues (``enqueue``) and decodes in its own way."""

    def enqueue(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int],
                listener: Listener | None = None) -> asyncio.Future:  # fmt: skip
        """The future of the request's completions, queued now (each batcher's own)."""
        raise NotImplementedError

    def check_room(self, samples: int) -> None:
        """``Overloaded`` unless ``samples`` more fit in the queue now."""
        _check_room(self, samples)

    async def submit(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int],
                     listener: Listener | None = None) -> list[Completion]:  # fmt: skip
        """The completions (``enqueue``, awaited)."""
        return await self.enqueue(prompts, params, seeds, listener)


class DynamicBatcher(_Batcher):
    """``await submit(prompts, params, seeds)`` → completions; see the module docstring."""

    def __init__(self, generate: GenerateFn, *, score: ScoreFn | None = None,
                 max_batch_samples: int = 64, max_pending_samples: int = 1024,
                 wait_s: float = 0.005):  # fmt: skip
        self.generate, self.score_fn = generate, score
        self.max_batch_samples, self.max_pending_samples = max_batch_samples, max_pending_samples
        self.wait_s = wait_s
        self.expected: Callable[[], int] | None = None  # requests to wait for (see _gather)
        self._queue: list[_Pending] = []
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
        return _waiting(self._queue)

    def enqueue(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int],
                listener: Listener | None = None) -> asyncio.Future:  # fmt: skip
        """Queue a request now (``Overloaded`` when it does not fit) and return the future of its
        completions; ``listener`` gets each sample's ids when its engine call ends. Cancelling
        the future takes the request out of the queue."""
        item = _pending(self, prompts, params, seeds, listener)
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
            await self._gather()
            while self._queue:
                group = self._take()
                if group:
                    await self._call(loop, group)
                await self._gather()  # the answered conversations' next calls are on their way

    async def _call(self, loop, group: list[_Pending]) -> None:
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

    async def _gather(self) -> None:
        await _gather(self)

    def _take(self) -> list[_Pending]:
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


def _check_room(batcher, samples: int) -> None:
    waiting = batcher.pending_samples
    if waiting + samples > batcher.max_pending_samples:
        raise Overloaded(
            f"{waiting} samples are waiting and this request adds {samples} "
            f"(serve.max_pending_samples={batcher.max_pending_samples}); retry later"
        )


def _pending(batcher, prompts, params: SamplingParams, seeds, listener) -> _Pending:
    """A request's queue entry, after the checks every batcher makes."""
    if len(prompts) != len(seeds):
        raise ValueError(f"submit: {len(prompts)} prompts but {len(seeds)} seeds")
    _check_room(batcher, len(prompts))
    future = asyncio.get_running_loop().create_future()
    return _Pending([list(p) for p in prompts], dataclasses.replace(params, n=1), list(seeds),
                    future, listener, [None] * len(prompts))  # fmt: skip


async def _gather(batcher) -> None:
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


class ContinuousBatcher(_Batcher):
    """``await submit(prompts, params, seeds, listener)`` → completions, decoded by a
    ``ContinuousDecoder`` on a thread of its own (see the module docstring).

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
        self._queue: list[_Pending] = []  # on the event loop, not yet handed to the thread
        self._inbox: list[_Pending] = []  # handed over (under _cv), not yet decoding
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
        return _waiting(self._queue) + _waiting(self._inbox)

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens the decoder's prefix cache spared prefilling."""
        return self.decoder.reused_tokens

    def enqueue(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int],
                listener: Listener | None = None) -> asyncio.Future:  # fmt: skip
        """Queue a request now (``Overloaded`` when it does not fit) and return the future of its
        completions; ``listener`` gets each sample's ids as they are decoded. Cancelling the
        future drops the request, its rows within a few decode steps."""
        item = _pending(self, prompts, params, seeds, listener)
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
                await _gather(self)
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

    def _join(self, admit: list[_Pending]) -> tuple[list, list[Finished]]:
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

    def _admit(self) -> list[_Pending]:
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


def _cut(c: Completion, max_tokens: int) -> Completion:
    """A completion decoded in a call for longer requests, cut back to its own limit."""
    if len(c.ids) <= max_tokens:
        return c
    versions = None if c.versions is None else c.versions[:max_tokens]
    return Completion(c.ids[:max_tokens], c.logprobs[:max_tokens], "length", versions)
