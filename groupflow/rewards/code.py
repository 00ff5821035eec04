"""Code reward: run the completion's program against the row's test cases; score = pass fraction.

Design decision: the program is the last fenced ```python block of the completion (after
dropping ``<think>…</think>``), else the last untagged fenced block, else the whole completion,
and every run goes through :func:`groupflow.tools.sandbox.run_python`, so a sample that loops,
crashes, floods or attacks the machine scores 0 for the affected tests instead of raising.
Samples (and stdin/stdout cases) run in parallel on a bounded thread pool: each thread only waits
on its subprocess.

Test cases come from the field ``tests`` (else ``ground_truth``, where verl-style rows keep them;
or the field named by the ``field`` option), in one of three shapes:

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

Expected outputs never enter the sandbox, because the solution runs in the same interpreter as
the harness and can reach anything in it (frames, ``gc``, the harness's report function). The
child only *computes*: call tests return each call's value (JSON), stdin/stdout tests their
stdout, and an assert statement of the shape ``assert EXPR == LITERAL`` (or ``LITERAL == EXPR``,
``!=``, ``is``/``is not`` None/True/False) is split: the child evaluates ``EXPR`` and returns its
``repr`` when it is a plain value — exactly a builtin scalar, or a list, tuple, set or dict of
them, whose ``repr`` reads back as the same value (a subclass or any other object could print as
one value and compare as another: it fails the case) — and the parent compares it with the
literal (``ast.literal_eval``); for ``is``/``is not`` the child reports the value's identity (None,
True, False or other), which no object can fake. A solution that
forges reports (it can find the random token that tags them) therefore still has to produce the
right values without knowing them, i.e. solve the problem; a case reported twice fails. Assert
statements of any other shape (``assert f(x) > 3``, several statements, a call of a helper) can
only run inside the child, where a determined solution can fake their outcome: they guard
against wrong code, not against a policy that learns to attack the harness. Prefer call or
stdin/stdout tests, or asserts against literals, for RL rewards.
"""

from __future__ import annotations

import ast
import concurrent.futures
import json
import os
import re
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from groupflow.rewards.base import RewardConfigError
from groupflow.rewards.errors import FailedScore
from groupflow.tools.sandbox import (
    SandboxBroken,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
    resolve_sandbox,
    run_python,
)

KINDS = ("assert", "stdio", "call")


class CodeSandboxError(RewardConfigError):
    """The code sandbox keeps failing (``SandboxBroken``): the run stops. A RewardConfigError so
    that it is never isolated per sample: the machine's sandbox, not a sample, is at fault."""


_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
# A fenced block: an opening fence line with an optional language tag, then everything up to
# the next fence line or the end of the text (a generation cut off inside its code block).
_FENCE = re.compile(
    r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.DOTALL | re.MULTILINE
)
_PYTHON_TAGS = ("python", "py", "python3")


def extract_code(completion: str) -> str:
    """The program in a completion (see the module docstring for the rule)."""
    text = _THINK.sub("", completion)
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    for tags in (_PYTHON_TAGS, ("",)):
        chosen = [body for tag, body in blocks if tag in tags]
        if chosen:
            return chosen[-1]
    return text


# --------------------------------------------------------------------------------------------
# Test-case rows


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


# --------------------------------------------------------------------------------------------
# Running


