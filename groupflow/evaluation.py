"""Validation: greedy and sampled accuracy per data source, pass@k and mean@k.

Design decision: evaluation reuses the training rollout engine and reward runner unchanged — the
numbers a user reads at validation are produced by exactly the code that produced the training
rewards. A sample counts as correct when its reward reaches ``correct_threshold`` (1.0: the
built-in verifiable rewards give 1.0 for a right answer and less for anything else).

When the reward has several components (e.g. GSM8K scored strictly with weight 1 and flexibly
with weight 0, for monitoring), each component's own accuracy is reported too, from its
unweighted value against the same threshold: ``val/greedy/component/<name>/acc``. A component
counts only the samples it scored (those of its data source, and where it did not return None).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace
from typing import Any

import torch

__all__ = ["evaluate", "pass_at_k", "generate_and_score"]


def pass_at_k(correct: torch.Tensor) -> float:
    """Fraction of prompts with at least one correct sample; ``correct`` is [prompts, k] bool."""
    return float(correct.any(dim=1).float().mean())


def generate_and_score(
    actor, tokenizer, encoded, reward_fn, params, seed: int, chunk_prompts: int = 64
):
    """Generate ``params.n`` samples per prompt and score them; returns per-sample records."""
    records: list[dict[str, Any]] = []
    for start in range(0, len(encoded.rows), chunk_prompts):
        rows = encoded.rows[start : start + chunk_prompts]
        ids = encoded.ids[start : start + chunk_prompts]
        texts = encoded.texts[start : start + chunk_prompts]
        n = params.n
        seeds = [seed * 7919 + (start * n + i) for i in range(len(rows) * n)]
        from groupflow.workers.actor import prompts_batch

        per_prompt = [seeds[i * n : (i + 1) * n] for i in range(len(ids))]
        out = actor.generate(
            prompts_batch(ids, per_prompt, range(len(ids))), params, max(len(i) for i in ids)
        )
        resp = [r[m.bool()].tolist() for r, m in zip(out["responses"], out["response_mask"])]
        completions = tokenizer.batch_decode(resp, skip_special_tokens=True)
        sample_rows = [rows[i // n] for i in range(len(completions))]
        keys = dict.fromkeys(k for r in sample_rows for k in r.fields)
        fields = {k: [r.fields.get(k) for r in sample_rows] for k in keys}
        result = reward_fn(
            [texts[i // n] for i in range(len(completions))],
            completions,
            completion_lengths=[len(r) for r in resp],
            **fields,
        )
        for i, c in enumerate(completions):
            row = sample_rows[i]
            records.append(
                {
                    "prompt_index": start + i // n,
                    "prompt": texts[i // n],
                    "completion": c,
                    "reward": float(result.total[i]),
                    # None where the component did not score this sample (NaN is not JSON)
                    "components": {
                        name: (None if math.isnan(v := float(col[i])) else v)
                        for name, col in result.components.items()
                    },
                    "data_source": str(row.fields.get("data_source", "default")),
                    "finish_reason": out["finish_reason"][i],
                }
            )
    return records


def _accuracy_metrics(records, prefix: str, k: int, threshold: float) -> dict[str, float]:
    by_source: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_source[r["data_source"]].append(r)
    out: dict[str, float] = {}
    for source, recs in [("all", records), *sorted(by_source.items())]:
        tag = "" if source == "all" else f"/{source}"
        correct = torch.tensor([r["reward"] >= threshold for r in recs]).view(-1, k)
        rewards = torch.tensor([r["reward"] for r in recs])
        if k == 1:
            out[f"{prefix}/acc{tag}"] = float(correct.float().mean())
        else:
            out[f"{prefix}/mean@{k}{tag}"] = float(correct.float().mean())
            out[f"{prefix}/pass@{k}{tag}"] = pass_at_k(correct)
        out[f"{prefix}/reward{tag}"] = float(rewards.mean())
    out.update(_component_metrics(records, prefix, k, threshold))
    return out


def _component_metrics(records, prefix: str, k: int, threshold: float) -> dict[str, float]:
    """Per-component accuracy; only with two or more components (one would repeat ``acc``)."""
    names = list(dict.fromkeys(n for r in records for n in r.get("components", {})))
    if len(names) < 2:
        return {}
    out: dict[str, float] = {}
    for name in names:
        values = torch.tensor(
            [_nan_if_none(r["components"].get(name)) for r in records], dtype=torch.float64
        ).view(-1, k)
        scored = ~values.isnan()
        if not scored.any():
            continue
        correct = values >= threshold  # NaN compares False
        tag = f"{prefix}/component/{name}"
        if k == 1:
            out[f"{tag}/acc"] = float(correct[scored].float().mean())
        else:
            out[f"{tag}/mean@{k}"] = float(correct[scored].float().mean())
            out[f"{tag}/pass@{k}"] = pass_at_k(correct[scored.any(dim=1)])
    return out


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else value


def evaluate(
    actor,
    tokenizer,
    encoded,
    reward_fn,
    *,
    base_params,
    samples: int = 1,
    temperature: float = 1.0,
    greedy: bool = True,
    seed: int = 0,
    correct_threshold: float = 1.0,
    return_records: bool = False,
):
    """Metrics ``val/greedy/acc[/source]``, ``val/sampled/mean@k``, ``val/sampled/pass@k``, rewards,
    and with several reward components ``val/{greedy,sampled}/component/<name>/{acc,mean@k,pass@k}``."""
    metrics: dict[str, float] = {}
    all_records: dict[str, list] = {}
    if greedy:
        params = replace(base_params, temperature=0.0, n=1)
        recs = generate_and_score(actor, tokenizer, encoded, reward_fn, params, seed)
        metrics.update(_accuracy_metrics(recs, "val/greedy", 1, correct_threshold))
        all_records["greedy"] = recs
    if samples > 1 or not greedy:
        params = replace(base_params, temperature=temperature, n=samples)
        recs = generate_and_score(actor, tokenizer, encoded, reward_fn, params, seed + 1)
        metrics.update(_accuracy_metrics(recs, "val/sampled", samples, correct_threshold))
        all_records["sampled"] = recs
    return (metrics, all_records) if return_records else metrics
