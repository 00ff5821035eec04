"""Chat messages → prompt token ids, and a completion's text → an assistant message.

Design decision (token-in/token-out over HTTP): the server remembers, per conversation key (an
episode's API key, or one shared key), the exact ids of every answer it gave — the prompt plus
the ids it *sampled* — under the messages that led to it and the assistant message it returned.
A request whose messages start with such a conversation (the client sent back our answer
unchanged, as agents do) gets those ids followed by the ids of only the new messages: the
difference the chat template makes when they are appended (``agents.formats.ChatFormat``, the
same rule the multi-turn workflow uses). Any other request is rendered from scratch by the chat
template. So a multi-call episode is one token sequence whose model tokens are exactly the
sampled ones, and re-tokenization can only happen where the client changed the history (then
the training side splits the episode into separate samples rather than train on ids nobody
sampled).

Tools: described by the template's own ``tools=`` support, else by the Hermes system prompt
(``describe_tools: false`` leaves them out, for a small model trained to call them by format).
Tool calls are found with the run's parser (``agents.parsers``); an assistant message with
``tool_calls`` coming back is written as that parser's text when the template cannot render
``tool_calls`` itself. ``tool_choice: required`` (or a named tool) appends the parser's opening
of a call to the prompt — prompt tokens, not sampled ones — so the model's first tokens are a
call's.
"""

from __future__ import annotations

import itertools
import json
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from groupflow.agents.formats import ChatFormat, TemplateError
from groupflow.agents.parsers import ToolCall, build_parser
from groupflow.agents.tools import Tool
from groupflow.serve.protocol import ChatMessage, NamedToolChoice, ToolSpec, content_text

__all__ = ["ChatPrompt", "ChatPrompts", "AssistantTurn", "assistant_turn", "call_text"]


@dataclass
class ChatPrompt:
    ids: list[int]  # the prompt the engine decodes from (forced call opening included)
    forced_text: str  # text appended for tool_choice required/named ("" otherwise)
    reused: bool  # continues a conversation this server answered (ids taken, not re-encoded)
    key: tuple  # the normalised messages + tools: a conversation's memory key


@dataclass
class AssistantTurn:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        m: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        return m


def _canonical_args(arguments: str | dict) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def _norm(m: ChatMessage | dict) -> tuple:
    """A message as a comparable tuple: what a client may reformat (None vs "" content, argument
    JSON spacing, call ids) does not count; what the model reads does."""
    if isinstance(m, dict):
        m = ChatMessage.model_validate(m)
    calls = tuple(
        (c.function.name, _canonical_args(c.function.arguments)) for c in (m.tool_calls or [])
    )
    role = "system" if m.role == "developer" else m.role
    name = m.name if m.role == "tool" else None
    return (role, content_text(m.content).strip() if m.role == "assistant" else
            content_text(m.content), calls, name)  # fmt: skip


def _tools_key(tools: Sequence[ToolSpec] | None) -> str:
    return json.dumps([t.model_dump() for t in tools or []], sort_keys=True)


def call_text(parser: str, name: str, arguments: dict[str, Any]) -> str:
    """A tool call written in ``parser``'s format (how the model would have written it)."""
    if parser == "tag":
        body = next(iter(arguments.values()), "") if arguments else ""
        return f"<{name}>{body}</{name}>"
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _call_opening(parser: str, name: str | None) -> str:
    if parser == "tag":
        return f"<{name}>"
    if name is None:
        return "<tool_call>\n"
    return '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '


