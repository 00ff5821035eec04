"""Code-reward runs: each program against its parsed tests in the sandbox, judged outside it.

Design decision: every run goes through :func:`groupflow.tools.sandbox.run_python`, and a
sandbox that fails (not the program) gives the sample no verdict (``CodeReport.sandbox_failed``)
rather than a 0. Samples (and stdin/stdout cases) run in parallel on a bounded thread pool: each
thread only waits on its subprocess.

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
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from groupflow.rewards.code_cases import CodeTests
from groupflow.rewards.errors import FailedScore
from groupflow.tools.sandbox import SandboxError, SandboxLimits, run_python

__all__ = ["HARNESS", "CodeReport", "SplitAssert", "run_code_tests", "split_assert"]


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


def _harness_cases(tests: CodeTests) -> tuple[list[Any], list[SplitAssert | None]]:
    """The cases as the harness receives them, and each assert's split (call tests: none)."""
    if tests.kind == "call":
        return [args for args, _ in tests.cases], []
    splits = [split_assert(statement) for statement in tests.cases]
    cases = [
        ("stmt", statement)
        if split is None
        else ("ident" if split.op in ("is", "is not") else "expr", split.expr)
        for split, statement in zip(splits, tests.cases)
    ]
    return cases, splits


def _read_reports(stdout: str, token: str, tests: CodeTests,
                  splits: list[SplitAssert | None]) -> tuple[dict[int, bool], str]:  # fmt: skip
    """Each case's outcome from the harness's token-prefixed report lines, and the first error.
    Lines without the run's secret token are the program's own output; a case reported twice
    (only a solution that forges reports does that) fails."""
    outcomes: dict[int, bool] = {}
    reported: set[int] = set()
    first_error = ""
    prefix = "[" + json.dumps(token)
    for line in stdout.splitlines():
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
        if index in reported:
            outcomes[index] = False
            first_error = first_error or f"case {index}: reported twice"
            continue
        reported.add(index)
        outcomes[index], error = _case_outcome(tests, splits, index, status, detail)
        first_error = first_error or error
    return outcomes, first_error


def _harness_run(code: str, tests: CodeTests, limits: SandboxLimits, sandbox: Any) -> CodeReport:
    """Assert or call tests: one sandbox run for all cases of the sample."""
    token = secrets.token_hex(16)
    cases, splits = _harness_cases(tests)
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
    outcomes, first_error = _read_reports(result.stdout, token, tests, splits)
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
