"""Workflows use the policy only through its ``PolicyView`` (``groupflow.policies.base``): built
over a proxy that exposes nothing else — no ``actor``, no ``update`` — the single- and multi-turn
workflows still collect, validate and warm-start, and their stage metrics come back as values."""

from __future__ import annotations

import pytest

from groupflow.trainer import Trainer
from groupflow.workflows import build_workflow
from tests.workflows.calc_tools import CALC_TOOLS

VIEW = ("contracts", "rollout", "reward_model", "tokenizer", "sampling", "sync", "sft_step")
CALC = dict(
    CALC_TOOLS, data__task={"name": "calc", "digits": 2, "num_train": 64, "num_val": 8},
    sft__target_field="demo",
)  # fmt: skip


class ViewOnly:
    """The trainer's policy with only the view's attributes reachable."""

    def __init__(self, policy):
        self._policy = policy

    def __getattr__(self, name):
        if name not in VIEW:
            raise AttributeError(f"a workflow used policy.{name}, which is not in the PolicyView")
        return getattr(self._policy, name)


@pytest.mark.parametrize("overrides", [{}, CALC], ids=["single_turn", "multi_turn"])
def test_workflows_need_only_the_policy_view(tiny_config, overrides):
    cfg = tiny_config(sft__steps=2, sft__batch_samples=4, **overrides)
    trainer = Trainer(cfg)
    w = trainer.workflow
    view = ViewOnly(trainer.policy)
    with pytest.raises(AttributeError, match="policy.actor"):
        view.actor  # noqa: B018 - the proxy must be able to refuse
    workflow = build_workflow(cfg, view, list(w.train_rows), w.train_rows[:4], None,
                              trainer.run_dir)  # fmt: skip
    workflow.reward_fn = w.reward_fn  # the trainer's configured rewards
    batch, metrics = workflow.collect(trainer.loader.take(2), step=0, round_=0, version=0)
    assert len(batch) == 2 * cfg.rollout.samples_per_prompt
    assert not batch.meta  # nothing travels inside the batch
    assert any(k.startswith("reward/") for k in metrics)  # the rewards' metrics, as a value
    assert workflow.validate(0)  # held-out metrics through the view's rollout group
    assert workflow.warm_start()["sft/steps"] == 2.0
