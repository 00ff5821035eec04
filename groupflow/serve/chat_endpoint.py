"""``/v1/chat/completions``: a chat request rendered to prompt ids, sampled, and answered (whole
or as server-sent events), with tool calls parsed and the call recorded.

Design decision: a mixin of ``ServerCore`` (``serve.core``), one per endpoint family, so each
endpoint's request-to-answer path reads in one place while the steps every endpoint shares
(``_params``, ``_enqueue``, ``_off_loop``, ``_check_chars``, ``_scores``, ``_token``) stay on
the core. A bad request or a full queue raises ``ApiError`` before a stream (and its 200
status) starts; a failure after that is the stream's last event.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from groupflow.rollout.engines.hf import SamplingParams
from groupflow.serve.access import CallRecord
from groupflow.serve.answers import (
    TextStream,
    cut_at_stop,
    deltas,
    gather_all,
    next_id,
    sse,
    stream_error,
    unsent,
    usage_of,
)
from groupflow.serve.batcher import Completion
from groupflow.serve.chat import ChatPrompt
from groupflow.serve.endpoint_core import EndpointCore
from groupflow.serve.errors import ApiError
from groupflow.serve.protocol import ChatMessage, ChatRequest, content_text
from groupflow.serve.scoring import ScoreJob, TokenScores

__all__ = ["ChatEndpoints", "message_chars"]


class ChatEndpoints(EndpointCore):
    """``ServerCore``'s chat endpoint (see the module docstring)."""

    async def chat(self, key: str | None, req: ChatRequest) -> dict[str, Any]:
        prompt, params = await self._chat_prompt(key, req)
        futures = self._enqueue(key, [(prompt.ids, params, req.n, req.seed, None)], "n")
        (completions,) = await gather_all(futures)
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
        task = asyncio.ensure_future(gather_all(futures))
        task.add_done_callback(lambda _: wake.set())
        return self._chat_events(key, req, prompt, params, task, arrived, wake, usage)

    async def _chat_events(self, key, req: ChatRequest, prompt: ChatPrompt, params, task,
                           arrived: list, wake: asyncio.Event, usage: bool):  # fmt: skip
        try:
            head = {"id": f"chatcmpl-{next_id()}", "object": "chat.completion.chunk",
                    "created": int(time.time()), "model": self.model_name}  # fmt: skip
            yield sse({**head, "choices": [], "prompt_token_ids": prompt.ids})
            for i in range(req.n):
                yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant",
                           "content": ""}, "finish_reason": None}]})  # fmt: skip
            texts = [TextStream(self.tokenizer, params.stop) for _ in range(req.n)]
            async for j, delta in deltas(task, arrived, wake, texts):
                yield sse({**head, "choices": [{"index": j, "delta": {"content": delta},
                                                "finish_reason": None}]})  # fmt: skip
            try:
                (completions,) = task.result()
                scores = await self._chat_scores(req, prompt, params, completions)
                out = self._chat_answer(key, req, prompt, params, completions, scores)
            except Exception as exc:
                # the stream has started (status 200): the error is its last event
                yield stream_error(exc)
                yield "data: [DONE]\n\n"
                return
            for ch in out["choices"]:
                i, msg = ch["index"], ch["message"]
                rest = unsent(msg.get("content") or "", texts[i].sent)
                if rest:
                    yield sse({**head, "choices": [{"index": i, "delta": {"content": rest},
                                                    "finish_reason": None}]})  # fmt: skip
                if msg.get("tool_calls"):
                    calls = [{"index": k, **c} for k, c in enumerate(msg["tool_calls"])]
                    yield sse({**head, "choices": [{"index": i, "delta": {"tool_calls": calls},
                                                    "finish_reason": None}]})  # fmt: skip
                yield sse({**head, "choices": [{
                    "index": i, "delta": {}, "finish_reason": ch["finish_reason"],
                    "logprobs": ch["logprobs"], "token_ids": ch["token_ids"],
                    "token_logprobs": ch["token_logprobs"]}]})  # fmt: skip
            if usage:
                yield sse({**head, "choices": [], "usage": out["usage"]})
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
        chars = sum(message_chars(m) for m in req.messages)
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
        assert self.chat_prompts is not None, "_chat_prompt refused the request without one"
        choices, responses, calls = [], [], 0
        for j, c in enumerate(completions):
            decoded = self.tokenizer.decode(c.ids, skip_special_tokens=True)
            turn = self.chat_prompts.assistant(prompt.forced_text + decoded, req.tools,
                                               req.tool_choice)  # fmt: skip
            if not turn.tool_calls:
                turn.content = prompt.forced_text + cut_at_stop(decoded, params.stop)
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
            "id": f"chatcmpl-{next_id()}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model_name, "choices": choices,
            "usage": usage_of(len(prompt.ids), completions), "prompt_token_ids": prompt.ids,
        }  # fmt: skip

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


def message_chars(m: ChatMessage) -> int:
    """The characters of a message the template renders (content and tool-call arguments)."""
    calls = sum(len(str(c.function.arguments)) + len(c.function.name) for c in m.tool_calls or [])
    return len(content_text(m.content)) + calls
