"""Tool-call parsers: Hermes JSON calls and compact tag calls, with malformed input reported."""

from __future__ import annotations

import pytest

from groupflow.agents.parsers import ToolCall, build_parser
from groupflow.agents.tools import ToolConfigError, make_tool
from groupflow.tools.calculator import calculator

TOOLS = {"calculator": make_tool(calculator)}


def test_hermes_calls():
    text = (
        'Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}'
        '\n</tool_call><tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3\\"}"}'
        "</tool_call>"
    )
    parsed = build_parser("hermes").parse(text, TOOLS)
    assert parsed.calls == [
        ToolCall("calculator", {"expression": "2+2"}),
        ToolCall("calculator", {"expression": "3"}),
    ]
    assert not parsed.errors


def test_hermes_malformed_and_unterminated():
    parsed = build_parser("hermes").parse("<tool_call>{name: calculator}</tool_call>", TOOLS)
    assert not parsed.calls and "not valid JSON" in parsed.errors[0]
    parsed = build_parser("hermes").parse('<tool_call>["calculator"]</tool_call>', TOOLS)
    assert '{"name": ..., "arguments": {...}}' in parsed.errors[0]
    # cut by a stop string or the token limit: the call is still read
    parsed = build_parser("hermes").parse('<tool_call>{"name": "calculator"}', TOOLS)
    assert parsed.calls == [ToolCall("calculator", {})]


def test_no_call_is_empty():
    assert not build_parser("hermes").parse("The answer is 4.", TOOLS)
    assert not build_parser("tag").parse("The answer is 4.", TOOLS)


def test_tag_calls_fill_the_first_parameter():
    parsed = build_parser("tag").parse(
        "<calculator>347*58</calculator> and <other>x</other>", TOOLS
    )
    assert parsed.calls == [ToolCall("calculator", {"expression": "347*58"})]


def test_unknown_parser():
    with pytest.raises(ToolConfigError, match="unknown parser 'json'.*hermes"):
        build_parser("json")
