"""Code-reward test cases: a row's test-case field, parsed and checked into :class:`CodeTests`.

Design decision: every shape a dataset keeps its tests in is normalised here, once per row and
before anything runs, into one of three kinds — ``assert`` statements, ``stdio`` (stdin, stdout)
pairs, or ``call`` (arguments, return value) pairs of ``fn_name`` — so the harness
(``rewards.code_harness``) runs only these three, and a malformed row is a ValueError naming its
field instead of a program that scores 0. The shapes:

1. **Assert statements** (MBPP / HumanEval style): a list of strings such as
   ``["assert add(1, 2) == 3", ...]``. The solution is loaded as a module (``__name__`` is
   ``"solution"``, so a ``__main__`` block does not run), then each statement runs in its
   namespace, in order; a statement passes if it raises nothing. A single string is one test
   (it must contain an ``assert``, so that a stray answer such as ``"72"`` is not a test).
2. **verl / PRIME / APPS** (what verl's ``prime_code`` and ``sandbox_fusion`` read from
   ``reward_model.ground_truth``): a dict, or its JSON string, ``{"inputs": [...], "outputs":
   [...]}``. Without ``fn_name``, each input is the program's stdin and its stdout must equal
   the output (lists of lines are joined with newlines; trailing spaces on lines and blank lines
   at the ends are ignored); the program must exit with status 0. With ``fn_name``, the function
   (or the method of ``class Solution``) is called: an input is a string with one JSON value per
   line (the arguments) or a list of arguments, an output is the JSON of the return value (or
   the value itself); a return value equal to the one element of a one-element list output also
   passes (APPS/TACO wrap them so).
3. **stdin/stdout pairs**: a list of ``{"input": ..., "output": ...}`` dicts, as in shape 2.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["KINDS", "CodeTests", "parse_tests"]

KINDS = ("assert", "stdio", "call")


@dataclass(frozen=True)
class CodeTests:
    """One row's test cases, normalised.

    ``kind`` is ``"assert"`` (``cases``: statements), ``"stdio"`` (``cases``: (stdin, expected
    stdout) pairs) or ``"call"`` (``cases``: (argument list, expected return value) pairs,
    calling ``fn_name``).
    """

    kind: str
    cases: tuple[Any, ...]
    fn_name: str | None = None


def parse_tests(value: Any, field: str = "tests") -> CodeTests:
    """Turn a row's test-case field into :class:`CodeTests`; ValueError names ``field``."""
    where = f"code_tests: field {field!r}"
    if isinstance(value, str):
        stripped = value.lstrip()
        if stripped.startswith(("{", "[")):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where} looks like JSON but does not parse: {exc}") from None
        elif not any(isinstance(node, ast.Assert) for node in ast.walk(_parse(value, where))):
            # A bare string that asserts nothing (a math answer such as "72" in ground_truth)
            # would pass for any program.
            raise ValueError(f"{where} is a string with no assert statement: {value[:80]!r}")
        else:
            return _asserts([value], where)
    if isinstance(value, dict):
        return _in_out(value, where)
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, dict) for v in value):
            pairs = [_pair(v, f"{where}[{i}]") for i, v in enumerate(value)]
            return _in_out(
                {"inputs": [p[0] for p in pairs], "outputs": [p[1] for p in pairs]}, where
            )
        return _asserts(value, where)
    raise ValueError(
        f"{where} must be a list of assert statements, a dict with 'inputs' and 'outputs' "
        f"(or its JSON string) or a list of {{'input', 'output'}} dicts; got {type(value).__name__}"
    )


def _asserts(value: Sequence[Any], where: str) -> CodeTests:
    if not value:
        raise ValueError(f"{where} has no test cases")
    for i, statement in enumerate(value):
        if not isinstance(statement, str) or not statement.strip():
            raise ValueError(
                f"{where}[{i}] must be a non-empty string (an assert statement), got {statement!r}"
            )
        _parse(statement, f"{where}[{i}]")
    return CodeTests("assert", tuple(value))


def _parse(source: str, where: str) -> ast.Module:
    try:
        return ast.parse(source)
    except SyntaxError as exc:
        raise ValueError(f"{where} is not valid Python ({exc.msg}): {source[:80]!r}") from None


def _pair(case: dict, where: str) -> tuple[Any, Any]:
    missing = [k for k in ("input", "output") if k not in case]
    if missing:
        raise ValueError(
            f"{where} lacks key {missing[0]!r}; expected {{'input': ..., 'output': ...}}"
        )
    return case["input"], case["output"]


def _in_out(value: dict, where: str) -> CodeTests:
    for key in ("inputs", "outputs"):
        if key not in value:
            raise ValueError(f"{where} lacks key {key!r}; keys present: {sorted(value)}")
        if not isinstance(value[key], (list, tuple)):
            raise ValueError(f"{where}: {key!r} must be a list, got {type(value[key]).__name__}")
    inputs, outputs = value["inputs"], value["outputs"]
    if len(inputs) != len(outputs):
        raise ValueError(f"{where} has {len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise ValueError(f"{where} has no test cases")
    fn_name = value.get("fn_name")
    if fn_name is None:
        cases = [
            (_text(x, f"{where}: inputs[{i}]"), _text(y, f"{where}: outputs[{i}]"))
            for i, (x, y) in enumerate(zip(inputs, outputs))
        ]
        return CodeTests("stdio", tuple(cases))
    if not isinstance(fn_name, str) or not fn_name.isidentifier():
        raise ValueError(f"{where}: fn_name must be a function name, got {fn_name!r}")
    cases = [
        (_arguments(x, f"{where}: inputs[{i}]"), _expected(y, f"{where}: outputs[{i}]"))
        for i, (x, y) in enumerate(zip(inputs, outputs))
    ]
    return CodeTests("call", tuple(cases), fn_name)


def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    raise ValueError(f"{where} must be a string or a list of lines, got {value!r}")


def _arguments(value: Any, where: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return list(value)
    if not isinstance(value, str):
        raise ValueError(f"{where} must be JSON lines (one argument each) or a list, got {value!r}")
    try:
        return [json.loads(line) for line in value.split("\n") if line.strip()]
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: an argument line is not JSON ({exc}): {value!r}") from None


def _expected(value: Any, where: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not JSON ({exc}): {value!r}") from None
