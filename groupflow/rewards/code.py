"""Code reward: run the completion's program against the row's test cases; score = pass fraction.

Design decision: the program is the last fenced ```python block of the completion (after
dropping ``<think>…</think>``), else the last untagged fenced block, else the whole completion,
and every run goes through :func:`groupflow.tools.sandbox.run_python`, so a sample that loops,
crashes, floods or attacks the machine scores 0 for the affected tests instead of raising.
Samples (and stdin/stdout cases) run in parallel on a bounded thread pool: each thread only waits
on its subprocess.

Test cases come from the field ``tests`` (else ``ground_truth``, where verl-style rows keep them;
or the field named by the ``field`` option), in one of three shapes — assert statements (MBPP /
HumanEval style), verl / PRIME / APPS ``{"inputs": [...], "outputs": [...]}`` (stdin/stdout, or
calls of ``fn_name``), or a list of ``{"input": ..., "output": ...}`` pairs — parsed and checked
by ``rewards.code_cases``. They run in ``rewards.code_harness``, where expected outputs never
enter the sandbox: the child only computes, the parent judges. This module is the reward itself:
the completion's program, the options, the sandbox's resolution, and the sandbox-failure count.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from typing import Any

from groupflow.rewards.base import RewardConfigError
from groupflow.rewards.code_cases import CodeTests, parse_tests
from groupflow.rewards.code_harness import run_code_tests
from groupflow.tools.sandbox import (
    SandboxBroken,
    SandboxLimits,
    SandboxUnavailable,
    resolve_sandbox,
)


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

    def take_metrics() -> dict[str, int]:
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
