"""Tool-call parsers: find the tool calls in the text of one model turn.

Design decision: parsing only reads the decoded text of a turn to decide what to call; it never
feeds text back into the training sequence (the sampled token ids are kept as they are), so a
lossy decode cannot corrupt what is trained. A parser is a small object with ``parse(text,
tools)``, registered by name: ``hermes`` is the ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` format of Hermes, Qwen 2.5/3 and most chat templates' ``tools=`` prompts; ``tag``
is a compact ``<calculator>347*58</calculator>`` form (the tag is the tool's name, the text its
first parameter) for small models trained from scratch. A call that cannot be parsed is reported
as an error, which the tool environment turns into an observation the model can learn from.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from groupflow.agents.tools import Tool, ToolConfigError

__all__ = [
    "ToolCall",
    "ParsedCalls",
    "ToolCallParser",
    "HermesParser",
    "TagParser",
    "PARSERS",
    "build_parser",
]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedCalls:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one message per malformed call

    def __bool__(self) -> bool:
        return bool(self.calls or self.errors)


class ToolCallParser(Protocol):
    def parse(self, text: str, tools: Mapping[str, Tool]) -> ParsedCalls: ...


class HermesParser:
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, any number per turn."""

    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str, tools: Mapping[str, Tool]) -> ParsedCalls:
        out = ParsedCalls()
        for body in self._CALL.findall(text):
            try:
                obj = json.loads(body.strip())
            except json.JSONDecodeError as exc:
                out.errors.append(f"the tool call is not valid JSON ({exc.msg})")
                continue
            except RecursionError:  # e.g. 100 000 '[': a malformed call, like any other
                out.errors.append("the tool call is not valid JSON (nested too deeply)")
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                out.errors.append('a tool call must be {"name": ..., "arguments": {...}}')
                continue
            args = obj.get("arguments", {})
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except (json.JSONDecodeError, RecursionError):
                    out.errors.append(f"the arguments of {obj['name']!r} are not a JSON object")
                    continue
            if not isinstance(args, dict):
                out.errors.append(f"the arguments of {obj['name']!r} are not a JSON object")
                continue
            out.calls.append(ToolCall(obj["name"], args))
        return out


class TagParser:
    """``<name>text</name>`` for each tool ``name``; ``text`` fills its first parameter."""

    def parse(self, text: str, tools: Mapping[str, Tool]) -> ParsedCalls:
        out = ParsedCalls()
        if not tools:
            return out
        names = "|".join(re.escape(n) for n in tools)
        for name, body in re.findall(rf"<({names})>(.*?)</\1>", text, flags=re.DOTALL):
            params = tools[name].required or list(tools[name].parameters)
            if not params:
                out.calls.append(ToolCall(name, {}))
            else:
                out.calls.append(ToolCall(name, {params[0]: body}))
        return out


PARSERS: dict[str, type] = {"hermes": HermesParser, "tag": TagParser}


def build_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ToolConfigError(
            f"rollout.tool_parser: unknown parser {name!r}; choose from {sorted(PARSERS)}"
        )
    return PARSERS[name]()
