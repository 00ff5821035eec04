"""Environments: what answers a model's turn in a multi-turn rollout — a game, a simulator, a judge,
or a set of tools.

Design decision: one gym/OpenEnv-like protocol, one instance per sample, so an environment keeps
its own episode state without locks and a group's samples never see each other:

    reset(row) -> first observation (or None)           row: the dataset row's fields and prompt
    step(text) -> (observation, reward, done)            text: the model's turn, decoded

Either may be ``async def``. An observation is text, a chat message, or a list of chat messages
(a tool environment answers with ``role: tool`` messages); a message's content may be a list of
text and image parts (as in prompts: a PIL image, bytes, a path or a ``data:`` URL), for a
vision-language policy. The workflow tokenizes it once and appends it to the sequence, masked
out of the loss; its images travel with the sample (``groupflow.agents.formats.VisionChatFormat``). Tools are an environment too
(:class:`ToolEnvironment`): a turn with tool calls gets their results, a turn without ends the
episode. Everything user code can do wrong — raise (``SystemExit`` and ``KeyboardInterrupt``
included), hang, return garbage — is contained here: :func:`reset_env` and :func:`step_env` never
raise; they report a failure that the workflow counts and turns into an ended sample. The one
exception is :class:`~groupflow.agents.calls.StuckCallsError`: too many hung sync calls stop the
run (``groupflow.agents.calls``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from groupflow.agents.calls import CallTimeout, StuckCallsError, call_with_timeout, error_text
from groupflow.agents.parsers import ToolCallParser
from groupflow.agents.tools import Tool, tool_result_text
from groupflow.data.images import is_pil_image as _is_pil
from groupflow.tools.sandbox import SandboxBroken, SandboxError

log = logging.getLogger("groupflow")

__all__ = [
    "Environment",
    "EnvironmentConfigError",
    "ToolEnvironment",
    "StepResult",
    "reset_env",
    "step_env",
    "normalize_observation",
    "has_image_parts",
]

Observation = str | Mapping[str, Any] | Sequence[Mapping[str, Any]] | None


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: Mapping[str, Any]) -> Any: ...

    def step(self, text: str) -> Any: ...


@dataclass
class StepResult:
    """One environment step as the workflow sees it. ``failure`` is None, or why the
    environment could not answer (the sample then ends with ``reward.failure_value``)."""

    observation: list[dict[str, Any]] | None
    reward: float = 0.0
    done: bool = False
    failure: str | None = None
    failure_kind: str | None = None  # "error" | "timeout" | "invalid"


def normalize_observation(obs: Any, role: str = "user") -> list[dict[str, Any]] | None:
    """An observation as a list of chat messages (text becomes one ``role`` message); None or
    empty: nothing to append. Raises ValueError for anything else."""
    if obs is None or obs == "" or obs == []:
        return None
    if isinstance(obs, str):
        return [{"role": role, "content": obs}]
    if isinstance(obs, Mapping):
        obs = [obs]
    if isinstance(obs, Sequence) and all(isinstance(m, Mapping) for m in obs):
        out = []
        for m in obs:
            content = m.get("content")
            if not isinstance(m.get("role", role), str) or not (
                isinstance(content, str) or _is_parts(content)
            ):
                raise ValueError(
                    "an observation message needs a string 'role' and 'content' (text, or a list "
                    "of text and image parts: {'type': 'text', 'text': ...}, "
                    f"{{'type': 'image', 'image': ...}}), got {dict(m)!r:.200}"
                )
            if not isinstance(content, str):
                content = [_image_part(p) for p in content]
            out.append({**m, "role": m.get("role", role), "content": content})
        return out
    raise ValueError(
        "an observation must be text, a chat message or a list of chat messages, "
        f"got {type(obs).__name__}"
    )


def _is_parts(content: Any) -> bool:
    """A content-part list: text parts with string text, image parts (HF or OpenAI shape)."""
    if not isinstance(content, list) or not content:
        return False
    for p in content:
        if not isinstance(p, Mapping):
            return False
        kind = p.get("type")
        if kind == "text" and isinstance(p.get("text"), str):
            continue
        if kind == "image" and any(p.get(k) is not None for k in ("image", "path", "url")):
            continue
        if kind == "image_url" and p.get("image_url") is not None:
            continue
        return False
    return True


def _image_part(part: Mapping[str, Any]) -> dict[str, Any]:
    """A content part in the one shape formats read: ``{"type": "image", "image": value}``
    (the value still undecoded: the turn format decodes and resizes it) or a text part."""
    if part["type"] == "text":
        return {"type": "text", "text": part["text"]}
    if part["type"] == "image_url":
        ref = part["image_url"]
        return {"type": "image", "image": ref.get("url") if isinstance(ref, Mapping) else ref}
    value = next(part[k] for k in ("image", "path", "url") if part.get(k) is not None)
    return {"type": "image", "image": value}


def has_image_parts(messages: Sequence[Mapping[str, Any]] | None) -> bool:
    """Whether any message's content holds an image part."""
    return any(
        isinstance(m.get("content"), list) and any(p.get("type") == "image" for p in m["content"])
        for m in messages or ()
    )


