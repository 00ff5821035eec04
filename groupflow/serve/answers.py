"""The pieces both endpoints build their answers from, streamed or not: response ids, usage, a
completion's text cut at its stop strings, the streamed text (``TextStream``), server-sent
events, and gathering a request's samplings.

Design decision: a streamed answer is the non-streamed one sent early, made of the same pieces.
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
gives the sampled ids either way. A request whose stream is closed early (its client went away)
is cancelled: ``gather_all`` cancels the rest of its samplings, and the batchers drop cancelled
requests' rows.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
from collections.abc import Sequence
from typing import Any

from groupflow.serve.batcher import Completion
from groupflow.serve.errors import server_error

log = logging.getLogger("groupflow")

__all__ = [
    "TextStream",
    "cut_at_stop",
    "deltas",
    "gather_all",
    "next_id",
    "sse",
    "stream_error",
    "unsent",
    "usage_of",
]


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


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the first of the ``stop`` strings in it."""
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


async def deltas(task, arrived: list, wake: asyncio.Event, texts: list[TextStream]):
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


def unsent(text: str, sent: str) -> str:
    """What of a choice's final ``text`` its streamed pieces ``sent`` have not said yet."""
    if sent and text.startswith(sent):
        return text[len(sent) :]
    if sent:  # cannot happen for a tokenizer whose prefixes decode to prefixes
        log.warning("streamed text %r is not a prefix of the answer %r", sent, text)
        return ""
    return text


def stream_error(exc: Exception) -> str:
    """A failure after a stream's 200: its last event (then ``[DONE]``)."""
    exc = server_error(exc)
    return sse({"error": {"message": exc.message, "type": exc.kind, "param": exc.param,
                          "code": None}})  # fmt: skip


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


_IDS = itertools.count()
_ID_PREFIX = secrets.token_hex(6)


def next_id() -> str:
    return f"{_ID_PREFIX}{next(_IDS):x}"


def usage_of(prompt_len: int, completions: list[Completion]) -> dict[str, int]:
    done = sum(len(c.ids) for c in completions)
    return {"prompt_tokens": prompt_len, "completion_tokens": done,
            "total_tokens": prompt_len + done}  # fmt: skip


async def gather_all(futures: list[asyncio.Future]) -> list:
    """The futures' results; when one fails or the caller is cancelled (its client went away),
    the others are cancelled — their queued samples and running rows dropped."""
    try:
        return list(await asyncio.gather(*futures))
    finally:
        for f in futures:
            if not f.done():
                f.cancel()
