"""Grading IFEval and IFBench responses with the official checkers, as the official evaluation does.

Design decision: the checking itself (official checker classes, official strict/loose procedure,
seeded, a raising checker counted) is ``groupflow.rewards.official_checkers``, shared with the
instructions reward; this module turns a benchmark's rows and responses into records in the
official output's fields, and reduces them to the official report's metrics: prompt-level = share
of prompts following every instruction, instruction-level = share of all instructions followed
(pooled over prompts, not averaged per prompt). A checker error is logged with the prompt's key.
``tests/evals`` checks equality with the official ``evaluation_lib`` on IFBench's
``sample_output.jsonl`` and on IFEval responses built to pass and fail every instruction kind.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from groupflow.evals.base import Benchmark, BenchmarkData, BenchmarkDataMissing, pass_at_k_of
from groupflow.rewards.official_checkers import CheckersMissing, checker_registry, follow_lists

__all__ = ["grade_rows", "if_metrics", "instruction_benchmark", "registry_of"]

# IFEval's budget, IFBench's too: lm-evaluation-harness's ifeval task allows 1,280 new tokens.
MAX_NEW_TOKENS = 1280

log = logging.getLogger(__name__)


def registry_of(benchmark: str):
    """The official checkers of ``benchmark``; missing packages are a BenchmarkDataMissing."""
    try:
        return checker_registry(benchmark)
    except CheckersMissing as e:
        raise BenchmarkDataMissing(str(e)) from None


def grade_rows(registry, name: str, rows, responses: Sequence[str]) -> list[dict[str, Any]]:  # fmt: skip
    """One record per response: the benchmark's ``key``, ``prompt``, ``response``, the instruction
    ids and the strict and loose follow lists (the official output's fields), ``errors``."""
    records = []
    for row, response in zip(rows, responses, strict=True):
        f = row.fields
        strict, loose, errors = follow_lists(
            registry, f["raw_prompt"], f["instruction_id_list"], f["kwargs"], response
        )
        for e in errors:
            log.warning(
                "%s key %s: checker raised, instruction scored failed: %s", name, f["key"], e
            )
        records.append({
            "key": f["key"], "prompt": f["raw_prompt"], "response": response,
            "instruction_id_list": list(f["instruction_id_list"]),
            "follow_instruction_list_strict": strict, "follow_instruction_list_loose": loose,
            "follow_all_strict": all(strict), "follow_all_loose": all(loose), "errors": errors,
        })  # fmt: skip
    return records


def if_metrics(records: list[dict[str, Any]], k: int) -> dict[str, float]:
    """``prompt_strict``, ``inst_strict``, ``prompt_loose``, ``inst_loose`` as the official report
    computes them (over every sample: with ``k`` > 1 these are means over the k samples), plus
    ``pass@k`` of the prompt-level ones for k > 1 and ``checker_errors``."""
    out: dict[str, float] = {}
    for mode in ("strict", "loose"):
        lists = [r[f"follow_instruction_list_{mode}"] for r in records]
        out[f"prompt_{mode}"] = sum(all(x) for x in lists) / max(1, len(lists))
        out[f"inst_{mode}"] = sum(sum(x) for x in lists) / max(1, sum(len(x) for x in lists))
        if k > 1:
            out[f"prompt_{mode}_pass@{k}"] = pass_at_k_of([all(x) for x in lists], k)
    out["average_strict"] = (out["prompt_strict"] + out["inst_strict"]) / 2
    out["checker_errors"] = float(sum(len(r["errors"]) for r in records))
    out["prompts"] = float(len(records) // max(1, k))
    return out


def instruction_benchmark(
    name: str, description: str, load: Callable[[], BenchmarkData]
) -> Benchmark:
    """An instruction-following benchmark: ``load``'s rows graded by ``name``'s official checkers
    (looked up when grading, so a missing package fails then, naming its pip command), these
    metrics, the chat template and ``MAX_NEW_TOKENS``."""

    def grade(rows, responses):
        return grade_rows(registry_of(name), name, rows, responses)

    return Benchmark(name=name, description=description, load=load, grade=grade,
                     metrics=if_metrics, max_new_tokens=MAX_NEW_TOKENS)  # fmt: skip
