"""Running a named benchmark on a policy: generate under the benchmark's settings, grade, reduce.

Design decision: generation goes through the policy's own rollout engine (``policy.rollout``:
HF generate with a static KV cache, or vLLM where configured), the same path training samples
from, so ``groupflow eval --benchmark`` and ``validation.benchmarks`` during training measure one
model one way. Only the benchmark decides the prompt format (chat template), the new-token budget
and the grader; the config decides the engine. Greedy is the official protocol; sampled
evaluation (``samples`` > 1, at ``temperature``) gives every metric as a mean over the k samples
and pass@k. Progress (prompts, tokens/s) shows as a bar on a terminal.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from groupflow.data import render_prompt
from groupflow.evals import get_benchmark
from groupflow.rollout.engines.batching import prompts_batch
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.utils.progress import Progress

__all__ = ["BenchmarkResult", "run_benchmark", "select_rows", "write_records"]

log = logging.getLogger(__name__)

# prompts per generate call: a bar that moves, batches that fill the cores. An engine that batches
# continuously (vLLM) is faster with more at once: ``batch_prompts`` (CLI --batch-prompts).
CHUNK_PROMPTS = 16


@dataclass(frozen=True)
class BenchmarkResult:
    metrics: dict[str, float]  # the benchmark's metrics plus wall_s, new_tokens, tokens_per_s
    records: list[dict[str, Any]]  # prompt-major, ``sample`` = index among the prompt's k
    excluded: dict[str, str]


def select_rows(rows: list, limit: int | None, name: str) -> list:
    """The first ``limit`` rows (all for None); a limit outside 1..len(rows) is a ValueError."""
    if limit is None:
        return rows
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= len(rows):
        raise ValueError(
            f"--limit {limit!r} is out of range for benchmark {name!r}: it has {len(rows)} "
            f"gradable prompts (give 1..{len(rows)}, or no --limit for all)"
        )
    return rows[:limit]


def run_benchmark(policy, name: str, *, limit: int | None = None, samples: int = 1,
                  temperature: float = 1.0, seed: int = 0, max_new_tokens: int | None = None,
                  use_chat_template: bool | None = None, progress_label: str | None = None,
                  leave: bool = True, batch_prompts: int = CHUNK_PROMPTS) -> BenchmarkResult:  # fmt: skip
    """Benchmark ``name`` on ``policy`` (its ``tokenizer``, ``sampling`` and ``rollout``).

    ``samples`` = 1: greedy; more: that many samples per prompt at ``temperature``.
    ``max_new_tokens`` replaces the benchmark's budget (None: the benchmark's own)."""
    bench = get_benchmark(name)
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if isinstance(batch_prompts, bool) or not isinstance(batch_prompts, int) or batch_prompts < 1:
        raise ValueError(
            f"batch_prompts (--batch-prompts) must be a positive integer, got {batch_prompts!r}"
        )
    data = bench.load()
    if data.excluded:
        log.warning("%s: %d prompt(s) excluded: %s", name, len(data.excluded),
                    "; ".join(f"{k}: {v}" for k, v in list(data.excluded.items())[:3]))  # fmt: skip
    rows = select_rows(data.rows, limit, name)
    tok = policy.tokenizer
    chat = True if bench.chat else use_chat_template
    texts = [render_prompt(r, tok, chat) for r in rows]
    # a chat template writes its own special tokens; a plain prompt gets the tokenizer's BOS
    ids = [
        tok(t, add_special_tokens=not (chat or r.is_chat))["input_ids"] for t, r in zip(texts, rows)
    ]
    params = replace(
        policy.sampling, temperature=0.0 if samples == 1 else temperature, n=samples,
        max_new_tokens=max_new_tokens or bench.max_new_tokens,
    )  # fmt: skip
    records, new_tokens, start = [], 0, time.perf_counter()
    with Progress(progress_label or f"{name}", len(rows), leave=leave) as progress:
        for lo in range(0, len(rows), batch_prompts):
            chunk = range(lo, min(lo + batch_prompts, len(rows)))
            out = _generate(policy, [ids[i] for i in chunk], params, seed, lo)
            sample_rows = [rows[i] for i in chunk for _ in range(samples)]
            graded = bench.grade(sample_rows, out["completions"])
            for j, rec in enumerate(graded):
                rec["sample"] = j % samples
                rec["finish_reason"] = out["finish_reason"][j]
                rec["new_tokens"] = out["lengths"][j]
            records += graded
            new_tokens += sum(out["lengths"])
            progress.update(len(chunk), tokens=sum(out["lengths"]))
    wall = time.perf_counter() - start
    metrics = bench.metrics(records, samples)
    metrics.update(
        wall_s=wall, new_tokens=float(new_tokens), tokens_per_s=new_tokens / max(wall, 1e-9),
        excluded=float(len(data.excluded)),
        truncated=float(sum(r["finish_reason"] == "length" for r in records)),
    )  # fmt: skip
    return BenchmarkResult(metrics, records, dict(data.excluded))


def _generate(policy, ids: list[list[int]], params: SamplingParams, seed: int, first: int) -> dict:
    n = params.n
    # seeds depend on the prompt's index in the benchmark only: a --limit run is a prefix
    seeds = [[seed * 7919 + (first + i) * n + j for j in range(n)] for i in range(len(ids))]
    out = policy.rollout.generate(
        prompts_batch(ids, seeds, range(len(ids))), params, max(len(i) for i in ids)
    )
    masks = out["response_mask"].bool()
    resp = [r[m].tolist() for r, m in zip(out["responses"], masks)]
    return {
        "completions": policy.tokenizer.batch_decode(resp, skip_special_tokens=True),
        "finish_reason": list(out["finish_reason"]),
        "lengths": [len(r) for r in resp],
    }


def write_records(path: str | Path, result: BenchmarkResult) -> Path:
    """One JSON line per graded sample (the benchmark's ``key``, ``prompt``, ``response``, ...)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for rec in result.records:
            f.write(json.dumps(rec) + "\n")
    return path
