import pytest
import torch

from groupflow.algorithms import (
    AGGREGATIONS,
    UnknownNameError,
    aggregate,
    loss_denominators,
)

NAN = float("nan")
# Masked positions hold NaN / inf: they must never be read.
VALUES = torch.tensor([[1.0, 2.0, NAN], [4.0, float("inf"), NAN], [NAN, NAN, NAN]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)


def value(mode, **dens):
    return aggregate(VALUES, MASK, mode, **dens).item()


def test_token_mean_local_defaults():
    # (1 + 2 + 4) / 3 valid tokens
    assert value("token_mean") == pytest.approx(7 / 3)


def test_seq_mean_token_mean_counts_empty_sample():
    # (1.5 + 4 + 0) / 3 sequences: the all-masked sample contributes 0 but counts
    assert value("seq_mean_token_mean") == pytest.approx(5.5 / 3)


def test_seq_mean_token_sum_norm_local_defaults():
    # 7 / (B=3 * T=3)
    assert value("seq_mean_token_sum_norm") == pytest.approx(7 / 9)


def test_local_token_mean():
    assert value("local_token_mean") == pytest.approx(7 / 3)
    # TRL bnpo: each micro-batch's token mean / the number of accumulation steps (x ranks)
    assert value("local_token_mean", num_micro_batches=4) == pytest.approx(7 / 12)


def test_global_denominators_are_used():
    dens = {"num_tokens": 10, "num_seqs": 4, "max_len": 5}
    assert value("token_mean", **dens) == pytest.approx(0.7)
    assert value("seq_mean_token_mean", **dens) == pytest.approx(5.5 / 4)
    assert value("seq_mean_token_sum_norm", **dens) == pytest.approx(7 / 20)
    assert value("local_token_mean", **dens) == pytest.approx(7 / 3)  # ignores them
    # ... and the others ignore the micro-batch count
    for mode, expected in (("token_mean", 0.7), ("seq_mean_token_mean", 5.5 / 4)):
        assert value(mode, **dens, num_micro_batches=3) == pytest.approx(expected)


def test_tensor_denominators():
    assert value("token_mean", num_tokens=torch.tensor(14)) == pytest.approx(0.5)


def test_float_mask_equals_bool_mask():
    for mode in AGGREGATIONS.names():
        a = aggregate(VALUES, MASK.float(), mode)
        b = aggregate(VALUES, MASK, mode)
        assert a.item() == pytest.approx(b.item())


def test_zero_denominator_gives_zero_and_finite_grad():
    v = torch.randn(2, 3, requires_grad=True)
    m = torch.zeros(2, 3)
    for mode in AGGREGATIONS.names():
        out = aggregate(v, m, mode)
        assert out.item() == 0.0, mode
        (g,) = torch.autograd.grad(out, v)
        assert torch.equal(g, torch.zeros(2, 3)), mode
    assert aggregate(v, m, "token_mean", num_tokens=0).item() == 0.0
    assert aggregate(v, m, "token_mean", num_tokens=torch.tensor(0)).item() == 0.0


def test_no_nan_gradient_through_masked_infinities():
    v = torch.tensor([[1.0, -float("inf")]], requires_grad=True)
    out = aggregate(v, torch.tensor([[1, 0]]), "token_mean")
    (g,) = torch.autograd.grad(out, v)
    assert torch.equal(g, torch.tensor([[1.0, 0.0]]))


def test_loss_denominators_single_and_list():
    assert loss_denominators(MASK) == {
        "num_tokens": 3, "num_seqs": 3, "max_len": 3, "num_micro_batches": 1,
    }  # fmt: skip
    masks = [torch.ones(2, 4), torch.tensor([[1, 1, 0, 0, 0, 0]])]
    assert loss_denominators(masks) == {
        "num_tokens": 10, "num_seqs": 3, "max_len": 6, "num_micro_batches": 2,
    }  # fmt: skip


def test_a_registered_mode_without_the_micro_batch_count_still_works():
    from groupflow.algorithms import register_aggregation

    @register_aggregation("test_sum_over_seqs")
    def sum_over_seqs(masked, mask, *, num_tokens, num_seqs, max_len):
        return masked.sum() / num_seqs

    try:
        assert value("test_sum_over_seqs", num_micro_batches=2) == pytest.approx(7 / 3)
    finally:
        AGGREGATIONS.unregister("test_sum_over_seqs")


def test_unknown_mode_lists_valid():
    with pytest.raises(UnknownNameError) as err:
        aggregate(VALUES, MASK, "token-mean")
    for name in (
        "token_mean",
        "seq_mean_token_mean",
        "seq_mean_token_sum_norm",
        "local_token_mean",
    ):
        assert name in str(err.value)
    assert "did you mean 'token_mean'" in str(err.value)


def test_bad_shapes_and_denominators():
    with pytest.raises(ValueError, match="same shape"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 4), "token_mean")
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        aggregate(torch.zeros(3), torch.ones(3), "token_mean")
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3), "token_mean", num_tokens=-1)
    with pytest.raises(ValueError, match="num_micro_batches"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3), "local_token_mean", num_micro_batches=-1)
    with pytest.raises(ValueError, match="at least one"):
        loss_denominators([])
