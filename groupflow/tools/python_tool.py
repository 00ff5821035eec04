"""The ``python`` tool: a model sends code, gets back a short text of what it printed.

Design decision: the tool is an ordinary function ``python(code: str) -> str`` whose docstring
is the description the model sees (``transformers.utils.get_json_schema`` reads it), built by
:func:`python_tool` with the sandbox limits baked in, so configs can reference either the
ready-made :data:`python` or a factory call. The reply is meant for a model's context window:
stdout (a final bare expression is echoed, notebook style), then on failure only the error's last
line and where it happened (``ZeroDivisionError: division by zero (line 2)``) rather than a
traceback, and every cut is marked
so the model can tell a truncated answer from a complete one. When the sandbox itself fails (not
the code), the tool raises ``SandboxError`` rather than answer: the tool environment turns that
into an error observation and counts it, and the reply is never mistaken for the program's output.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from groupflow.tools.sandbox import (
    MAIN_FILE,
    SandboxLimits,
    SandboxResult,
    resolve_sandbox,
    run_python,
)

DEFAULT_MAX_CHARS = 2000
NO_OUTPUT = "(no output; print() what you want to see)"
# Where in the model's own code the error happened: the last main.py frame of the traceback
# (a SyntaxError's report names the file and line the same way).
_USER_LINE = re.compile(rf'File "{re.escape(MAIN_FILE)}", line (\d+)')


def format_result(result: SandboxResult, limits: SandboxLimits, max_chars: int) -> str:
    """The tool reply for one run: stdout (at most ``max_chars``, the cut marked) plus, if the
    run failed or was stopped, one line saying why."""
    text = result.stdout.rstrip("\n")
    if len(text) > max_chars:
        text = text[:max_chars] + f"\n[... {len(text) - max_chars} more characters not shown]"
    status = _status_line(result, limits)
    if status:
        text = f"{text}\n{status}" if text else status
    return text or NO_OUTPUT


def _status_line(result: SandboxResult, limits: SandboxLimits) -> str:
    if result.stdout_truncated:
        return f"[output exceeded {limits.max_output_bytes} bytes; the program was stopped]"
    if result.stderr_truncated:
        return f"[error output exceeded {limits.max_output_bytes} bytes; the program was stopped]"
    if result.limit == "wall_time":
        return f"Error: timed out after {limits.timeout_s:g} s"
    if result.limit == "cpu_time":
        return f"Error: CPU time limit of {limits.cpu_seconds} s exceeded"
    if not result.ok:
        if not result.error_line:
            return f"Error: exit code {result.exit_code}"
        lines = _USER_LINE.findall(result.stderr)
        return f"{result.error_line} (line {lines[-1]})" if lines else result.error_line
    return ""


def python_tool(
    *,
    max_chars: int = DEFAULT_MAX_CHARS,
    sandbox: Any = None,
    _resolve_now: bool = True,
    **limits: Any,
) -> Callable[[str], str]:
    """A ``python(code) -> str`` tool with the given sandbox limits.

    ``limits`` are :class:`SandboxLimits` fields (``timeout_s``, ``cpu_time_s``, ``memory_mb``,
    ``max_output_bytes``, ``max_file_mb``, ``max_open_files``, ``max_disk_mb``,
    ``max_processes``); they are checked here, when the tool is built. ``max_chars`` bounds the
    reply the model reads (``max_output_bytes`` bounds what the program may print before it is
    stopped). ``sandbox`` picks the backend (see :func:`groupflow.tools.sandbox.resolve_sandbox`);
    it is resolved here too, so a machine where no isolating sandbox works refuses to build the
    tool (SandboxUnavailable says what to install).
    """
    valid = [f.name for f in dataclasses.fields(SandboxLimits)]
    unknown = sorted(set(limits) - set(valid))
    if unknown:
        raise ValueError(f"python_tool: unknown option {unknown[0]!r}; valid options: {valid}")
    checked = SandboxLimits(**limits)
    if _resolve_now:
        sandbox = resolve_sandbox(sandbox)
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1:
        raise ValueError(f"python_tool: max_chars must be a positive integer, got {max_chars!r}")

    def python(code: str) -> str:
        """Run Python code and return what it prints.

        Each call starts a fresh Python process with no network access, so define everything
        you need in the same call. The value of a final expression is printed, as in a notebook.
        On an error, the last line of the error message is returned.

        Args:
            code: The complete Python program to run, e.g. "print(123 * 456)".
        """
        # a SandboxError (the sandbox failed, not the code) is raised, never shown as output:
        # the tool environment counts it (rollout/sandbox_failures); SandboxBroken stops the run
        result = run_python(code, echo_last_expression=True, sandbox=sandbox, **checked.as_kwargs())
        return format_result(result, checked, max_chars)

    return python


# The ready-made tool resolves its sandbox on first call, so importing this module never fails
# on a machine without one; configs build tools through the factory, which resolves at once.
python = python_tool(_resolve_now=False)
