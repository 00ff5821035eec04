"""The FastAPI app: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

Design decision: the HTTP layer is FastAPI/Starlette under uvicorn (a kept server stack, never
hand-written HTTP); everything it does besides parsing and answering is in ``ServerCore`` — one
object holding the tokenizer, the chat renderer, the batcher, the limits and an ``Access``
policy. ``Access`` is the seam between serving and training: ``OpenAccess`` (``groupflow
serve``: one optional API key, the request's sampling settings) or a training run's episode
recorder (one key per episode, the run's sampling settings, every call recorded) — the HTTP code
is the same for both. Errors are OpenAI-shaped JSON (``{"error": {"message", "type", "param",
"code"}}``) — a 4xx with the offending field in ``param``, a 404/405, an engine's 500 alike.
A request's samples are queued at once or not at all (``_enqueue``: 429 when the queue has no
room now), and a request whose client goes away is cancelled: a non-streamed one when the
disconnect arrives (``_answer``), a stream when its generator is closed — the batchers drop
cancelled requests' rows. Prompts longer than ``_INLINE_CHARS`` are rendered and tokenized on a
thread of their own, after a character cap (``ServeLimits.max_prompt_chars``), so a huge prompt
never stalls the event loop.

Streaming (``stream: true``) sends server-sent events in OpenAI's chunk formats (chat: role,
content, tool calls, finish reason, usage; completions: text, finish reason, usage). A chat
answer's content, and a completion's text, is sent as it is decoded — the batcher
hands over each token (``ContinuousBatcher``; ``DynamicBatcher`` all of them at the call's end)
and ``TextStream`` turns the ids so far into the text that can no longer change: whatever a stop
string could still cut, or an unfinished UTF-8 character, waits for the next token. Where the
request has tools, the content waits for the end (the parser must see the whole completion to
tell a call from text). The streamed pieces join to exactly the non-streamed message's content
(text); a choice's last chunk carries its finish reason and the non-streamed answer's extra
fields in full (``token_ids``, ``token_logprobs``; a completion's ``prompt_token_ids`` and
``logprobs``, a chat's prompt ids in the first chunk), so joining every chunk's ``token_ids``
gives the sampled ids either way.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import itertools
import json
import logging
import math
import random
import secrets
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from groupflow.rollout.engines.hf import SamplingParams
from groupflow.serve.batcher import (
    Completion,
    ContinuousBatcher,
    DynamicBatcher,
    Overloaded,
    Unsupported,
)
from groupflow.serve.chat import ChatPrompt, ChatPrompts
from groupflow.serve.protocol import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    content_text,
)
from groupflow.serve.scoring import ScoreJob, TokenScores

log = logging.getLogger("groupflow")

__all__ = [
    "ApiError",
    "ServeLimits",
    "CallRecord",
    "Access",
    "OpenAccess",
    "ServerCore",
    "build_app",
    "LOCAL_HOSTS",
    "TextStream",
]

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
_INLINE_CHARS = 4096  # prompts up to this many characters are tokenized on the event loop


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error"):  # fmt: skip
        if param and not message.startswith(param):
            message = f"{param}: {message}"  # the field first, as the validation errors say it
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def response(self) -> JSONResponse:
        return _error(self.status, self.message, self.param, self.kind)


def _error(status: int, message: str, param: str | None = None,
           kind: str = "invalid_request_error") -> JSONResponse:  # fmt: skip
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


@dataclass(frozen=True)
class ServeLimits:
    max_body_bytes: int = 1_000_000
    max_tokens: int = 1024  # one completion's tokens (a request asking more gets a 400)
    max_context_tokens: int = 4096  # prompt + completion
    max_n: int = 16  # choices per request
    max_conversations: int = 1024  # answered conversations remembered for continuation
    max_batch_samples: int = 64  # samples per engine call
    max_pending_samples: int = 1024  # samples waiting for the engine (beyond: 429)
    # a longer prompt (characters) is refused before it is tokenized; None: 16 per token of the
    # context (a prompt past the context length is refused anyway, after tokenizing)
    max_prompt_chars: int | None = None

    @property
    def prompt_chars(self) -> int:
        return self.max_prompt_chars or 16 * self.max_context_tokens


@dataclass
class CallRecord:
    """One engine call of a request, as sampled: what a training run records."""

    prompt_ids: list[int]
    completions: list[Completion]
    messages: list[dict[str, Any]] | None  # the request's messages (chat), None for /completions
    responses: list[dict[str, Any]] = field(default_factory=list)  # the assistant messages / texts
    tool_calls: int = 0  # over all choices


class Access(Protocol):
    def authorize(self, key: str | None) -> bool: ...

    def params(self, key: str | None, requested: SamplingParams) -> SamplingParams: ...

    def seeds(self, key: str | None, count: int, seed: int | None) -> list[int]: ...

    def record(self, key: str | None, call: CallRecord) -> None: ...

    def scripted(self, key: str | None, count: int) -> list[list[int]] | None:
        """Ids to answer with instead of sampling (a demonstration played through the agent),
        or None: sample."""
        ...


class OpenAccess:
    """``groupflow serve``: an optional API key, the request's own sampling, nothing recorded."""

    def __init__(self, api_key: str | None = None):
        self.api_key = api_key

    def authorize(self, key: str | None) -> bool:
        if not self.api_key:
            return True
        return key is not None and hmac.compare_digest(key.encode(), self.api_key.encode())

    def params(self, key, requested: SamplingParams) -> SamplingParams:
        return requested

    def seeds(self, key, count: int, seed: int | None) -> list[int]:
        if seed is None:
            return [random.getrandbits(62) for _ in range(count)]
        # choice j of a request seeded s: s + j, wrapped into [0, 2^63) — what every engine's
        # generator takes, for any 64-bit request seed (the request model checks the range)
        return [(seed + j) % 2**63 for j in range(count)]

    def record(self, key, call: CallRecord) -> None:
        return None

    def scripted(self, key, count: int) -> None:
        return None