# The harness for assert and call tests, run as main.py with the solution in solution.py. Its
# instructions (and the token that tags its reports) arrive on stdin, which it closes before
# loading the solution; reports go to a duplicate of stdout, so the solution's own prints (or a
# closed sys.stdout) do not mix with them. It holds no expected value: "expr" cases return the
# repr of a value and "call" cases its JSON, for the parent to compare.
HARNESS = r"""
import json, os, sys

def _describe(exc):
    return f"{type(exc).__name__}: {exc}"[:300]

def _plain(value):
    # numpy scalars print as np.int64(3); the parent reads literals
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()
    return value

_SCALARS = (int, float, complex, str, bytes, bool, type(None))

def _is_plain(value, depth=0):
    # exactly the builtin types whose repr reads back as the same value: a subclass, or any other
    # object, could print as one value and compare as another
    kind = type(value)
    if kind in _SCALARS:
        return True
    if depth > 20:
        return False
    if kind in (list, tuple, set, frozenset):
        return all(_is_plain(v, depth + 1) for v in value)
    if kind is dict:
        return all(_is_plain(k, depth + 1) and _is_plain(v, depth + 1) for k, v in value.items())
    return False

def _identity(value):
    # what `is` compares, which no object can fake: None, True, False or something else
    return "None" if value is None else "True" if value is True else "False" if value is False else "other"

def _main():
    spec = json.loads(sys.stdin.readline())
    sys.stdin.close()
    os.close(0)
    out = os.dup(1)

    def report(index, status, detail=""):
        os.write(out, ("\n" + json.dumps([spec["token"], index, status, detail]) + "\n").encode())

    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        with open("solution.py", encoding="utf-8") as f:
            exec(compile(f.read(), "solution.py", "exec"), namespace)
    except BaseException as exc:
        report(-1, "error", "loading the solution: " + _describe(exc))
        return
    if spec["kind"] == "assert":
        for i, (how, source) in enumerate(spec["cases"]):
            try:
                if how == "stmt":
                    exec(compile(source, f"<test {i}>", "exec"), namespace)
                    status, value = "pass", ""
                else:
                    value = _plain(eval(compile(source, f"<test {i}>", "eval"), namespace))
                    if how == "ident":
                        status, value = "ident", _identity(value)
                    elif _is_plain(value):
                        status, value = "value", repr(value)
                    else:
                        status, value = "opaque", type(value).__qualname__
            except BaseException as exc:
                report(i, "fail", _describe(exc))
            else:
                report(i, status, value)
        return
    name = spec["fn_name"]
    target = namespace.get("Solution")
    fn = getattr(target(), name, None) if isinstance(target, type) else None
    fn = fn if fn is not None else namespace.get(name)
    if not callable(fn):
        report(-1, "error", f"the solution defines no function {name!r}")
        return
    for i, args in enumerate(spec["cases"]):
        try:
            value = json.dumps(_plain(fn(*args)))
        except BaseException as exc:
            report(i, "fail", _describe(exc))
        else:
            report(i, "value", value)

_main()
"""

_LITERAL_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is", ast.IsNot: "is not"}


@dataclass(frozen=True)
class SplitAssert:
    """``assert EXPR OP LITERAL`` taken apart: the child evaluates ``expr``, the parent compares."""

    expr: str
    op: str
    expected: Any

    def holds(self, value: Any) -> bool:
        if self.op == "==":
            return bool(value == self.expected)
        if self.op == "!=":
            return bool(value != self.expected)
        same = value is self.expected
        return same if self.op == "is" else not same


def split_assert(statement: str) -> SplitAssert | None:
    """The parts of a single ``assert EXPR OP LITERAL`` (either side literal), else None.

    ``is``/``is not`` are split only against None, True or False (identity of other literals
    does not survive a round trip through ``repr``).
    """
    try:
        tree = ast.parse(statement)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    test = tree.body[0].test
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return None
    op = _LITERAL_OPS.get(type(test.ops[0]))
    if op is None:
        return None
    for expr, literal in ((test.left, test.comparators[0]), (test.comparators[0], test.left)):
        try:
            expected = ast.literal_eval(literal)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        if op in ("is", "is not") and not (expected is None or isinstance(expected, bool)):
            return None
        return SplitAssert(ast.unparse(expr), op, expected)
    return None


@dataclass(frozen=True)
class CodeReport:
    """How one sample did: ``passed`` of ``total`` cases, and the first problem seen;
    ``sandbox_failed``: the sandbox failed (not the program), so there is no score."""

    passed: int
    total: int
    first_error: str = ""
    sandbox_failed: bool = False

    def score(self, partial_credit: bool = True) -> float:
        if self.sandbox_failed:
            return FailedScore(f"code sandbox failed: {self.first_error}")
        if self.total == 0:
            return 0.0
        if partial_credit:
            return self.passed / self.total
        return float(self.passed == self.total)


