"""``ServerCore``: what the endpoints do, HTTP aside.

Design decision: everything the server does besides parsing and answering HTTP is in one object
holding the tokenizer, the chat renderer, the batcher, the limits (``ServeLimits``) and an
``Access`` policy (``serve.access``); the HTTP layer (``serve.app``) only routes to it. The
steps every endpoint shares are here, the endpoints themselves in one mixin per family
(``chat_endpoint``, ``completions_endpoint``) beside the tokenizer endpoints below. A request's
samples are queued at once or not at all (``_enqueue``: 429 when the queue has no room now).
Prompts longer than ``_INLINE_CHARS`` are rendered and tokenized on a thread of their own, after
a character cap (``ServeLimits.max_prompt_chars``), so a huge prompt never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from groupflow.rollout.engines.hf import SamplingParams
from groupflow.serve.access import Access, OpenAccess
from groupflow.serve.answers import cut_at_stop
from groupflow.serve.batcher import (
    Completion,
    ContinuousBatcher,
    DynamicBatcher,
    Overloaded,
    Unsupported,
)
from groupflow.serve.chat import ChatPrompts
from groupflow.serve.chat_endpoint import ChatEndpoints, message_chars
from groupflow.serve.completions_endpoint import CompletionEndpoints, encode
from groupflow.serve.errors import ApiError
from groupflow.serve.protocol import ChatRequest, DetokenizeRequest, TokenizeRequest
from groupflow.serve.scoring import ScoreJob, TokenScores

__all__ = ["ServeLimits", "ServerCore"]

_INLINE_CHARS = 4096  # prompts up to this many characters are tokenized on the event loop


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


class ServerCore(ChatEndpoints, CompletionEndpoints):
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
        return cut_at_stop(self.tokenizer.decode(list(ids), skip_special_tokens=True), stop)

    def _token(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    # ----- endpoints (chat and completions: the mixins) ----------------------------------------
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": self.created, "owned_by": "groupflow"}]}  # fmt: skip

    # ----- tokenizer endpoints (vLLM's; lm-evaluation-harness's remote tokenizer) ------------
    async def tokenize(self, key: str | None, req: TokenizeRequest) -> dict[str, Any]:
        if req.messages is not None:
            if self.chat_prompts is None:
                raise ApiError(400, "this model's tokenizer has no chat template", "messages")
            chars = sum(message_chars(m) for m in req.messages)
            self._check_chars(chars, "messages")
            try:
                prompt = await self._off_loop(chars, self.chat_prompts.prompt, key or "",
                                              req.messages, req.tools, None)  # fmt: skip
            except ValueError as exc:
                raise ApiError(400, str(exc), "messages") from None
            ids = prompt.ids
        else:
            text = req.prompt or ""  # set: the request model requires messages or a prompt
            self._check_chars(len(text), "prompt")
            ids = await self._off_loop(len(text), encode, self.tokenizer, text,
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


def _prompt_param(req) -> str:
    return "messages" if isinstance(req, ChatRequest) else "prompt"