class ServerCore:
    """What the endpoints do, HTTP aside (see the module docstring)."""

    def __init__(self, tokenizer, batcher: DynamicBatcher | ContinuousBatcher, defaults: SamplingParams, *,
                 model_name: str, limits: ServeLimits = ServeLimits(), access: Access | None = None,
                 tool_parser: str = "hermes", describe_tools: bool = True):  # fmt: skip
        self.tokenizer, self.batcher, self.defaults = tokenizer, batcher, defaults
        self.model_name, self.limits = model_name, limits
        self.access = access or OpenAccess()
        self.chat_prompts = None
        if getattr(tokenizer, "chat_template", None):
            self.chat_prompts = ChatPrompts(tokenizer, tool_parser, describe_tools=describe_tools,
                                            max_conversations=limits.max_conversations)  # fmt: skip
        self.created = int(time.time())
        # large prompts are rendered and tokenized here, off the event loop (one thread: the
        # tokenizer is not shared between two of our threads at once for long texts)
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="groupflow-tokenize")

    # ----- shared steps -----------------------------------------------------------------------
    async def _off_loop(self, chars: int, fn, *args):
        """``fn(*args)`` — inline for a short text (a thread hop costs more than it saves), else
        on the tokenizer thread, so a long prompt never stalls the event loop."""
        if chars <= _INLINE_CHARS:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, functools.partial(fn, *args))

    def _check_chars(self, chars: int, param: str) -> None:
        """A prompt of more characters than ``max_prompt_chars`` is refused before tokenizing."""
        cap = self.limits.prompt_chars
        if chars > cap:
            raise ApiError(400, f"the prompt has {chars} characters, this server takes at most "
                           f"{cap} (serve.max_prompt_chars)", param)  # fmt: skip

    def _params(self, key, req, max_tokens: int | None, prompt_len: int,
                token_param: str) -> SamplingParams:  # fmt: skip
        lim = self.limits
        if req.n > lim.max_n:
            raise ApiError(400, f"n={req.n} is above this server's limit {lim.max_n}", "n")
        if max_tokens is not None and max_tokens > lim.max_tokens:
            raise ApiError(400, f"{token_param}={max_tokens} is above this server's limit "
                           f"{lim.max_tokens}", token_param)  # fmt: skip
        room = lim.max_context_tokens - prompt_len
        if room < 1:
            raise ApiError(400, f"the prompt is {prompt_len} tokens, the context length is "
                           f"{lim.max_context_tokens}", _prompt_param(req))  # fmt: skip
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"{token_param}={max_tokens} plus the prompt's {prompt_len} tokens "
                           f"exceeds the context length {lim.max_context_tokens}", token_param)  # fmt: skip
        d = self.defaults
        top_k = req.top_k if req.top_k is not None else d.top_k
        params = replace(
            d, temperature=d.temperature if req.temperature is None else req.temperature,
            top_p=d.top_p if req.top_p is None else req.top_p,
            top_k=None if top_k is not None and top_k <= 0 else top_k,
            min_p=d.min_p if req.min_p is None else req.min_p,
            max_new_tokens=min(max_tokens or lim.max_tokens, lim.max_tokens, room),
            # the run's rollout.stop always holds (e.g. a tag parser's closing tag ends a call)
            stop=tuple(dict.fromkeys((*(req.stop or ()), *d.stop))), n=1,
        )  # fmt: skip
        return self.access.params(key, params)

    def _enqueue(self, key, jobs: list[tuple], param: str) -> list[asyncio.Future]:
        """Queue every sampling of one request — ``(prompt ids, params, n, seed, listener)``
        each — at once: all of them, or (the queue too full: 429) none; a request larger than
        the whole queue is a 400 naming ``param``."""
        total = sum(job[2] for job in jobs)
        limit = self.limits.max_pending_samples
        if total > limit:
            raise ApiError(400, f"this request asks for {total} samples (prompts × n); this "
                           f"server queues at most {limit} (serve.max_pending_samples)", param)  # fmt: skip
        try:
            self.batcher.check_room(total)
        except Overloaded as exc:
            raise ApiError(429, str(exc), None, "rate_limit_error") from None
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future] = []
        for ids, params, n, seed, listener in jobs:
            try:
                script = self.access.scripted(key, n)
            except ValueError as exc:
                for f in futures:
                    f.cancel()
                raise ApiError(400, str(exc)) from None
            if script is not None:  # a demonstration: its ids, as if sampled (log-probs unknown: 0)
                done = loop.create_future()
                done.set_result([Completion(list(t), [0.0] * len(t), "stop") for t in script])
                futures.append(done)
                continue
            seeds = self.access.seeds(key, n, seed)
            futures.append(self.batcher.enqueue([ids] * n, params, seeds, listener))
        return futures

    async def _scores(self, jobs: list[ScoreJob], k: int, param: str) -> list[TokenScores]:
        try:
            return await self.batcher.score(jobs, k)
        except Unsupported as exc:
            raise ApiError(400, f"needs a scoring forward, which this server cannot run: {exc}",
                           param) from None  # fmt: skip

    def _text(self, ids: Sequence[int], stop: Sequence[str]) -> str:
        return _cut_at_stop(self.tokenizer.decode(list(ids), skip_special_tokens=True), stop)

    def _token(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def _top(self, pairs: list[tuple[int, float]], tid: int, lp: float) -> dict[str, float]:
        """Legacy completions' alternatives: the k likeliest tokens and the token itself (as
        vLLM's), by text; two ids decoding alike keep the larger log-prob."""
        out: dict[str, float] = {}
        for t, v in [*pairs, (tid, lp)]:
            s = self._token(t)
            out[s] = max(v, out.get(s, -math.inf))
        return out

    def _logprobs_content(self, c: Completion, scores: TokenScores | None,
                          k: int) -> list[dict[str, Any]]:  # fmt: skip
        """Chat ``logprobs.content``: per sampled token its log-prob (the sampler's; with
        ``top_logprobs``, the scoring forward's, beside its alternatives)."""
        out = []
        for p, tid in enumerate(c.ids):
            tok = self._token(tid)
            lp = c.logprobs[p] if scores is None else scores.logprobs[p]
            top = [] if scores is None else [
                {"token": (s := self._token(t)), "logprob": v, "bytes": list(s.encode())}
                for t, v in scores.top[p][:k]
            ]  # fmt: skip
            out.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                        "top_logprobs": top})  # fmt: skip
        return out

    # ----- endpoints --------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": self.created, "owned_by": "groupflow"}]}  # fmt: skip

    async def chat(self, key: str | None, req: ChatRequest) -> dict[str, Any]:
        prompt, params = await self._chat_prompt(key, req)
        futures = self._enqueue(key, [(prompt.ids, params, req.n, req.seed, None)], "n")
        (completions,) = await _all(futures)
        scores = await self._chat_scores(req, prompt, params, completions)
        return self._chat_answer(key, req, prompt, params, completions, scores)

    async def chat_stream(self, key: str | None, req: ChatRequest, usage: bool):
        """The chat answer as server-sent events (see the module docstring). A bad request or a
        full queue raises ``ApiError`` here, before the stream (and its 200 status) starts."""
        prompt, params = await self._chat_prompt(key, req)
        streamable = not (req.tools and req.tool_choice != "none") and not prompt.forced_text
        arrived: list[tuple[int, list[int]]] = []
        wake = asyncio.Event()

        def listener(j: int, ids: list[int]) -> None:
            arrived.append((j, ids))
            wake.set()

        futures = self._enqueue(
            key, [(prompt.ids, params, req.n, req.seed, listener if streamable else None)], "n"
        )
        task = asyncio.ensure_future(_all(futures))
        task.add_done_callback(lambda _: wake.set())
        return self._chat_events(key, req, prompt, params, task, arrived, wake, usage)

    async def _chat_events(self, key, req: ChatRequest, prompt: ChatPrompt, params, task,
                           arrived: list, wake: asyncio.Event, usage: bool):  # fmt: skip
        try:
            head = {"id": f"chatcmpl-{_next_id()}", "object": "chat.completion.chunk",
                    "created": int(time.time()), "model": self.model_name}  # fmt: skip
            yield _sse({**head, "choices": [], "prompt_token_ids": prompt.ids})
            for i in range(req.n):
                yield _sse({**head, "choices": [{"index": i, "delta": {"role": "assistant",
                            "content": ""}, "finish_reason": None}]})  # fmt: skip
            texts = [TextStream(self.tokenizer, params.stop) for _ in range(req.n)]
            async for j, delta in _deltas(task, arrived, wake, texts):
                yield _sse({**head, "choices": [{"index": j, "delta": {"content": delta},
                                                 "finish_reason": None}]})  # fmt: skip
            try:
                (completions,) = task.result()
                scores = await self._chat_scores(req, prompt, params, completions)
                out = self._chat_answer(key, req, prompt, params, completions, scores)
            except Exception as exc:
                # the stream has started (status 200): the error is its last event
                yield _stream_error(exc)
                yield "data: [DONE]\n\n"
                return
            for ch in out["choices"]:
                i, msg = ch["index"], ch["message"]
                rest = _rest(msg.get("content") or "", texts[i].sent)
                if rest:
                    yield _sse({**head, "choices": [{"index": i, "delta": {"content": rest},
                                                     "finish_reason": None}]})  # fmt: skip
                if msg.get("tool_calls"):
                    calls = [{"index": k, **c} for k, c in enumerate(msg["tool_calls"])]
                    yield _sse({**head, "choices": [{"index": i, "delta": {"tool_calls": calls},
                                                     "finish_reason": None}]})  # fmt: skip
                yield _sse({**head, "choices": [{
                    "index": i, "delta": {}, "finish_reason": ch["finish_reason"],
                    "logprobs": ch["logprobs"], "token_ids": ch["token_ids"],
                    "token_logprobs": ch["token_logprobs"]}]})  # fmt: skip
            if usage:
                yield _sse({**head, "choices": [], "usage": out["usage"]})
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the stream is closed early): its rows stop decoding
            if not task.done():
                task.cancel()

    async def _chat_prompt(self, key: str | None,
                           req: ChatRequest) -> tuple[ChatPrompt, SamplingParams]:  # fmt: skip
        if self.chat_prompts is None:
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions",
                           "messages")  # fmt: skip
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        chars = sum(_message_chars(m) for m in req.messages)
        self._check_chars(chars, "messages")
        try:
            prompt: ChatPrompt = await self._off_loop(
                chars, self.chat_prompts.prompt, key or "", req.messages, req.tools,
                req.tool_choice,
            )  # fmt: skip
        except ValueError as exc:  # the template cannot render these messages
            raise ApiError(400, str(exc), "messages") from None
        token_param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        params = self._params(key, req, req.requested_max_tokens, len(prompt.ids), token_param)
        return prompt, params

    async def _chat_scores(self, req: ChatRequest, prompt: ChatPrompt, params: SamplingParams,
                           completions: list[Completion]) -> list[TokenScores] | None:  # fmt: skip
        """With ``top_logprobs`` > 0: each choice's tokens scored (their alternatives)."""
        if not (req.logprobs and req.top_logprobs):
            return None
        n = len(prompt.ids)
        jobs = [ScoreJob(prompt.ids + c.ids, n, params.temperature, n) for c in completions]
        return await self._scores(jobs, req.top_logprobs, "top_logprobs")

    def _chat_answer(self, key: str | None, req: ChatRequest, prompt: ChatPrompt,
                     params: SamplingParams, completions: list[Completion],
                     scores: list[TokenScores] | None = None) -> dict[str, Any]:  # fmt: skip
        choices, responses, calls = [], [], 0
        for j, c in enumerate(completions):
            decoded = self.tokenizer.decode(c.ids, skip_special_tokens=True)
            turn = self.chat_prompts.assistant(prompt.forced_text + decoded, req.tools,
                                               req.tool_choice)  # fmt: skip
            if not turn.tool_calls:
                turn.content = prompt.forced_text + _cut_at_stop(decoded, params.stop)
            self.chat_prompts.remember(prompt.key, turn, prompt.ids + c.ids)
            finish = (
                "length" if c.finish == "length" else "tool_calls" if turn.tool_calls else "stop"
            )
            message = turn.message()
            responses.append(message)
            calls += len(turn.tool_calls)
            content = None
            if req.logprobs:
                mine = None if scores is None else scores[j]
                content = {"content": self._logprobs_content(c, mine, req.top_logprobs or 0)}
            choices.append({
                "index": j, "message": message, "finish_reason": finish, "logprobs": content,
                "token_ids": c.ids, "token_logprobs": c.logprobs,
            })  # fmt: skip
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        self.access.record(key, CallRecord(prompt.ids, completions, messages, responses, calls))
        return {
            "id": f"chatcmpl-{_next_id()}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model_name, "choices": choices,
            "usage": _usage(len(prompt.ids), completions), "prompt_token_ids": prompt.ids,
        }  # fmt: skip

    async def complete(self, key: str | None, req: CompletionRequest) -> dict[str, Any]:
        prompts, texts, settings, seeds = await self._completion_prompts(key, req)
        if req.max_tokens == 0:  # echo only: the prompt scored, nothing sampled
            sampled = [[Completion([], [], "length")] * req.n for _ in prompts]
        else:  # all prompts of the request in flight together: they share engine calls
            jobs = [(ids, p, req.n, s, None) for ids, p, s in zip(prompts, settings, seeds)]
            sampled = await _all(self._enqueue(key, jobs, _batch_param(req)))
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
        task = asyncio.ensure_future(_all(self._enqueue(key, jobs, _batch_param(req))))
        task.add_done_callback(lambda _: wake.set())
        return self._completion_events(key, req, prompts, texts, settings, task, arrived, wake,
                                       usage)  # fmt: skip

    async def _completion_events(self, key, req: CompletionRequest, prompts, prompt_texts,
                                 settings, task, arrived: list, wake: asyncio.Event,
                                 usage: bool):  # fmt: skip
        try:
            head = {"id": f"cmpl-{_next_id()}", "object": "text_completion",
                    "created": int(time.time()), "model": self.model_name}  # fmt: skip
            texts = [TextStream(self.tokenizer, p.stop) for p in settings for _ in range(req.n)]
            if req.echo:  # the prompt first, as the answer's text begins with it
                for i, text in enumerate(prompt_texts):
                    for j in range(req.n):
                        yield _sse({**head, "choices": [{"index": i * req.n + j, "text": text,
                                    "logprobs": None, "finish_reason": None}]})  # fmt: skip
            async for j, delta in _deltas(task, arrived, wake, texts):
                yield _sse({**head, "choices": [{"index": j, "text": delta, "logprobs": None,
                                                 "finish_reason": None}]})  # fmt: skip
            try:
                sampled = task.result()
                scores = await self._completion_scores(req, prompts, settings, sampled)
                out = self._completion_answer(key, req, prompts, prompt_texts, settings, sampled,
                                              scores)  # fmt: skip
            except Exception as exc:
                # the stream has started (status 200): the error is its last event
                yield _stream_error(exc)
                yield "data: [DONE]\n\n"
                return
            for ch in out["choices"]:
                sent = prompt_texts[ch["index"] // req.n] + texts[ch["index"]].sent
                rest = _rest(ch["text"], sent)
                # the last chunk of a choice: the rest of its text, why it ended, and the extra
                # fields of the non-streamed choice (token ids, their log-probs, the prompt's ids)
                yield _sse({**head, "choices": [{**ch, "text": rest}]})
            if usage:
                yield _sse({**head, "choices": [], "usage": out["usage"]})
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
            u = _usage(len(ids), completions)
            usage = {k: usage[k] + u[k] for k in usage}
        return {"id": f"cmpl-{_next_id()}", "object": "text_completion",
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

    # ----- tokenizer endpoints (vLLM's; lm-evaluation-harness's remote tokenizer) ------------
    async def tokenize(self, key: str | None, req: TokenizeRequest) -> dict[str, Any]:
        if req.messages is not None:
            if self.chat_prompts is None:
                raise ApiError(400, "this model's tokenizer has no chat template", "messages")
            chars = sum(_message_chars(m) for m in req.messages)
            self._check_chars(chars, "messages")
            try:
                prompt = await self._off_loop(chars, self.chat_prompts.prompt, key or "",
                                              req.messages, req.tools, None)  # fmt: skip
            except ValueError as exc:
                raise ApiError(400, str(exc), "messages") from None
            ids = prompt.ids
        else:
            self._check_chars(len(req.prompt), "prompt")
            ids = await self._off_loop(len(req.prompt), _encode, self.tokenizer, req.prompt,
                                       req.add_special_tokens)  # fmt: skip
        return {"count": len(ids), "max_model_len": self.limits.max_context_tokens,
                "tokens": ids}  # fmt: skip

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        vocab = len(self.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})",
                           "tokens")  # fmt: skip
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def tokenizer_info(self) -> dict[str, Any]:
        tok = self.tokenizer
        return {
            "tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token,
            "bos_token": tok.bos_token, "pad_token": tok.pad_token,
            "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": self.limits.max_context_tokens,
            "vocab_size": len(tok),
        }  # fmt: skip

    def close(self) -> None:
        """Stop the batcher and the tokenizer thread."""
        self.batcher.close()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)


