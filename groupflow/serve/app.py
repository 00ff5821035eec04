"""The FastAPI app: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions`` and vLLM's
tokenizer endpoints, in front of a ``ServerCore``.

Design decision: the HTTP layer is FastAPI/Starlette under uvicorn (a kept server stack, never
hand-written HTTP), and only parses, routes and answers: what the endpoints do is
``ServerCore``'s (``serve.core``). The API key and the body size are checked by ASGI middleware
(``Guard``) before anything is parsed. Every 4xx/5xx answer is OpenAI-shaped
(``serve.errors``), a validation error, an unknown path and a wrong method included. A request
whose client goes away is cancelled: a non-streamed one when the disconnect arrives
(``_answer``), a stream when its generator is closed — the batchers drop cancelled requests'
rows.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from groupflow.serve.access import Access
from groupflow.serve.core import ServerCore
from groupflow.serve.errors import ApiError, error_response, server_error
from groupflow.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

__all__ = ["build_app"]


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
            resp = error_response(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                  None, "authentication_error")  # fmt: skip
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
        resp = error_response(413, f"the request body is larger than {self.max_bytes} bytes "
                              "(serve.max_body_bytes)")  # fmt: skip
        await resp(scope, receive, send)


def _bearer(headers) -> str | None:
    header = headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip() or None
    return headers.get("api-key")


def build_app(core: ServerCore) -> Guard:
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
            return error_response(400, "the request body is not valid JSON")
        return error_response(400, f"{param}: {msg}" if param else msg, param)

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
        return error_response(exc.status_code, message)

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception):  # a bug: still an OpenAI-shaped 500
        return server_error(exc).response()

    @app.get("/v1/models")
    async def models():
        return core.models()

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        return await _sampled(request, req, core.chat, core.chat_stream)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await _sampled(request, req, core.complete, core.complete_stream)

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


async def _sampled(request: Request, req: ChatRequest | CompletionRequest, answer,
                   stream) -> Response:  # fmt: skip
    """A sampling endpoint's answer: ``answer(key, req)`` as JSON, or with ``req.stream`` the
    server-sent events of ``stream(key, req, usage)`` (whose errors before the first event,
    e.g. a full queue, are still this request's 4xx)."""
    key = _bearer(request.headers)
    if not req.stream:
        return await _answer(request, answer(key, req))
    usage = req.stream_options is not None and req.stream_options.include_usage
    events = await stream(key, req, usage)
    return StreamingResponse(events, media_type="text/event-stream")


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
        return server_error(exc).response()
    return _json(task.result())


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read: the next ASGI message is the
    disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _json(obj: dict[str, Any]) -> Response:
    """Plain JSON (the body is built of lists, dicts and numbers: no encoder pass needed)."""
    return Response(json.dumps(obj), media_type="application/json")
