"""One step's experience: the workflow's collect, plus dynamic-sampling refills (DAPO).

Design decision: a plain function of (workflow, prompt loader, step, version), so the synchronous
trainer and the asynchronous rollout side (``groupflow.rollout.side``, in a child process or a
thread) run the very same code and draw the very same prompts: a batch does not depend on where
it was collected. Refills are generated with the same weights as the first round, so they count
against the staleness bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from groupflow.batch import Batch
from groupflow.data import PromptLoader

__all__ = ["Sampling", "collect_step", "prompt_loader", "informative_groups", "first_groups"]


def prompt_loader(cfg, rows: list) -> PromptLoader:
    """The run's prompt stream over ``rows`` (a workflow's training rows)."""
    d = cfg.data
    return PromptLoader(
        rows, d.prompts_per_step, seed=cfg.run.seed, shuffle=d.shuffle, drop_last=d.drop_last
    )


@dataclass(frozen=True)
class Sampling:
    """How many prompts a step trains on, and whether zero-signal groups are refilled."""

    prompts_per_step: int
    dynamic: bool = False
    max_rounds: int = 1

    @classmethod
    def from_config(cls, cfg) -> Sampling:
        a = cfg.algorithm
        return cls(cfg.data.prompts_per_step, a.dynamic_sampling, a.max_sampling_rounds)


def collect_step(workflow, loader, sampling: Sampling, step: int,
                 version: int) -> tuple[Batch, dict[str, float]]:  # fmt: skip
    """Rollout + reward for ``step`` with the weights of ``version``; with dynamic sampling,
    groups whose rewards are all equal are dropped and refilled from the loader. Returns (batch,
    metrics): the workflow's own (a refill round's override the first's) and the sampling's."""
    batch, metrics = workflow.collect(loader.next_batch(), step, 0, version)
    if not sampling.dynamic:
        return batch, metrics
    kept, dropped, rounds = [], 0, 0
    while True:
        informative = informative_groups(batch)
        dropped += int(batch["group_ids"].unique().numel()) - len(informative)
        kept.append(batch.index(torch.isin(batch["group_ids"], torch.tensor(informative))))
        rounds += 1
        have = sum(int(b["group_ids"].unique().numel()) for b in kept)
        if have >= sampling.prompts_per_step or rounds >= sampling.max_rounds:
            break
        batch, round_metrics = workflow.collect(
            loader.take(sampling.prompts_per_step - have), step, rounds, version
        )
        metrics.update(round_metrics)
    batch = Batch.concat([b for b in kept if len(b)] or [batch])
    batch = first_groups(batch, sampling.prompts_per_step)
    return batch, {
        **metrics,
        "sampling/rounds": rounds,
        "sampling/dropped_groups": dropped,
        "sampling/kept_groups": int(batch["group_ids"].unique().numel()),
    }


def informative_groups(batch: Batch) -> list[int]:
    """Groups whose rewards are not all equal (the rest carry no GRPO signal)."""
    gids, rewards = batch["group_ids"], batch["rewards"]
    out = []
    for g in gids.unique().tolist():
        r = rewards[gids == g]
        if r.numel() > 1 and float(r.max() - r.min()) > 0:
            out.append(g)
    return out


def first_groups(batch: Batch, k: int) -> Batch:
    order = list(dict.fromkeys(batch["group_ids"].tolist()))[:k]
    return batch.index(torch.isin(batch["group_ids"], torch.tensor(order)))
