"""The FastAPI app: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

Design decision: the HTTP layer is FastAPI/Starlette under uvicorn (a kept server stack, never
hand-written HTTP); everything it does besides parsing and answering is in ``ServerCore`` — one
object holding the tokenizer, the chat renderer, the batcher, the limits and an ``Access``
policy. ``Access`` is the seam between serving and training: ``OpenAccess`` (``groupflow
serve``: one optional API key, the request's sampling settings) or a training run's episode
recorder (one key per episode, the run's sampling settings, every call recorded) — the HTTP code
is the same for both. Errors are OpenAI-shaped JSON (``{"error": {"message", "type", "param"}}``)
with a 4xx status and the offending field in ``param``.

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
import hmac
import itertools
import json
import logging
import random
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from groupflow.rollout.hf import SamplingParams
from groupflow.serve.batcher import (
    Completion,
    ContinuousBatcher,
    DynamicBatcher,
    Listener,
    Overloaded,
)
from groupflow.serve.chat import ChatPrompt, ChatPrompts
from groupflow.serve.protocol import ChatRequest, CompletionRequest

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
        return [seed + j for j in range(count)]

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

    # ----- shared steps -----------------------------------------------------------------------
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

    async def _sample(self, key, prompt_ids: list[int], params: SamplingParams, n: int,
                      seed: int | None, listener: Listener | None = None) -> list[Completion]:  # fmt: skip
        try:
            script = self.access.scripted(key, n)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        if script is not None:  # a demonstration: its ids, as if sampled (log-probs unknown: 0)
            return [Completion(list(ids), [0.0] * len(ids), "stop") for ids in script]
        seeds = self.access.seeds(key, n, seed)
        try:
            return await self.batcher.submit([prompt_ids] * n, params, seeds, listener)
        except Overloaded as exc:
            raise ApiError(429, str(exc), None, "rate_limit_error") from None

    def _text(self, ids: Sequence[int], stop: Sequence[str]) -> str:
        return _cut_at_stop(self.tokenizer.decode(list(ids), skip_special_tokens=True), stop)

    def _logprobs_content(self, c: Completion) -> list[dict[str, Any]]:
        out = []
        for tid, lp in zip(c.ids, c.logprobs):
            tok = self.tokenizer.decode([tid], skip_special_tokens=False)
            out.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                        "top_logprobs": []})  # fmt: skip
        return out

    # ----- endpoints --------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": self.created, "owned_by": "groupflow"}]}  # fmt: skip

    async def chat(self, key: str | None, req: ChatRequest) -> dict[str, Any]:
        prompt, params = self._chat_prompt(key, req)
        completions = await self._sample(key, prompt.ids, params, req.n, req.seed)
        return self._chat_answer(key, req, prompt, params, completions)

    async def chat_stream(self, key: str | None, req: ChatRequest, usage: bool):
        """The chat answer as server-sent events (see the module docstring). A bad request or a
        full queue raises ``ApiError`` here, before the stream (and its 200 status) starts."""
        prompt, params = self._chat_prompt(key, req)
        streamable = not (req.tools and req.tool_choice != "none") and not prompt.forced_text
        arrived: list[tuple[int, list[int]]] = []
        wake = asyncio.Event()

        def listener(j: int, ids: list[int]) -> None:
            arrived.append((j, ids))
            wake.set()

        task = asyncio.ensure_future(self._sample(
            key, prompt.ids, params, req.n, req.seed, listener if streamable else None))  # fmt: skip
        task.add_done_callback(lambda _: wake.set())
        await asyncio.sleep(0)  # the batcher's checks (429) run now
        if task.done() and task.exception() is not None:
            raise task.exception()
        return self._chat_events(key, req, prompt, params, task, arrived, wake, usage)

    async def _chat_events(self, key, req: ChatRequest, prompt: ChatPrompt, params, task,
                           arrived: list, wake: asyncio.Event, usage: bool):  # fmt: skip
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
            out = self._chat_answer(key, req, prompt, params, task.result())
        except Exception as exc:  # the stream has started (status 200): the error is its last event
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

    def _chat_prompt(self, key: str | None, req: ChatRequest) -> tuple[ChatPrompt, SamplingParams]:
        if self.chat_prompts is None:
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions",
                           "messages")  # fmt: skip
        try:
            prompt: ChatPrompt = self.chat_prompts.prompt(
                key or "", req.messages, req.tools, req.tool_choice
            )
        except ValueError as exc:  # the template cannot render these messages
            raise ApiError(400, str(exc), "messages") from None
        token_param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        params = self._params(key, req, req.requested_max_tokens, len(prompt.ids), token_param)
        return prompt, params

    def _chat_answer(self, key: str | None, req: ChatRequest, prompt: ChatPrompt,
                     params: SamplingParams, completions: list[Completion]) -> dict[str, Any]:  # fmt: skip
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
            choices.append({
                "index": j, "message": message, "finish_reason": finish,
                "logprobs": {"content": self._logprobs_content(c)} if req.logprobs else None,
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
        prompts, settings, seeds = self._completion_prompts(key, req)
        # all prompts of the request in flight together: they share engine calls
        sampled = await asyncio.gather(*(
            self._sample(key, ids, p, req.n, seed)
            for ids, p, seed in zip(prompts, settings, seeds)
        ))  # fmt: skip
        return self._completion_answer(key, req, prompts, settings, sampled)

    async def complete_stream(self, key: str | None, req: CompletionRequest, usage: bool):
        """The completion as server-sent events, token by token as ``chat_stream`` streams (a
        bad request or a full queue raises ``ApiError`` before the stream starts). Choice
        ``i·n + j`` is prompt i's sample j, as in the non-streamed answer."""
        prompts, settings, seeds = self._completion_prompts(key, req)
        arrived: list[tuple[int, list[int]]] = []
        wake = asyncio.Event()

        def listener(first: int):
            def hear(j: int, ids: list[int]) -> None:
                arrived.append((first + j, ids))
                wake.set()

            return hear

        parts = [
            asyncio.ensure_future(self._sample(key, ids, p, req.n, seed, listener(i * req.n)))
            for i, (ids, p, seed) in enumerate(zip(prompts, settings, seeds))
        ]  # fmt: skip
        await asyncio.sleep(0)  # the batcher's checks (429) run now
        failed = [t for t in parts if t.done() and t.exception() is not None]
        if failed:
            for t in parts:
                t.cancel()
            raise failed[0].exception()
        task = asyncio.gather(*parts)
        task.add_done_callback(lambda _: wake.set())
        return self._completion_events(key, req, prompts, settings, task, arrived, wake, usage)

    async def _completion_events(self, key, req: CompletionRequest, prompts, settings, task,
                                 arrived: list, wake: asyncio.Event, usage: bool):  # fmt: skip
        head = {"id": f"cmpl-{_next_id()}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name}  # fmt: skip
        texts = [TextStream(self.tokenizer, p.stop) for p in settings for _ in range(req.n)]
        async for j, delta in _deltas(task, arrived, wake, texts):
            yield _sse({**head, "choices": [{"index": j, "text": delta, "logprobs": None,
                                             "finish_reason": None}]})  # fmt: skip
        try:
            out = self._completion_answer(key, req, prompts, settings, task.result())
        except Exception as exc:  # the stream has started (status 200): the error is its last event
            yield _stream_error(exc)
            yield "data: [DONE]\n\n"
            return
        for ch in out["choices"]:
            rest = _rest(ch["text"], texts[ch["index"]].sent)
            # the last chunk of a choice: the rest of its text, why it ended, and the extra
            # fields of the non-streamed choice (token ids, their log-probs, the prompt's ids)
            yield _sse({**head, "choices": [{**ch, "text": rest}]})
        if usage:
            yield _sse({**head, "choices": [], "usage": out["usage"]})
        yield "data: [DONE]\n\n"

    def _completion_prompts(self, key: str | None, req: CompletionRequest):
        """The request's prompt ids, sampling settings and seeds, checked (``ApiError``)."""
        prompts = _prompt_ids(req.prompt, self.tokenizer)
        vocab = len(self.tokenizer)
        for i, ids in enumerate(prompts):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})",
                               f"prompt.{i}")  # fmt: skip
        settings = [self._params(key, req, req.max_tokens, len(i), "max_tokens") for i in prompts]
        seeds = [None if req.seed is None else req.seed + i * req.n for i in range(len(prompts))]
        return prompts, settings, seeds

    def _completion_answer(self, key: str | None, req: CompletionRequest, prompts, settings,
                           sampled: list[list[Completion]]) -> dict[str, Any]:  # fmt: skip
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for i, (ids, params, completions) in enumerate(zip(prompts, settings, sampled)):
            texts = [self._text(c.ids, params.stop) for c in completions]
            self.access.record(key, CallRecord(ids, completions, None, list(texts)))
            for j, (c, text) in enumerate(zip(completions, texts)):
                lp = None
                if req.logprobs is not None:
                    toks = [self.tokenizer.decode([t]) for t in c.ids]
                    lp = {"tokens": toks, "token_logprobs": c.logprobs, "top_logprobs": None,
                          "text_offset": _offsets(toks)}  # fmt: skip
                choices.append({
                    "index": i * req.n + j, "text": text, "finish_reason": c.finish,
                    "logprobs": lp, "token_ids": c.ids, "token_logprobs": c.logprobs,
                    "prompt_token_ids": ids,
                })  # fmt: skip
            u = _usage(len(ids), completions)
            usage = {k: usage[k] + u[k] for k in usage}
        return {"id": f"cmpl-{_next_id()}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": choices,
                "usage": usage}  # fmt: skip


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