async def _deltas(task, arrived: list, wake: asyncio.Event, texts: list[TextStream]):
    """``(choice, new text)`` as the listeners' ids arrive in ``arrived`` (``wake`` set), until
    ``task`` — the sampling — is done."""
    while True:
        await wake.wait()
        wake.clear()
        news, arrived[:] = list(arrived), []
        for j, ids in news:
            delta = texts[j].push(ids)
            if delta:
                yield j, delta
        if task.done() and not arrived:
            return


def _rest(text: str, sent: str) -> str:
    """What of a choice's final ``text`` its streamed pieces ``sent`` have not said yet."""
    if sent and text.startswith(sent):
        return text[len(sent) :]
    if sent:  # cannot happen for a tokenizer whose prefixes decode to prefixes
        log.warning("streamed text %r is not a prefix of the answer %r", sent, text)
        return ""
    return text


def _server_error(exc: Exception) -> ApiError:
    """An unexpected failure (the engine's) as this request's 500, logged without a traceback
    (``--log-level DEBUG`` shows it)."""
    if isinstance(exc, ApiError):
        return exc
    log.warning("a request failed: %s: %s", type(exc).__name__, exc)
    log.debug("the failure's traceback", exc_info=exc)
    return ApiError(500, f"the engine failed: {type(exc).__name__}: {exc}", None, "server_error")


