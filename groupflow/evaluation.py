"""Validation: greedy and sampled accuracy per data source, pass@k and mean@k.

Design decision: evaluation runs the training workflow's own episodes and reward runner (a
``score`` callable the workflow supplies) — the numbers a user reads at validation are produced by
exactly the code that produced the training rewards, tools and environments included. A sample
counts as correct when its reward reaches ``correct_threshold`` (1.0: the built-in verifiable
rewards give 1.0 for a right answer and less for anything else).

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

from groupflow.utils.progress import Progress

__all__ = ["evaluate", "pass_at_k", "records_from_scores", "accuracy", "report_progress"]


def pass_at_k(correct: torch.Tensor) -> float:
    """Fraction of prompts with at least one correct sample; ``correct`` is [prompts, k] bool."""
    return float(correct.any(dim=1).float().mean())


def records_from_scores(start: int, n: int, texts, rows, completions, result,
                        finish_reasons, extras: dict[str, list] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """One record per scored sample (sample j of prompt i at i*n + j; prompt indices from
    ``start``): what accuracy metrics, the warm start's probe and ``groupflow eval`` read."""
    records = []
    for i, c in enumerate(completions):
        row = rows[i]
        record = {
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
            "finish_reason": finish_reasons[i],
        }
        for key, values in (extras or {}).items():
            record[key] = values[i]
        records.append(record)
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


def report_progress(progress: Progress | None, prompts: int, tokens: int, totals,
                    threshold: float = 1.0) -> None:  # fmt: skip
    """Tell ``progress`` a chunk is done: prompts, tokens generated, samples scored correct."""
    if progress is not None:
        correct = int((totals >= threshold).sum())
        progress.update(prompts, tokens=tokens, correct=correct, scored=len(totals))


def accuracy(records: list[dict[str, Any]], threshold: float = 1.0) -> float:
    """Share of records whose reward reaches ``threshold``."""
    return sum(r["reward"] >= threshold for r in records) / max(1, len(records))


def evaluate(
    score,
    encoded,
    *,
    base_params,
    samples: int = 1,
    temperature: float = 1.0,
    greedy: bool = True,
    seed: int = 0,
    correct_threshold: float = 1.0,
    return_records: bool = False,
    progress_label: str = "validation",
    progress_leave: bool = False,
):
    """Metrics ``val/greedy/acc[/source]``, ``val/sampled/mean@k``, ``val/sampled/pass@k``, rewards,
    and with several reward components ``val/{greedy,sampled}/component/<name>/{acc,mean@k,pass@k}``.

    ``score(encoded, params, seed, progress) -> records`` runs the workflow's episodes on the
    prompts and scores them (one record per sample, see ``records_from_scores``), telling
    ``progress`` after each chunk. Progress (prompts, tokens/s, running accuracy) is shown as
    ``<progress_label> (greedy)`` and ``(sampled)``: a bar on a terminal (kept afterwards with
    ``progress_leave``), log lines else."""
    metrics: dict[str, float] = {}
    all_records: dict[str, list] = {}
    modes = []
    if greedy:
        modes.append(("greedy", replace(base_params, temperature=0.0, n=1), seed, 1))
    if samples > 1 or not greedy:
        params = replace(base_params, temperature=temperature, n=samples)
        modes.append(("sampled", params, seed + 1, samples))
    for mode, params, mode_seed, k in modes:
        with Progress(
            f"{progress_label} ({mode})", len(encoded.rows), leave=progress_leave
        ) as progress:
            recs = score(encoded, params, mode_seed, progress=progress)
        metrics.update(_accuracy_metrics(recs, f"val/{mode}", k, correct_threshold))
        all_records[mode] = recs
    return (metrics, all_records) if return_records else metrics
