"""Tools: schemas from docstrings, bound kwargs, argument checks, built-ins, config errors."""

from __future__ import annotations

import pytest

from groupflow.agents.tools import (
    ToolConfigError,
    build_tools,
    make_tool,
    tool_names,
    tool_result_text,
)
from groupflow.tools.calculator import calculator


def lookup(city: str, unit: str = "C", api_base: str = "x") -> str:
    """Current temperature of a city.

    Args:
        city: the city's name.
        unit: C or F.
        api_base: where to ask.
    """
    return f"{city}: 21{unit}"


def undocumented(x: int) -> int:
    return x


def test_schema_from_docstring_and_bound_kwargs_are_hidden():
    tool = make_tool(lookup, kwargs={"api_base": "http://local"})
    fn = tool.schema["function"]
    assert fn["name"] == "lookup"
    assert fn["description"] == "Current temperature of a city."
    assert set(fn["parameters"]["properties"]) == {"city", "unit"}
    assert fn["parameters"]["required"] == ["city"]
    assert tool.fn(city="Oslo") == "Oslo: 21C"


def test_argument_errors_name_the_problem():
    tool = make_tool(lookup)
    assert tool.argument_error({"city": "Oslo"}) is None
    assert "missing required" in tool.argument_error({"unit": "F"})
    assert "unknown argument(s) ['town']" in tool.argument_error({"city": "a", "town": "b"})
    assert "JSON object" in tool.argument_error(["Oslo"])


def test_undocumented_function_is_refused_with_a_hint():
    with pytest.raises(ToolConfigError, match="docstring with an 'Args:' section"):
        make_tool(undocumented)


def test_unknown_kwarg_is_refused():
    with pytest.raises(ToolConfigError, match=r"no parameter\(s\) \['citty'\]"):
        make_tool(lookup, kwargs={"citty": "x"})


@pytest.mark.parametrize(
    "expr, expected",
    [("347*58", "20126"), ("(2+3)/4", "1.25"), ("7//2", "3"), ("-2**3", "-8"), ("10/4*2", "5"),
     ("2^10", "1024"), ("1/3", "0.333333333333")],
)  # fmt: skip
def test_calculator(expr, expected):
    assert calculator(expr) == expected


@pytest.mark.parametrize(
    "expr, message",
    [("__import__('os')", "only numbers"), ("2**1000", "exponent"), ("1/0", "division"),
     ("2+", "cannot parse"), ("x", "only numbers")],
)  # fmt: skip
def test_calculator_refuses(expr, message):
    with pytest.raises((ValueError, ZeroDivisionError), match=message):
        calculator(expr)


def test_build_tools_from_config(helpers_on_path):
    tools = build_tools(
        [{"name": "calculator", "timeout_s": 2},
         {"function": "agent_helpers:lookup", "label": "weather", "kwargs": {"unit": "F"}}],
        default_timeout_s=9,
    )  # fmt: skip
    assert [t.name for t in tools] == ["calculator", "weather"]
    assert tools[0].timeout_s == 2 and tools[1].timeout_s == 9
    assert tools[1].schema["function"]["name"] == "weather"
    assert tools[1].fn(city="Rome") == "Rome: 21F"
    assert {"calculator", "python"} <= set(tool_names())


def test_the_sandboxed_python_tool_is_a_builtin():
    (tool,) = build_tools([{"name": "python", "kwargs": {"timeout_s": 2}}])
    assert tool.name == "python" and list(tool.parameters) == ["code"]
    assert tool.fn(code="print(6 * 7)").strip() == "42"


def test_build_tools_errors(helpers_on_path):
    with pytest.raises(ToolConfigError, match="unknown built-in tool 'calculater'.*'calculator'"):
        build_tools([{"name": "calculater"}])
    with pytest.raises(ToolConfigError, match="has no attribute 'nope'"):
        build_tools([{"function": "agent_helpers:nope"}])
    with pytest.raises(ToolConfigError, match="needs 'name'"):
        build_tools([{"kwargs": {}}])
    with pytest.raises(ToolConfigError, match="must be unique"):
        build_tools([{"name": "calculator"}, {"name": "calculator"}])
    with pytest.raises(ToolConfigError, match=r"rollout.tools\[1\]: tool 'lookup'.*\['citty'\]"):
        build_tools([{"name": "calculator"}, {"function": "agent_helpers:lookup",
                                               "kwargs": {"citty": "x"}}])  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"timeout": 2}, "'timeout'"),  # python_tool's own check (a ValueError)
        ({"timeout_s": -1}, "timeout_s"),  # the sandbox limits' check
        ({"max_chars": 0}, "max_chars"),
    ],
)
def test_bad_python_tool_kwargs_name_the_key(kwargs, message):
    with pytest.raises(ToolConfigError, match=r"^rollout.tools\[0\].kwargs: .*" + message):
        build_tools([{"name": "python", "kwargs": kwargs}])


def test_result_text():
    assert tool_result_text({"a": 1}) == '{"a": 1}'
    assert tool_result_text(3) == "3"
    assert tool_result_text("x" * 10, max_chars=4) == "xxxx... [6 more characters cut]"