def _stream_error(exc: Exception) -> str:
    """A failure after a stream's 200: its last event (then ``[DONE]``)."""
    exc = _server_error(exc)
    return _sse({"error": {"message": exc.message, "type": exc.kind, "param": exc.param,
                           "code": None}})  # fmt: skip


def _cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the first of the ``stop`` strings in it."""
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


_IDS = itertools.count()
_ID_PREFIX = secrets.token_hex(6)


def _next_id() -> str:
    return f"{_ID_PREFIX}{next(_IDS):x}"


def _prompt_param(req) -> str:
    return "messages" if isinstance(req, ChatRequest) else "prompt"


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


def _encode(tokenizer, text: str, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _prompt_ids(prompt, tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return [list(p) if isinstance(p, list) else _encode(tokenizer, p) for p in prompt]


def _message_chars(m: ChatMessage) -> int:
    """The characters of a message the template renders (content and tool-call arguments)."""
    calls = sum(len(str(c.function.arguments)) + len(c.function.name) for c in m.tool_calls or [])
    return len(content_text(m.content)) + calls


async def _all(futures: list[asyncio.Future]) -> list:
    """The futures' results; when one fails or the caller is cancelled (its client went away),
    the others are cancelled — their queued samples and running rows dropped."""
    try:
        return list(await asyncio.gather(*futures))
    finally:
        for f in futures:
            if not f.done():
                f.cancel()


def _offsets(tokens: list[str]) -> list[int]:
    out, pos = [], 0
    for t in tokens:
        out.append(pos)
        pos += len(t)
    return out


def _usage(prompt_len: int, completions: list[Completion]) -> dict[str, int]:
    done = sum(len(c.ids) for c in completions)
    return {"prompt_tokens": prompt_len, "completion_tokens": done,
            "total_tokens": prompt_len + done}  # fmt: skip


class TextStream:
    """A completion's text as its ids arrive: ``push(ids)`` returns the new text that no later
    token can change — cut at the first stop string (nothing after it, ever), less the last
    ``len(longest stop) - 1`` characters (they may begin one) and a trailing unfinished
    character (U+FFFD while its bytes are incomplete). ``sent`` is everything returned."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def push(self, ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.stop if s in text]
        if cuts:
            safe, self.stopped = text[: min(cuts)], True
        else:
            safe = text[: max(0, len(text) - self.hold)].rstrip("\ufffd")
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent) :], safe
        return delta


