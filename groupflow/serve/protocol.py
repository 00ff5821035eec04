"""Request schemas of the OpenAI-compatible endpoints, validated field by field.

Design decision: a request is parsed by pydantic before anything runs, so a bad one gets a 400
naming the field (``messages.2.role``) instead of an error mid-generation. Unknown fields are
ignored, as OpenAI-compatible servers do (clients send ``user``, ``metadata``,
``parallel_tool_calls`` …); fields that would change the sampling distribution in a way the
engine cannot honour (penalties, a JSON response format) are refused by name rather than
silently ignored — a client must not believe it sampled from a distribution it did not. Every
number that reaches the engine is range-checked here (a ``seed`` outside 64-bit signed integers,
a NaN temperature): a value the engine cannot take is this request's 400, never an error in the
decode step that every request in flight shares.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "MAX_LOGPROBS",
    "MAX_STOP",
    "ChatMessage",
    "ToolSpec",
    "ChatRequest",
    "CompletionRequest",
    "TokenizeRequest",
    "DetokenizeRequest",
    "content_text",
]


MAX_LOGPROBS = 20  # alternatives per token (``logprobs`` / ``top_logprobs``), as vLLM's default
MAX_STOP = 16  # stop sequences per request (OpenAI allows 4; harnesses send their own plus EOS)
MAX_STOP_CHARS = 256  # one stop sequence (each decoded token is searched for them)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a 64-bit signed integer, as OpenAI's and vLLM's


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class FunctionSpec(_Lenient):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)


class ToolSpec(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionCallIn(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if isinstance(self.content, list):
            for part in self.content:
                if part.type not in ("text", "input_text", "output_text") or part.text is None:
                    raise ValueError(
                        f"content part of type {part.type!r}: only text parts are supported"
                    )
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        return self


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: dict[str, str]

    @field_validator("function")
    @classmethod
    def _has_name(cls, v: dict[str, str]) -> dict[str, str]:
        if not v.get("name"):
            raise ValueError("tool_choice.function needs a name")
        return v


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Sampling(_Lenient):
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)  # vLLM's extra: -1 or 0 is off
    min_p: float | None = Field(default=None, ge=0, lt=1)
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("a stop sequence must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence has at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("penalties are not supported (they would change what was sampled)")
        return v


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token
    response_format: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, v):
        if v is not None and v.get("type", "text") != "text":
            raise ValueError(f"response_format type {v.get('type')!r} is not supported (text only)")
        return v

    @model_validator(mode="after")
    def _choice_needs_tools(self):
        choice = self.tool_choice
        named = isinstance(choice, NamedToolChoice)
        if (named or choice == "required") and not self.tools:
            raise ValueError("tool_choice requires tools")
        if isinstance(choice, NamedToolChoice) and choice.function["name"] not in {
            t.function.name for t in self.tools or ()
        }:
            raise ValueError(f"tool_choice names {choice.function['name']!r}, not a tool")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    # text, several texts, token ids, or several token-id lists (token-in)
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # 0: score the prompt only (needs echo)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token
    echo: bool = False  # the prompt in front of the text (and its tokens' log-probs)
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, (str, list)) and len(v) == 0:
            raise ValueError("the prompt is empty")
        if isinstance(v, list) and any(isinstance(p, (str, list)) and len(p) == 0 for p in v):
            raise ValueError("a prompt of the list is empty")
        return v


class TokenizeRequest(_Lenient):
    """vLLM's ``/tokenize``: a text (``add_special_tokens`` as vLLM's default, true) or chat
    messages (the ids a chat request with them would be decoded from)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolSpec] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


def content_text(content: str | list[ContentPart] | None) -> str:
    """A message's content as one string (text parts joined; None is empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text or "" for p in content)
