import pytest
from transformers.utils import get_json_schema

from groupflow.tools.python_tool import NO_OUTPUT, python, python_tool


def test_schema_for_a_chat_template():
    schema = get_json_schema(python)
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "python"
    assert function["description"].startswith("Run Python code and return what it prints.")
    assert function["parameters"] == {
        "type": "object",
        "properties": {
            "code": {
                "type": "string",
                "description": 'The complete Python program to run, e.g. "print(123 * 456)".',
            }
        },
        "required": ["code"],
    }
    # A configured tool is described the same way.
    assert get_json_schema(python_tool(timeout_s=1)) == schema


def test_prints_and_final_expression():
    assert python("print(123 * 456)") == "56088"
    assert python("x = 2**10\nx - 24") == "1000"
    assert python("print('a')\nprint('b')") == "a\nb"
    assert python("x = 1") == NO_OUTPUT


def test_error_is_the_last_line_after_what_was_printed():
    assert python("print('start')\n1 / 0") == "start\nZeroDivisionError: division by zero (line 2)"
    assert python("def f(x):\n    return 1 / x\n\nf(0)") == (
        "ZeroDivisionError: division by zero (line 2)"  # the innermost frame of the model's code
    )
    assert python("x = 1\nif x\n    pass") == "SyntaxError: expected ':' (line 2)"
    assert python("import sys\nsys.exit(4)") == "Error: exit code 4"
    # The opt-in guard refuses with a message of its own; the OS sandbox has nothing to refuse.
    refused = python_tool(sandbox="guard")("import os\nos.fork()")
    assert refused == (
        "PermissionError: sandbox: os.fork is not allowed (model code may not start processes)"
        " (line 2)"
    )


def test_timeout_keeps_earlier_output():
    tool = python_tool(timeout_s=0.5)
    assert tool("print('thinking')\nwhile True:\n    pass") == (
        "thinking\nError: timed out after 0.5 s"
    )


def test_flood_and_long_output_are_marked():
    tool = python_tool(max_output_bytes=1000, max_chars=100)
    flooded = tool("while True:\n    print('y' * 50)")
    assert flooded.endswith(
        "\n[... 900 more characters not shown]\n"
        "[output exceeded 1000 bytes; the program was stopped]"
    )
    assert flooded.startswith("y" * 50 + "\n" + "y" * 49)
    long = python_tool(max_chars=10)("print('z' * 25)")
    assert long == "z" * 10 + "\n[... 15 more characters not shown]"


def test_memory_limit_reaches_the_model_as_memory_error():
    assert python_tool(memory_mb=64)("x = bytearray(10**9)") == "MemoryError (line 1)"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout_s": -1}, "timeout_s must be a positive number"),
        ({"memory_mb": "lots"}, "memory_mb must be an integer"),
        ({"max_chars": 0}, "max_chars must be a positive integer"),
    ],
)
def test_bad_limits_fail_when_the_tool_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        python_tool(**kwargs)


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown option 'timeout'; valid options: \['timeout_s'"):
        python_tool(timeout=1)


def test_the_default_tool_runs_in_the_os_sandbox():
    assert python("open('/usr/x', 'w')") == (
        "OSError: [Errno 30] Read-only file system: '/usr/x' (line 1)"
    )
    assert python("import os\nsorted(os.listdir('/proc'))[:2]") == "['1', '2']"  # its own PIDs


def test_no_isolating_sandbox_refuses_to_build_the_tool(monkeypatch):
    from groupflow.tools import sandbox
    from groupflow.tools.sandbox import bwrap

    monkeypatch.setattr(bwrap, "bwrap_path", lambda: None)
    monkeypatch.setattr(sandbox, "_resolved", {})
    monkeypatch.delenv("GROUPFLOW_SANDBOX", raising=False)
    with pytest.raises(sandbox.SandboxUnavailable, match="apt-get install bubblewrap"):
        python_tool()
    assert python_tool(sandbox="guard")("print(1)") == "1"  # an explicit opt-in still works
