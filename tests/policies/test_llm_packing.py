"""``actor.packing`` through the driver: a GRPO step with recomputed old log-probs and a
reference, packed, equals the padded one; a sample over the token budget stops the step naming
its uid and the key; the token-balanced split hands each rank its share and puts the results
back in batch order."""

from __future__ import annotations

import pytest
import torch

from groupflow.batch import Batch
from groupflow.policies.llm import balanced_call
from groupflow.run.tracking import read_metrics
from groupflow.trainer import Trainer
from groupflow.workers.packing import OverBudgetError


def _last_step(trainer: Trainer) -> dict:
    return [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if "actor/pg_loss" in r][-1]


def test_a_packed_step_equals_a_padded_one(tiny_config):
    over = {"run__total_steps": 1, "actor__ppo_epochs": 2, "actor__kl_coef": 0.1,
            "actor__micro_batch_tokens": 48}  # fmt: skip
    padded = Trainer(tiny_config(**over, run__name="padded"))
    padded.fit()
    packed = Trainer(tiny_config(**over, run__name="packed", actor__packing=True))
    packed.fit()
    a, b = _last_step(padded), _last_step(packed)
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
                "actor/kl_loss", "actor/approx_kl"):  # fmt: skip
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


def test_a_sample_over_the_packed_budget_names_its_uid(tiny_config):
    trainer = Trainer(
        tiny_config(run__total_steps=1, actor__packing=True, actor__micro_batch_tokens=4)
    )
    with pytest.raises(
        OverBudgetError, match=r"sample '.+' has \d+ tokens.*actor\.micro_batch_tokens=4"
    ):
        trainer.fit()


class _Group:
    """Two ranks that record the rows they get and answer each with its first prompt token."""

    world_size = 2

    def __init__(self):
        self.seen = None

    def method(self, batch: Batch, *, scale: int) -> Batch:
        self.seen = batch
        return Batch({"out": batch["prompt_ids"][:, -1] * scale})


def test_the_balanced_split_reorders_for_the_ranks_and_back():
    # tokens per sample: prompt 1 + responses 9 5 2 7 4 1 → the order of
    # tests/workers/test_packing.py's hand-computed case shifted by one token each: [0 4 5 | 1 2 3]
    widths = [9, 5, 2, 7, 4, 1]
    batch = Batch(
        {
            "prompt_ids": torch.arange(6)[:, None],
            "prompt_mask": torch.ones(6, 1, dtype=torch.long),
            "responses": torch.zeros(6, 9, dtype=torch.long),
            "response_mask": torch.tensor([[1] * w + [0] * (9 - w) for w in widths]),
        }
    )
    group = _Group()
    out = balanced_call(group.method, group, batch, True, scale=10)
    assert group.seen["prompt_ids"][:, 0].tolist() == [0, 4, 5, 1, 2, 3]
    assert out["out"].tolist() == [0, 10, 20, 30, 40, 50]  # back in batch order
    plain = balanced_call(group.method, group, batch, False, scale=1)
    assert group.seen["prompt_ids"][:, 0].tolist() == list(range(6)) and len(plain) == 6
