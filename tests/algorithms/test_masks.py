"""Response masks with gaps: widths and attention spans, and the token-level math around gaps.

A gap (mask 0 between model tokens: tool/observation tokens) is part of the sequence but not an
action. GAE must treat the gapped row exactly like the same row with the gap columns removed
(verl's ``compute_gae_advantage_return``: values and TD errors of observation tokens are skipped,
one γ step joins the tokens either side), whatever rewards and values sit on the gap.
"""

from __future__ import annotations

import pytest
import torch

from groupflow.algorithms import (
    compute_gae,
    last_valid_index,
    place_outcome_reward,
    prompt_widths,
    response_span,
    response_widths,
)

MASK = torch.tensor(
    [
        [1, 1, 0, 0, 1, 1, 1],
        [1, 0, 1, 0, 0, 0, 0],
        [0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0],
    ]
)


def test_widths_reach_the_last_action_not_the_action_count():
    assert last_valid_index(MASK).tolist() == [6, 2, 3, -1]
    assert response_widths(MASK).tolist() == [7, 3, 4, 0]
    assert MASK.sum(1).tolist() == [5, 2, 2, 0]  # what the old code took as the width


def test_span_attends_to_gaps_and_not_to_trailing_padding():
    expected = [
        [1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0],
    ]
    span = response_span(MASK)
    assert span.tolist() == expected and span.dtype == MASK.dtype
    assert response_span(MASK.bool()).dtype == torch.bool


def test_prompt_widths_of_left_padded_prompts():
    pm = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 1]])
    assert prompt_widths(pm).tolist() == [2, 4, 0, 3]
    assert prompt_widths(torch.zeros(2, 0)).tolist() == [0, 0]


def test_bad_masks_are_named():
    with pytest.raises(ValueError, match="response_mask must be a 2-D tensor"):
        response_span(torch.ones(3))
    with pytest.raises(ValueError, match="prompt_mask must be a 2-D tensor"):
        prompt_widths(torch.ones(3))


def _compact(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return x[keep.bool()][None]


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.8), (0.5, 0.95)])
def test_gae_treats_a_gap_as_absent(gamma, lam):
    g = torch.Generator().manual_seed(0)
    mask = MASK[:3]
    # garbage on gap and padding positions: must not reach any advantage or return
    rewards = torch.randn(3, 7, generator=g) * 10
    values = torch.randn(3, 7, generator=g) * 10
    adv, ret = compute_gae(rewards, values, mask, gamma, lam, whiten=False)
    for i in range(3):
        keep = mask[i]
        a, r = compute_gae(
            _compact(rewards[i], keep), _compact(values[i], keep), torch.ones(1, int(keep.sum())),
            gamma, lam, whiten=False,
        )  # fmt: skip
        torch.testing.assert_close(adv[i][keep.bool()], a[0])
        torch.testing.assert_close(ret[i][keep.bool()], r[0])
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_outcome_reward_on_the_last_action_after_a_gap_feeds_gae():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]])  # the last action is column 4
    token_rewards = place_outcome_reward(torch.tensor([2.0]), mask)
    assert token_rewards.tolist() == [[0.0, 0.0, 0.0, 0.0, 2.0, 0.0]]
    values = torch.tensor([[0.5, 0.25, 9.0, 9.0, 0.125, 9.0]])
    adv, _ = compute_gae(token_rewards, values, mask, gamma=0.9, lam=1.0, whiten=False)
    # column 4: 2 - 0.125; column 1: 0.9 * 2 - 0.25 (one γ step across the gap);
    # column 0: 0.81 * 2 - 0.5
    torch.testing.assert_close(adv, torch.tensor([[1.12, 1.55, 0.0, 0.0, 1.875, 0.0]]))