def _normalize_stdout(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")


def _stdio_case(
    code: str, stdin: str, expected: str, limits: SandboxLimits, sandbox: Any
) -> tuple[bool, str] | CodeReport:
    try:
        result = run_python(code, stdin=stdin, sandbox=sandbox, **limits.as_kwargs())
    except SandboxError as exc:
        return CodeReport(0, 1, str(exc), sandbox_failed=True)
    if not result.ok:
        return False, result.error_line or f"exit code {result.exit_code}, limit {result.limit}"
    if _normalize_stdout(result.stdout) != _normalize_stdout(expected):
        return False, f"wrong output for input {stdin[:80]!r}"
    return True, ""


def _call_passed(value_json: str, expected: Any) -> bool:
    try:
        value = json.loads(value_json)
    except (ValueError, TypeError):
        return False
    if value == expected:
        return True
    return isinstance(expected, list) and len(expected) == 1 and value == expected[0]


def _assert_passed(value_repr: str, split: SplitAssert) -> bool:
    try:
        value = ast.literal_eval(value_repr)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False  # not a plain value (an object whose __eq__ might say anything)
    return split.holds(value)


def _case_outcome(
    tests: CodeTests, splits: list[SplitAssert | None], index: int, status: str, detail: Any
) -> tuple[bool, str]:
    """Whether case ``index`` passed, judged here from what the child computed."""
    if status == "fail":
        return False, f"case {index}: {str(detail)[:200]}"
    if tests.kind == "call":
        if status == "value" and isinstance(detail, str):
            if _call_passed(detail, tests.cases[index][1]):
                return True, ""
            return False, f"case {index}: returned {detail[:80]}"
        return False, f"case {index}: no value reported ({status!r})"
    split = splits[index]
    if split is not None:
        if status == "ident" and split.op in ("is", "is not") and isinstance(detail, str):
            if (detail == repr(split.expected)) == (split.op == "is"):
                return True, ""
        elif status == "opaque":
            return False, f"case {index}: got a {str(detail)[:80]}, not a plain value to compare"
        elif status == "value" and isinstance(detail, str) and _assert_passed(detail, split):
            return True, ""
        return (
            False,
            f"case {index}: got {str(detail)[:80]}, expected {split.op} {split.expected!r}",
        )
    return status == "pass", "" if status == "pass" else f"case {index}: {status!r}"


def _harness_run(code: str, tests: CodeTests, limits: SandboxLimits, sandbox: Any) -> CodeReport:
    """Assert or call tests: one sandbox run for all cases of the sample."""
    token = secrets.token_hex(16)
    splits: list[SplitAssert | None] = []
    if tests.kind == "call":
        cases: list[Any] = [args for args, _ in tests.cases]
    else:
        splits = [split_assert(statement) for statement in tests.cases]
        cases = [
            ("stmt", statement)
            if split is None
            else ("ident" if split.op in ("is", "is not") else "expr", split.expr)
            for split, statement in zip(splits, tests.cases)
        ]
    spec = {"token": token, "kind": tests.kind, "cases": cases, "fn_name": tests.fn_name}
    try:
        result = run_python(
            HARNESS,
            stdin=json.dumps(spec) + "\n",
            files={"solution.py": code},
            sandbox=sandbox,
            **limits.as_kwargs(),
        )
    except SandboxError as exc:  # no verdict on the program: its own kind of failure
        return CodeReport(0, len(tests.cases), str(exc), sandbox_failed=True)
    outcomes: dict[int, bool] = {}
    reported: set[int] = set()
    first_error = ""
    prefix = "[" + json.dumps(token)
    for line in result.stdout.splitlines():
        if not line.startswith(prefix):
            continue
        try:
            _, index, status, detail = json.loads(line)
        except (ValueError, TypeError):
            continue
        if index == -1:
            first_error = first_error or str(detail)
            continue
        if not isinstance(index, int) or not 0 <= index < len(tests.cases):
            continue
        if index in reported:  # only a solution that forges reports says a case twice
            outcomes[index] = False
            first_error = first_error or f"case {index}: reported twice"
            continue
        reported.add(index)
        outcomes[index], error = _case_outcome(tests, splits, index, status, detail)
        first_error = first_error or error
    if len(outcomes) < len(tests.cases) and not first_error:
        first_error = result.error_line or f"stopped: {result.limit or result.exit_code}"
    return CodeReport(sum(outcomes.values()), len(tests.cases), first_error)


def run_code_tests(
    codes: Sequence[str],
    tests: Sequence[CodeTests],
    limits: SandboxLimits,
    max_workers: int = 2,
    sandbox: Any = None,
) -> list[CodeReport]:
    """Run each program against its tests, in parallel on ``max_workers`` threads.

    A sandbox that fails (bubblewrap's own error, a remote service that does not answer) makes
    that sample's report ``sandbox_failed``: no score, never a 0 for the program; one broken on
    every run raises SandboxBroken."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers) as pool:
        pending: list[Any] = []
        for code, suite in zip(codes, tests):
            if not code.strip():
                pending.append(CodeReport(0, len(suite.cases), "no code in the completion"))
            elif suite.kind == "stdio":
                pending.append(
                    [pool.submit(_stdio_case, code, x, y, limits, sandbox) for x, y in suite.cases]
                )
            else:
                pending.append(pool.submit(_harness_run, code, suite, limits, sandbox))
        return [_collect(item) for item in pending]


def _collect(item: Any) -> CodeReport:
    if isinstance(item, CodeReport):
        return item
    if isinstance(item, concurrent.futures.Future):
        return item.result()
    outcomes = [future.result() for future in item]
    failed = [o for o in outcomes if isinstance(o, CodeReport)]
    if failed:  # a case's sandbox failed: the sample has no verdict
        return CodeReport(0, len(outcomes), failed[0].first_error, sandbox_failed=True)
    errors = [error for ok, error in outcomes if not ok]
    return CodeReport(sum(ok for ok, _ in outcomes), len(outcomes), errors[0] if errors else "")


# --------------------------------------------------------------------------------------------
# The reward


def default_workers() -> int:
    """Threads that run samples: the CPUs this process may use, at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, cpus or 1))