class ChatPrompts:
    """Renders requests to ids and remembers answered conversations (LRU, ``max_conversations``)."""

    def __init__(self, tokenizer, parser: str = "hermes", *, describe_tools: bool = True,
                 max_conversations: int = 1024):  # fmt: skip
        self.tokenizer, self.parser_name = tokenizer, parser
        self.parser = build_parser(parser)
        self.describe_tools = describe_tools
        self.max_conversations = max_conversations
        template = str(getattr(tokenizer, "chat_template", "") or "")
        if not template:
            raise TemplateError(
                "the tokenizer has no chat template: /v1/chat/completions needs one"
            )
        self.template_calls = "tool_calls" in template
        self._memory: OrderedDict[tuple, list[int]] = OrderedDict()
        self._formats: dict[str, ChatFormat] = {}
        self._lock = threading.Lock()

    # ----- requests → ids ---------------------------------------------------------------------
    def prompt(self, conversation: str, messages: list[ChatMessage],
               tools: list[ToolSpec] | None, tool_choice) -> ChatPrompt:  # fmt: skip
        offered = tools if tool_choice != "none" else None
        fmt = self._format(offered)
        tkey = _tools_key(offered)
        norms = [_norm(m) for m in messages]
        key = (conversation, tkey, tuple(norms))
        ids, reused = self._continue(conversation, tkey, messages, norms, fmt)
        if ids is None:
            text = fmt.render([self._template_message(m) for m in messages], True)
            ids = self._encode(text)
        forced = ""
        if tool_choice == "required" or isinstance(tool_choice, NamedToolChoice):
            name = (
                tool_choice.function["name"] if isinstance(tool_choice, NamedToolChoice) else None
            )
            if name is None and self.parser_name == "tag":
                if not tools or len(tools) != 1:
                    raise ValueError(
                        "tool_choice 'required' with the tag parser needs exactly one tool "
                        "(or name the tool)"
                    )
                name = tools[0].function.name
            forced = _call_opening(self.parser_name, name)
            ids = ids + self._encode(forced)
        return ChatPrompt(ids, forced, reused, key)

    def remember(self, key: tuple, turn: AssistantTurn, full_ids: list[int]) -> None:
        """The conversation of ``key`` answered with ``turn`` is ``full_ids`` (prompt + sampled)."""
        conversation, tkey, norms = key
        answered = (conversation, tkey, (*norms, _norm(turn.message())))
        with self._lock:
            self._memory[answered] = list(full_ids)
            self._memory.move_to_end(answered)
            while len(self._memory) > self.max_conversations:
                self._memory.popitem(last=False)

    def forget(self, conversation: str) -> None:
        """Drop a finished episode's conversations (called from another thread)."""
        with self._lock:
            for k in [k for k in self._memory if k[0] == conversation]:
                del self._memory[k]

    def _continue(self, conversation, tkey, messages, norms, fmt):
        """(ids, True) when the messages extend a remembered answer, else (None, False)."""
        for j in range(len(messages) - 1, 0, -1):
            if norms[j - 1][0] != "assistant":
                continue
            with self._lock:
                base = self._memory.get((conversation, tkey, tuple(norms[:j])))
            if base is None:
                continue
            new = [self._template_message(m) for m in messages[j:]]
            try:
                tail = fmt.observation_ids(new, base[-1] if base else None)
            except TemplateError:
                return None, False
            return base + tail, True
        return None, False

    def _format(self, tools: list[ToolSpec] | None) -> ChatFormat:
        schemas = [t.model_dump() for t in tools or []] if self.describe_tools else []
        key = json.dumps(schemas, sort_keys=True)
        fmt = self._formats.get(key)
        if fmt is None:  # one per tool set: agents send the same tools with every call
            fmt = self._formats[key] = ChatFormat(self.tokenizer, schemas)
            if len(self._formats) > 64:
                self._formats.pop(next(iter(self._formats)))
        return fmt

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _template_message(self, m: ChatMessage) -> dict[str, Any]:
        """A request message as the chat template takes it."""
        role = "system" if m.role == "developer" else m.role
        out: dict[str, Any] = {"role": role, "content": content_text(m.content)}
        if m.role == "tool":
            if m.tool_call_id:
                out["tool_call_id"] = m.tool_call_id
            if m.name:
                out["name"] = m.name
        if m.role == "assistant" and m.tool_calls:
            calls = [(c.function.name, json.loads(_canonical_args(c.function.arguments) or "{}")
                      if _is_json(c.function.arguments) else {}) for c in m.tool_calls]  # fmt: skip
            if self.template_calls:
                out["tool_calls"] = [
                    {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
                ]
            else:
                written = "".join(call_text(self.parser_name, n, a) for n, a in calls)
                out["content"] = out["content"] + written
        return out

    # ----- completion → assistant message ----------------------------------------------------
    def assistant(self, text: str, tools: list[ToolSpec] | None, tool_choice) -> AssistantTurn:
        return assistant_turn(text, self.parser_name, self.parser, tools, tool_choice)


def _is_json(arguments: str | dict) -> bool:
    if isinstance(arguments, dict):
        return True
    try:
        return isinstance(json.loads(arguments or "{}"), dict)
    except json.JSONDecodeError:
        return False


_STRIP = {
    "hermes": lambda names: re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL),
    "tag": lambda names: re.compile(
        rf"<({'|'.join(re.escape(n) for n in names)})>.*?</\1>", re.DOTALL
    ),
}


def assistant_turn(text: str, parser_name: str, parser, tools: list[ToolSpec] | None,
                   tool_choice) -> AssistantTurn:  # fmt: skip
    """``text`` (the completion, with any forced call opening in front) as an assistant message:
    tool calls parsed into OpenAI ``tool_calls``, the rest as content."""
    if not tools or tool_choice == "none":
        return AssistantTurn(text)
    mapping = {t.function.name: _tool(t) for t in tools}
    parsed = parser.parse(text, mapping)
    if not parsed.calls:
        return AssistantTurn(text, parse_errors=list(parsed.errors))
    rest = _STRIP[parser_name](list(mapping)).sub("", text).strip()
    return AssistantTurn(rest or None, [_openai_call(c) for c in parsed.calls], list(parsed.errors))


def _tool(spec: ToolSpec) -> Tool:
    return Tool(spec.function.name, fn=lambda **_: None, schema={
        "type": "function", "function": spec.function.model_dump()})  # fmt: skip


_CALL_IDS = itertools.count()
_CALL_PREFIX = secrets.token_hex(4)  # ids unique across restarts without a system call each


def _openai_call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": f"call_{_CALL_PREFIX}{next(_CALL_IDS):x}",
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
    }