def _describe(env: Any) -> str:
    return type(env).__qualname__


def _call_failed(name: str, exc: Exception, timeout_s: float | None, kind: str) -> StepResult:
    """The failed, finished step of an environment call ``name`` that raised ``exc``: a
    ``CallTimeout``, or user code's error (``kind``; BaseExceptions arrive as UserCodeExit)."""
    if isinstance(exc, CallTimeout):
        return StepResult(None, done=True, failure=f"{name} timed out after {timeout_s:g} s",
                          failure_kind="timeout")  # fmt: skip
    return StepResult(None, done=True, failure=f"{name}: {error_text(exc)}", failure_kind=kind)


async def reset_env(env: Any, row: Mapping[str, Any], timeout_s: float | None) -> StepResult:
    """``env.reset(row)``; a failure is reported, never raised."""
    name = f"{_describe(env)}.reset"
    try:
        obs = await call_with_timeout(env.reset, (row,), timeout_s=timeout_s, name=name)
        return StepResult(normalize_observation(obs))
    except StuckCallsError:
        raise  # stops the run
    except Exception as exc:  # a timeout, or user code: this sample only
        return _call_failed(
            name, exc, timeout_s, "invalid" if isinstance(exc, ValueError) else "error"
        )


async def step_env(env: Any, text: str, timeout_s: float | None) -> StepResult:
    """``env.step(text)`` checked for shape; a failure is reported, never raised."""
    name = f"{_describe(env)}.step"
    try:
        out = await call_with_timeout(env.step, (text,), timeout_s=timeout_s, name=name)
    except StuckCallsError:
        raise  # stops the run
    except Exception as exc:  # a timeout, or user code: this sample only
        return _call_failed(name, exc, timeout_s, "error")
    try:
        if not isinstance(out, tuple) or len(out) != 3:
            raise ValueError(f"must return (observation, reward, done), got {out!r:.200}")
        obs, reward, done = out
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise ValueError(f"reward must be a number, got {reward!r:.100}")
        if not math.isfinite(reward):
            raise ValueError(f"reward must be finite, got {reward}")
        return StepResult(normalize_observation(obs), float(reward), bool(done))
    except ValueError as exc:
        return StepResult(None, done=True, failure=f"{name} {exc}", failure_kind="invalid")