def make_code_tests_reward(
    timeout_s: float = 5.0,
    cpu_time_s: float | None = None,
    memory_mb: int = 512,
    max_output_bytes: int = 1 << 20,
    partial_credit: bool = True,
    max_tests: int | None = None,
    max_workers: int | None = None,
    field: str | None = None,
    sandbox: Any = None,
) -> Callable[..., list[float]]:
    """Pass fraction of the row's tests (``partial_credit=False``: 1.0 only if all pass).

    ``timeout_s`` (and the other limits, see :class:`SandboxLimits`) apply to each sandbox run:
    per case for stdin/stdout tests, per sample for assert and call tests (one run holds all of
    them; cases reported before a timeout still count). ``max_tests`` keeps each row's first N
    cases; ``max_workers`` defaults to :func:`default_workers`; ``field`` names the test-case
    field (default: ``tests``, else ``ground_truth``); ``sandbox`` picks the backend (see
    :func:`groupflow.tools.sandbox.resolve_sandbox`), resolved now: without an isolating sandbox
    the reward refuses to build, saying what to install.
    """
    try:
        limits = SandboxLimits(timeout_s, cpu_time_s, memory_mb, max_output_bytes)
    except ValueError as exc:
        raise RewardConfigError(f"code_tests: {exc}") from None
    for name, value in (("max_tests", max_tests), ("max_workers", max_workers)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise RewardConfigError(f"code_tests: {name} must be a positive integer, got {value!r}")
    if not isinstance(partial_credit, bool):
        raise RewardConfigError(
            f"code_tests: partial_credit must be true or false, got {partial_credit!r}"
        )
    if field is not None and (not isinstance(field, str) or not field):
        raise RewardConfigError(f"code_tests: field must be a field name, got {field!r}")
    workers = max_workers or default_workers()
    try:
        backend = resolve_sandbox(sandbox)
    except (ValueError, SandboxUnavailable) as exc:
        raise RewardConfigError(f"code_tests: {exc}") from None

    def code_tests(completions: list[str], **fields: Any) -> list[float]:
        name = _tests_field(fields, field)
        suites = []
        for i, value in enumerate(fields[name]):
            try:
                suite = parse_tests(value, name)
            except ValueError as exc:
                raise ValueError(f"{exc} (sample {i})") from None
            suites.append(CodeTests(suite.kind, suite.cases[:max_tests], suite.fn_name))
        codes = [extract_code(c) for c in completions]
        try:
            reports = run_code_tests(codes, suites, limits, workers, backend)
        except SandboxBroken as exc:
            raise CodeSandboxError(f"code_tests: {exc}") from exc
        with counts_lock:
            counts["sandbox_failures"] += sum(r.sandbox_failed for r in reports)
        return [report.score(partial_credit) for report in reports]

    def take_metrics() -> dict[str, float]:
        """Samples whose sandbox failed since the last call (reward/<name>/sandbox_failures)."""
        with counts_lock:
            taken, counts["sandbox_failures"] = dict(counts), 0
        return taken

    counts = {"sandbox_failures": 0}
    counts_lock = threading.Lock()
    code_tests.take_metrics = take_metrics
    return code_tests


def _tests_field(fields: dict[str, Any], field: str | None) -> str:
    names = (field,) if field else ("tests", "ground_truth")
    for name in names:
        if name in fields:
            return name
    raise RewardConfigError(
        "reward 'code_tests' reads test cases from field "
        + " or ".join(repr(n) for n in names)
        + f", which the batch lacks; available fields: {sorted(fields)}"
    )