# ----- HTTP --------------------------------------------------------------------------------------
class _BodyTooLarge(Exception):
    pass


class Guard:
    """ASGI middleware in front of the app: the API key is checked (401) and a request body above
    ``max_bytes`` is refused (413) before anything is parsed."""

    def __init__(self, app, access: Access, max_bytes: int):
        self.app, self.access, self.max_bytes = app, access, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if not self.access.authorize(_bearer(headers)):
            resp = _error(401, "invalid or missing API key (Authorization: Bearer KEY)", None,
                          "authentication_error")  # fmt: skip
            return await resp(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await self._reject(scope, receive, send)

    async def _reject(self, scope, receive, send):
        resp = _error(413, f"the request body is larger than {self.max_bytes} bytes "
                      "(serve.max_body_bytes)")  # fmt: skip
        await resp(scope, receive, send)


def _bearer(headers) -> str | None:
    header = headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip() or None
    return headers.get("api-key")


def build_app(core: ServerCore) -> FastAPI:
    """The endpoints; every 4xx/5xx answer is OpenAI-shaped (``{"error": {"message", "type",
    "param", "code"}}``), an unknown path and a wrong method included."""
    app = FastAPI(title="groupflow", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        # drop pydantic's union-member names (e.g. 'str', 'list[int]') from the field path
        loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int")]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid value").removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            return _error(400, "the request body is not valid JSON")
        return _error(400, f"{param}: {msg}" if param else msg, param)

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return _error(exc.status_code, message)

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception):  # a bug: still an OpenAI-shaped 500
        return _server_error(exc).response()

    @app.get("/v1/models")
    async def models():
        return core.models()

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        key = _bearer(request.headers)
        if not req.stream:
            return await _answer(request, core.chat(key, req))
        usage = req.stream_options is not None and req.stream_options.include_usage
        events = await core.chat_stream(key, req, usage)
        return StreamingResponse(events, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        key = _bearer(request.headers)
        if not req.stream:
            return await _answer(request, core.complete(key, req))
        usage = req.stream_options is not None and req.stream_options.include_usage
        events = await core.complete_stream(key, req, usage)
        return StreamingResponse(events, media_type="text/event-stream")

    # vLLM's tokenizer endpoints, at the root as vLLM serves them (lm-evaluation-harness finds
    # them there from a base_url ending in /v1/completions)
    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest, request: Request):
        return await _answer(request, core.tokenize(_bearer(request.headers), req))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return _json(core.detokenize(req))

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return _json(core.tokenizer_info())

    return Guard(app, core.access, core.limits.max_body_bytes)


async def _answer(request: Request, work) -> Response:
    """``await work`` as JSON — unless the client disconnects first: then the work is
    cancelled (its queued samples and decoding rows dropped) and nobody is answered. An
    unexpected failure is this request's OpenAI-shaped 500."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():  # the client left (or this handler was cancelled)
            task.cancel()
    if not task.done() or task.cancelled():
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    exc = task.exception()
    if exc is not None:
        return _server_error(exc).response()
    return _json(task.result())


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read: the next ASGI message is the
    disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _json(obj: dict[str, Any]) -> Response:
    """Plain JSON (the body is built of lists, dicts and numbers: no encoder pass needed)."""
    return Response(json.dumps(obj), media_type="application/json")


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