class ToolEnvironment:
    """Tools as an environment: each tool call of a turn is run (up to ``max_calls_per_turn``)
    and answered with one ``role: tool`` message; a turn without a call ends the episode.

    A tool that raises, times out or gets bad arguments answers with an error message — the model
    sees what went wrong, as it would from a real API — and is counted in ``stats``.
    """

    def __init__(
        self,
        tools: Sequence[Tool],
        parser: ToolCallParser,
        *,
        max_calls_per_turn: int = 4,
        max_result_chars: int | None = 2000,
    ):
        self.tools = {t.name: t for t in tools}
        self.parser = parser
        self.max_calls_per_turn = max_calls_per_turn
        self.max_result_chars = max_result_chars
        self.stats = {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "bad_calls": 0,
                      "sandbox_failures": 0}  # fmt: skip

    async def reset(self, row: Mapping[str, Any]) -> None:
        return None  # async: awaited on the loop, no thread for a no-op

    async def step(self, text: str) -> tuple[list[dict[str, Any]] | None, float, bool]:
        parsed = self.parser.parse(text, self.tools)
        if not parsed:
            return None, 0.0, True
        messages = [self._message("error", f"Error: {e}") for e in parsed.errors]
        self.stats["bad_calls"] += len(parsed.errors)
        calls = parsed.calls[: self.max_calls_per_turn]
        if len(parsed.calls) > len(calls):
            messages.append(self._message("error", f"Error: at most {self.max_calls_per_turn} "
                                          "tool calls per turn; the rest were not run"))  # fmt: skip
        results = await asyncio.gather(*(self._run(c) for c in calls))
        messages.extend(self._message(c.name, r) for c, r in zip(calls, results))
        return messages, 0.0, False

    def _message(self, name: str, content: str | list) -> dict[str, Any]:
        return {"role": "tool", "name": name, "content": content}

    async def _run(self, call) -> str | list[dict[str, Any]]:
        self.stats["tool_calls"] += 1
        tool = self.tools.get(call.name)
        if tool is None:
            self.stats["bad_calls"] += 1
            return f"Error: unknown tool {call.name!r}; available: {sorted(self.tools)}"
        problem = tool.argument_error(call.arguments)
        if problem is not None:
            self.stats["bad_calls"] += 1
            return f"Error: {call.name}: {problem}"
        try:
            value = await call_with_timeout(
                tool.fn, kwargs=call.arguments, timeout_s=tool.timeout_s, name=f"tool {tool.name!r}"
            )
        except CallTimeout:
            self.stats["tool_timeouts"] += 1
            return f"Error: {call.name} timed out after {tool.timeout_s:g} s"
        except (StuckCallsError, SandboxBroken):
            raise  # stops the run
        except SandboxError as exc:  # the sandbox failed, not the model's code: no result at all
            self.stats["sandbox_failures"] += 1
            return f"Error: {call.name} could not run (its code sandbox failed: {exc})"
        except Exception as exc:  # the model's observation, not ours (SystemExit included)
            self.stats["tool_errors"] += 1
            return f"Error: {error_text(exc)}"
        if _is_pil(value):  # a tool may answer with an image (TRL's multimodal tool responses)
            return [{"type": "image", "image": value}]
        if (
            isinstance(value, list)
            and value
            and all(
                isinstance(p, Mapping) and p.get("type") in ("text", "image", "image_url")
                for p in value
            )
        ):  # content parts: text and images
            if not _is_parts(value):
                self.stats["tool_errors"] += 1
                return (
                    f"Error: {call.name} returned content parts that are not text or image parts "
                    f"with a value: {value!r:.200}"
                )
            return [_image_part(p) for p in value]
        try:
            return tool_result_text(value, self.max_result_chars)
        except Exception as exc:  # the value's own __str__ raised: the tool's failure too
            self.stats["tool_errors"] += 1
            return (
                f"Error: {call.name} returned a {type(value).__name__} that cannot be shown as "
                f"text ({type(exc).__name__})"
            )


def environment_factory(
    spec: Any, tools: Sequence[Tool], parser: ToolCallParser | None, **tool_options: Any
) -> Callable[[], Any]:
    """A zero-argument callable making one environment per sample: the configured class with its
    kwargs, else a :class:`ToolEnvironment` over ``tools``."""
    if spec is None:
        if parser is None:
            raise ValueError("a tool environment needs a tool-call parser")
        return lambda: ToolEnvironment(tools, parser, **tool_options)
    cls, kwargs = spec
    return functools.partial(_construct, cls, kwargs)


class EnvironmentConfigError(ValueError):
    """The configured environment class cannot be constructed with its kwargs."""


def _construct(cls: Callable[..., Any], kwargs: Mapping[str, Any]) -> Any:
    """``cls(**kwargs)``; a constructor that raises is a configuration error naming the class
    (every sample would fail alike, so it stops the run instead of being counted per sample)."""
    try:
        return cls(**kwargs)
    except Exception as exc:
        name = f"{getattr(cls, '__module__', '?')}:{getattr(cls, '__qualname__', cls)}"
        raise EnvironmentConfigError(
            f"rollout.environment: {name}(**{dict(kwargs)!r:.200}) raised "
            f"{type(exc).__name__}: {exc}; fix the class or rollout.environment.kwargs"
        ) from exc
