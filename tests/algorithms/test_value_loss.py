"""Clipped value loss (verl compute_value_loss) against hand-computed values and gradients."""

import pytest
import torch

from groupflow.algorithms import loss_denominators, value_loss

OLD = torch.tensor([[0.5, 0.5, 0.0]])
RET = torch.tensor([[0.0, 3.0, 5.0]])
MASK = torch.tensor([[1, 1, 0]])


def test_clipped_value_loss_hand_computed():
    v = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    loss, m = value_loss(v, OLD, RET, MASK, clip_range=0.2)
    # t0: unclipped (1-0)^2 = 1, clipped (0.7-0)^2 = 0.49 -> 1;  t1: unclipped (2-3)^2 = 1,
    # clipped (0.7-3)^2 = 5.29 -> 5.29.  ½·mean = ½·(1 + 5.29)/2 = 1.5725. t2 masked.
    assert float(loss.detach()) == pytest.approx(1.5725)
    assert float(m["vf_clipfrac"]) == pytest.approx(0.5)
    loss.backward()
    # t0 takes the unclipped branch: d/dv ½(v-R)^2 / 2 = (1 - 0)/2; t1's clipped branch is flat.
    torch.testing.assert_close(v.grad, torch.tensor([[0.5, 0.0, 0.0]]))


def test_no_clip_is_half_mse():
    v = torch.tensor([[1.0, 2.0, 123.0]])
    loss, m = value_loss(v, OLD, RET, MASK, clip_range=None)
    assert float(loss) == pytest.approx(0.5)
    assert float(m["vf_clipfrac"]) == 0.0


def test_global_denominators_make_micro_batches_sum_to_full_batch():
    torch.manual_seed(0)
    v = torch.randn(4, 5, requires_grad=True)
    old, ret = torch.randn(4, 5), torch.randn(4, 5)
    mask = (torch.rand(4, 5) > 0.3).long()
    full, _ = value_loss(v, old, ret, mask, clip_range=0.3)
    dens = loss_denominators(mask)
    parts = sum(
        value_loss(
            v[i : i + 2], old[i : i + 2], ret[i : i + 2], mask[i : i + 2], clip_range=0.3, **dens
        )[0]
        for i in (0, 2)
    )
    torch.testing.assert_close(parts, full)


def test_bad_input():
    with pytest.raises(ValueError, match="returns must be a \\[B, T\\] tensor"):
        value_loss(torch.zeros(1, 3), OLD, torch.zeros(1, 2), MASK)
    with pytest.raises(ValueError, match="clip range must be > 0"):
        value_loss(torch.zeros(1, 3), OLD, RET, MASK, clip_range=0.0)
