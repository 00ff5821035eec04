"""Shared LLM workflow helpers: a warm-start demonstration's model turns (multi-turn and agent
workflows read them alike) and the error that names the bad row, file and field."""

import pytest

from groupflow.data import PromptRow
from groupflow.workflows.llm import sft_turns


def _row(value):
    return PromptRow("q", {} if value is ... else {"demo": value}, "train.jsonl", 7)


def test_one_turn_or_a_list_of_turns():
    assert sft_turns(_row("4"), "demo") == ["4"]
    assert sft_turns(_row(["call", "4"]), "demo") == ["call", "4"]


@pytest.mark.parametrize("value", [..., None, [], ["ok", 3], 5, {"turn": "x"}])
def test_a_bad_demonstration_names_row_file_and_field(value):
    with pytest.raises(
        ValueError, match=r"sft: row 7 of train.jsonl: field 'demo' \(sft.target_field\)"
    ):
        sft_turns(_row(value), "demo")


def test_add_rewards_hands_the_groups_to_group_normalisation():
    """A training batch's rewards (single-turn LLM path) are z-scored per group and per reward."""
    import torch

    from groupflow.batch import Batch
    from groupflow.rewards import RewardFunction, RewardRunner
    from groupflow.workflows.llm import add_rewards

    runner = RewardRunner(
        [
            RewardFunction("wide", lambda completions: [10.0 * len(c) for c in completions]),
            RewardFunction("narrow", lambda completions: [0.1 * c.count("x") for c in completions]),
        ],
        normalize="group",
        normalize_eps=0.0,
    )
    rows = [PromptRow("q", {}, "train.jsonl", i) for i in range(4)]
    batch = Batch(
        {"response_mask": torch.ones(4, 3), "group_ids": torch.tensor([0, 0, 1, 1])},
        {"prompt": ["q"] * 4, "row": rows},
    )
    batch, metrics = add_rewards(runner, batch, ["a", "xxa", "x", "a"])
    r = 1 / 2**0.5
    # wide: lengths [1, 3 | 1, 1] -> z [-r, r | 0, 0]; narrow: x's [0, 2 | 1, 0] -> [-r, r | r, -r]
    assert torch.allclose(batch["rewards"], torch.tensor([-2 * r, 2 * r, r, -r]), atol=1e-6)
    assert metrics["reward/wide/share"] == pytest.approx(1 / 3)
