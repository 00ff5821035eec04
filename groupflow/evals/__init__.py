"""Named benchmarks (``groupflow eval CONFIG --benchmark NAME``, ``validation.benchmarks``).

Design decision: one module per benchmark family, one line here per benchmark; the runner
(:mod:`groupflow.evals.runner`) works for any :class:`Benchmark` in :data:`BENCHMARKS`.
"""

from __future__ import annotations

from groupflow.evals.base import Benchmark, BenchmarkData, BenchmarkDataMissing
from groupflow.evals.ifbench import IFBENCH
from groupflow.evals.ifeval import IFEVAL
from groupflow.evals.reward_tasks import GSM8K, TASK_BENCHMARKS

__all__ = ["BENCHMARKS", "Benchmark", "BenchmarkData", "BenchmarkDataMissing", "get_benchmark"]

BENCHMARKS: dict[str, Benchmark] = {
    "ifeval": IFEVAL,
    "ifbench": IFBENCH,
    "gsm8k": GSM8K,
    **TASK_BENCHMARKS,  # reverse, add, calc, instructions: the built-in tasks' held-out sets
}


def get_benchmark(name: str) -> Benchmark:
    """The benchmark called ``name``; a ValueError listing the known names otherwise."""
    if name not in BENCHMARKS:
        known = ", ".join(sorted(BENCHMARKS))
        raise ValueError(f"unknown benchmark {name!r}; known benchmarks: {known}")
    return BENCHMARKS[name]