def _stream_error(exc: Exception) -> str:
    """A failure after a stream's 200: its last event (then ``[DONE]``)."""
    if not isinstance(exc, ApiError):
        log.warning("a streamed request failed: %s", exc)
        exc = ApiError(500, f"the engine failed: {exc}", None, "server_error")
    return _sse({"error": {"message": exc.message, "type": exc.kind, "param": exc.param}})


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


def _prompt_ids(prompt, tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return [
        list(p) if isinstance(p, list) else tokenizer(p, add_special_tokens=False)["input_ids"]
        for p in prompt
    ]


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

    @app.get("/v1/models")
    async def models():
        return core.models()

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        if not req.stream:
            return _json(await core.chat(_bearer(request.headers), req))
        usage = req.stream_options is not None and req.stream_options.include_usage
        events = await core.chat_stream(_bearer(request.headers), req, usage)
        return StreamingResponse(events, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        if not req.stream:
            return _json(await core.complete(_bearer(request.headers), req))
        usage = req.stream_options is not None and req.stream_options.include_usage
        events = await core.complete_stream(_bearer(request.headers), req, usage)
        return StreamingResponse(events, media_type="text/event-stream")

    return Guard(app, core.access, core.limits.max_body_bytes)


def _json(obj: dict[str, Any]) -> Response:
    """Plain JSON (the body is built of lists, dicts and numbers: no encoder pass needed)."""
    return Response(json.dumps(obj), media_type="application/json")


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
