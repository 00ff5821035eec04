"""What a named benchmark is: its data, prompt format, generation settings, grader and metrics.

Design decision: a benchmark is a plain value (:class:`Benchmark`) built by one small module per
benchmark and named by one registry line (``groupflow.evals.BENCHMARKS``). The runner
(``groupflow.evals.runner``) knows nothing about any one benchmark: it generates with the policy's
rollout engine under the benchmark's settings, hands the responses to ``grade`` and the graded
records to ``metrics``. A benchmark's data comes from an installed package; when it is missing the
error names the pip command (exit 2 at the CLI, like any ValueError).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from groupflow.data import PromptRow

__all__ = ["Benchmark", "BenchmarkData", "BenchmarkDataMissing", "pass_at_k_of"]


class BenchmarkDataMissing(ValueError):
    """A benchmark's data or grader package is not installed; the message names the pip command."""


@dataclass(frozen=True)
class BenchmarkData:
    """The prompts to generate for, in the benchmark's own order (``fields["key"]`` is its id),
    and those left out with the reason (``{key: reason}``: e.g. a grader resource not available
    offline), reported, never silently dropped."""

    rows: list[PromptRow]
    excluded: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Benchmark:
    """``grade(rows, responses) -> records`` scores one response per row (row i of a sample-major
    list: prompt i//k's sample i%k) into one JSON-able dict each; ``metrics(records, k)`` reduces
    them, ``records`` in prompt-major order with ``k`` samples per prompt.

    ``max_new_tokens``: the official harness's budget (a benchmark's own choice, not the training
    config's); ``chat``: the prompt is one user message rendered with the model's chat template."""

    name: str
    description: str
    load: Callable[[], BenchmarkData]
    grade: Callable[[list[PromptRow], list[str]], list[dict[str, Any]]]
    metrics: Callable[[list[dict[str, Any]], int], dict[str, float]]
    max_new_tokens: int
    chat: bool = True


def pass_at_k_of(correct: list[bool], k: int) -> float:
    """Share of prompts (``k`` consecutive entries each) with at least one True."""
    prompts = [correct[i : i + k] for i in range(0, len(correct), k)]
    return sum(any(p) for p in prompts) / max(1, len(prompts))
