"""A custom workflow: test-time RL (TTRL, Zuo et al. 2025) — train without answers, rewarding each
sample for agreeing with its group's majority answer.

Referenced from a config as ``rollout.workflow: examples/workflows/majority_vote.py:MajorityVote``.
A workflow is any class built as ``Workflow(cfg, policy, train_rows, val_rows, rewards)`` with the
methods the trainer calls (``groupflow.workflows.Workflow``):

    train_rows                                    rows the prompt loader draws from
    contracts                                     the policy's stage contracts
    data_stats                                    logged before training
    collect(rows, step, round_, version) -> (Batch, metrics)   rollout + rewards ('rewarded')
    step_metrics(batch, seconds) -> dict          per-step metrics
    validate(step) -> dict                        held-out metrics
    warm_start() -> dict                          before RL ({} for none)

Composition keeps it short: this one runs the built-in single-turn workflow and replaces its
rewards. The ground truth, when rows have one, is only *measured* (``ttrl/label_accuracy``: how
often the majority is right) — never trained on. Validation still scores against the answers.
"""

from __future__ import annotations

from collections import Counter

import torch

from groupflow.batch import Batch
from groupflow.workflows.single_turn import SingleTurnWorkflow


def answer_of(completion: str) -> str:
    """The answer a completion commits to: its first line, stripped."""
    return completion.strip().split("\n")[0].strip()


class MajorityVote:
    def __init__(self, cfg, policy, train_rows, val_rows, rewards=None):
        self.inner = SingleTurnWorkflow(cfg, policy, train_rows, val_rows, rewards)
        self.contracts = self.inner.contracts
        self.data_stats = self.inner.data_stats

    @property
    def train_rows(self):
        return self.inner.train_rows

    def collect(self, rows, step: int, round_: int, version: int) -> tuple[Batch, dict]:
        batch, metrics = self.inner.collect(rows, step, round_, version)
        answers = [answer_of(c) for c in batch["completion"]]
        rewards = torch.zeros(len(batch))
        right = []
        for g in batch["group_ids"].unique().tolist():
            members = (batch["group_ids"] == g).nonzero().flatten().tolist()
            label, _ = Counter(answers[i] for i in members).most_common(1)[0]
            for i in members:
                rewards[i] = float(answers[i] == label)
            truth = batch["row"][members[0]].fields.get("answer")
            if truth is not None:
                right.append(label == str(truth))
        batch["rewards"] = rewards
        metrics = dict(metrics)
        metrics["ttrl/majority_reward"] = float(rewards.mean())
        if right:
            metrics["ttrl/label_accuracy"] = sum(right) / len(right)
        return batch, metrics

    def step_metrics(self, batch: Batch, seconds: float) -> dict[str, float]:
        return self.inner.step_metrics(batch, seconds)

    def validate(self, step: int, return_records: bool = False, progress_label="validation"):
        return self.inner.validate(step, return_records, progress_label)

    def warm_start(self) -> dict[str, float]:
        return self.inner.warm_start()
