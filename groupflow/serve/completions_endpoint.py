"""``/v1/completions``: text or token-id prompts sampled and answered (whole or as server-sent
events), with ``echo`` and OpenAI's legacy ``logprobs``.

Design decision: a mixin of ``ServerCore`` (``serve.core``), as ``chat_endpoint`` is: the
endpoint's request-to-answer path in one place, the shared steps on the core. All prompts of a
request are queued together (they share engine calls), and choice ``i·n + j`` is prompt i's
sample j, streamed or not.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, cast

from groupflow.serve.access import CallRecord
from groupflow.serve.answers import (
    TextStream,
    deltas,
    gather_all,
    next_id,
    sse,
    stream_error,
    unsent,
    usage_of,
)
from groupflow.serve.batcher import Completion
from groupflow.serve.endpoint_core import EndpointCore
from groupflow.serve.errors import ApiError
from groupflow.serve.protocol import CompletionRequest
from groupflow.serve.scoring import ScoreJob, TokenScores

__all__ = ["CompletionEndpoints", "encode"]


class CompletionEndpoints(EndpointCore):
    """``ServerCore``'s legacy completions endpoint (see the module docstring)."""

    async def complete(self, key: str | None, req: CompletionRequest) -> dict[str, Any]:
        prompts, texts, settings, seeds = await self._completion_prompts(key, req)
        if req.max_tokens == 0:  # echo only: the prompt scored, nothing sampled
            sampled = [[Completion([], [], "length")] * req.n for _ in prompts]
        else:  # all prompts of the request in flight together: they share engine calls
            jobs = [(ids, p, req.n, s, None) for ids, p, s in zip(prompts, settings, seeds)]
            sampled = await gather_all(self._enqueue(key, jobs, _batch_param(req)))
        scores = await self._completion_scores(req, prompts, settings, sampled)
        return self._completion_answer(key, req, prompts, texts, settings, sampled, scores)

    async def complete_stream(self, key: str | None, req: CompletionRequest, usage: bool):
        """The completion as server-sent events, token by token as ``chat_stream`` streams (a
        bad request or a full queue raises ``ApiError`` before the stream starts). Choice
        ``i·n + j`` is prompt i's sample j, as in the non-streamed answer."""
        if req.max_tokens == 0:
            raise ApiError(400, "max_tokens: 0 (score the prompt only) is not streamed",
                           "stream")  # fmt: skip
        prompts, texts, settings, seeds = await self._completion_prompts(key, req)
        arrived: list[tuple[int, list[int]]] = []
        wake = asyncio.Event()

        def listener(first: int):
            def hear(j: int, ids: list[int]) -> None:
                arrived.append((first + j, ids))
                wake.set()

            return hear

        jobs = [
            (ids, p, req.n, seed, listener(i * req.n))
            for i, (ids, p, seed) in enumerate(zip(prompts, settings, seeds))
        ]  # fmt: skip
        task = asyncio.ensure_future(gather_all(self._enqueue(key, jobs, _batch_param(req))))
        task.add_done_callback(lambda _: wake.set())
        return self._completion_events(key, req, prompts, texts, settings, task, arrived, wake,
                                       usage)  # fmt: skip

    async def _completion_events(self, key, req: CompletionRequest, prompts, prompt_texts,
                                 settings, task, arrived: list, wake: asyncio.Event,
                                 usage: bool):  # fmt: skip
        try:
            head = {"id": f"cmpl-{next_id()}", "object": "text_completion",
                    "created": int(time.time()), "model": self.model_name}  # fmt: skip
            texts = [TextStream(self.tokenizer, p.stop) for p in settings for _ in range(req.n)]
            if req.echo:  # the prompt first, as the answer's text begins with it
                for i, text in enumerate(prompt_texts):
                    for j in range(req.n):
                        yield sse({**head, "choices": [{"index": i * req.n + j, "text": text,
                                   "logprobs": None, "finish_reason": None}]})  # fmt: skip
            async for j, delta in deltas(task, arrived, wake, texts):
                yield sse({**head, "choices": [{"index": j, "text": delta, "logprobs": None,
                                                "finish_reason": None}]})  # fmt: skip
            try:
                sampled = task.result()
                scores = await self._completion_scores(req, prompts, settings, sampled)
                out = self._completion_answer(key, req, prompts, prompt_texts, settings, sampled,
                                              scores)  # fmt: skip
            except Exception as exc:
                # the stream has started (status 200): the error is its last event
                yield stream_error(exc)
                yield "data: [DONE]\n\n"
                return
            for ch in out["choices"]:
                sent = prompt_texts[ch["index"] // req.n] + texts[ch["index"]].sent
                rest = unsent(ch["text"], sent)
                # the last chunk of a choice: the rest of its text, why it ended, and the extra
                # fields of the non-streamed choice (token ids, their log-probs, the prompt's ids)
                yield sse({**head, "choices": [{**ch, "text": rest}]})
            if usage:
                yield sse({**head, "choices": [], "usage": out["usage"]})
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the stream is closed early): its rows stop decoding
            if not task.done():
                task.cancel()

    async def _completion_prompts(self, key: str | None, req: CompletionRequest):
        """The request's prompt ids and texts, sampling settings and seeds, checked
        (``ApiError``); text prompts are tokenized off the event loop when long."""
        if req.max_tokens == 0 and not req.echo:
            raise ApiError(400, "max_tokens: 0 samples nothing; with echo: true it scores the "
                           "prompt", "max_tokens")  # fmt: skip
        strings = _prompt_strings(req.prompt)
        chars = 0
        for i, text in enumerate(strings):
            if text is not None:
                self._check_chars(len(text), _prompt_index(req, i))
                chars += len(text)
        prompts = await self._off_loop(chars, _prompt_ids, req.prompt, self.tokenizer)
        vocab = len(self.tokenizer)
        for i, ids in enumerate(prompts):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})",
                               f"prompt.{i}")  # fmt: skip
        if req.echo:
            texts = [
                t if t is not None else self.tokenizer.decode(ids, skip_special_tokens=True)
                for t, ids in zip(strings, prompts)
            ]  # fmt: skip
        else:
            texts = [""] * len(prompts)
        settings = [self._params(key, req, req.max_tokens, len(i), "max_tokens") for i in prompts]
        seeds = [None if req.seed is None else req.seed + i * req.n for i in range(len(prompts))]
        return prompts, texts, settings, seeds

    async def _completion_scores(self, req: CompletionRequest, prompts, settings,
                                 sampled) -> list[list[TokenScores]] | None:  # fmt: skip
        """The scoring forward, when the answer needs one: ``echo`` with ``logprobs`` (the
        prompt's own tokens), or ``logprobs`` > 0 (alternatives). Per prompt, per choice."""
        k = req.logprobs or 0
        if req.logprobs is None or not (req.echo or k):
            return None
        jobs = [
            ScoreJob(ids + c.ids, len(ids), p.temperature, 1 if req.echo else len(ids))
            for ids, p, completions in zip(prompts, settings, sampled) for c in completions
        ]  # fmt: skip
        flat = await self._scores(jobs, k, "echo" if req.echo else "logprobs")
        return [flat[i * req.n : (i + 1) * req.n] for i in range(len(prompts))]

    def _completion_answer(self, key: str | None, req: CompletionRequest, prompts, prompt_texts,
                           settings, sampled: list[list[Completion]],
                           scores: list[list[TokenScores]] | None = None) -> dict[str, Any]:  # fmt: skip
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for i, (ids, params, completions) in enumerate(zip(prompts, settings, sampled)):
            texts = [self._text(c.ids, params.stop) for c in completions]
            self.access.record(key, CallRecord(ids, completions, None, list(texts)))
            for j, (c, text) in enumerate(zip(completions, texts)):
                lp = None
                if req.logprobs is not None:
                    lp = self._legacy_logprobs(
                        req, ids, c, None if scores is None else scores[i][j]
                    )
                choices.append({
                    "index": i * req.n + j, "text": prompt_texts[i] + text,
                    "finish_reason": c.finish, "logprobs": lp, "token_ids": c.ids,
                    "token_logprobs": c.logprobs, "prompt_token_ids": ids,
                })  # fmt: skip
            u = usage_of(len(ids), completions)
            usage = {k: usage[k] + u[k] for k in usage}
        return {"id": f"cmpl-{next_id()}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": choices,
                "usage": usage}  # fmt: skip

    def _legacy_logprobs(self, req: CompletionRequest, prompt: list[int], c: Completion,
                         scores: TokenScores | None) -> dict[str, Any]:  # fmt: skip
        """A completion choice's ``logprobs`` (OpenAI's legacy shape): the sampled tokens, after
        the prompt's with ``echo`` (whose first token nothing predicts: None)."""
        k = req.logprobs or 0
        ids = (prompt if req.echo else []) + c.ids
        toks = [self._token(t) for t in ids]
        if scores is None:  # no scoring forward: the sampler's own numbers
            lps: list[float | None] = list(c.logprobs)
            top = None
        else:
            lps = ([None] if req.echo else []) + list(scores.logprobs)
            top = None
            if k:
                scored = ids[1:] if req.echo else ids
                top = ([None] if req.echo else []) + [
                    self._top(pairs[:k], t, v)
                    for pairs, t, v in zip(scores.top, scored, scores.logprobs)
                ]  # fmt: skip
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": top,
                "text_offset": _offsets(toks)}  # fmt: skip

    def _top(self, pairs: list[tuple[int, float]], tid: int, lp: float) -> dict[str, float]:
        """Legacy completions' alternatives: the k likeliest tokens and the token itself (as
        vLLM's), by text; two ids decoding alike keep the larger log-prob."""
        out: dict[str, float] = {}
        for t, v in [*pairs, (tid, lp)]:
            s = self._token(t)
            out[s] = max(v, out.get(s, -math.inf))
        return out


def _batch_param(req: CompletionRequest) -> str:
    """The field that makes a completion request large: its prompts, or ``n``."""
    return "prompt" if len(_prompt_strings(req.prompt)) > 1 else "n"


def _prompt_index(req: CompletionRequest, i: int) -> str:
    return "prompt" if isinstance(req.prompt, str) else f"prompt.{i}"


def _prompt_strings(prompt) -> list[str | None]:
    """Each prompt of a completion request as text (None: given as token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(t, int) for t in prompt):
        return [None]
    return [p if isinstance(p, str) else None for p in prompt]


def encode(tokenizer, text: str, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _prompt_ids(prompt: str | list[str] | list[int] | list[list[int]],
                tokenizer) -> list[list[int]]:  # fmt: skip
    if isinstance(prompt, str):
        prompt = [prompt]
    if all(isinstance(t, int) for t in prompt):
        return [list(cast(list[int], prompt))]  # one prompt's token ids
    # else texts and token-id lists: the request model's prompt types have no other items
    return [list(p) if isinstance(p, list) else encode(tokenizer, cast(str, p)) for p in prompt]


def _offsets(tokens: list[str]) -> list[int]:
    out, pos = [], 0
    for t in tokens:
        out.append(pos)
        pos += len(t)
    return out
