import math

import pytest
import torch

from groupflow.algorithms import (
    apply_sampling_filters,
    logprobs_from_logits,
    sample_from_logits,
)

INF = float("inf")


def kept(filtered):
    return torch.isfinite(filtered).tolist()


def probs_logits(*p):
    return torch.log(torch.tensor([list(p)]))


def test_defaults_are_identity():
    logits = torch.tensor([[0.3, -1.0, 2.0]])
    assert torch.equal(apply_sampling_filters(logits), logits)
    assert torch.equal(apply_sampling_filters(logits, top_k=0, top_p=1.0, min_p=0.0), logits)


def test_temperature_scales_logits():
    out = apply_sampling_filters(torch.tensor([[2.0, 1.0, 0.0]]), temperature=2.0)
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.5, 0.0]]))


def test_top_k_keeps_k_largest_and_ties():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert kept(apply_sampling_filters(logits, top_k=2)) == [[False, True, True, False]]
    out = apply_sampling_filters(logits, top_k=2)
    assert out[0, 1].item() == 3.0 and out[0, 0].item() == -INF
    # tie with the k-th value: both tied tokens are kept
    ties = torch.tensor([[1.0, 3.0, 1.0, 0.0]])
    assert kept(apply_sampling_filters(ties, top_k=2)) == [[True, True, True, False]]
    # k >= V keeps everything
    assert kept(apply_sampling_filters(logits, top_k=10)) == [[True] * 4]


def test_min_p():
    # p = [0.5, 0.25, 0.15, 0.1]: min_p 0.4 -> drop p < 0.2; min_p 0.25 -> drop p < 0.125
    logits = probs_logits(0.5, 0.25, 0.15, 0.1)
    assert kept(apply_sampling_filters(logits, min_p=0.4)) == [[True, True, False, False]]
    assert kept(apply_sampling_filters(logits, min_p=0.25)) == [[True, True, True, False]]
    # min_p close to 1 keeps only the max
    assert kept(apply_sampling_filters(logits, min_p=0.99)) == [[True, False, False, False]]


def test_top_p_smallest_set_reaching_mass():
    logits = probs_logits(0.1, 0.5, 0.25, 0.15)
    # sorted 0.5, 0.25, 0.15, 0.1; mass before: 0, 0.5, 0.75, 0.9
    assert kept(apply_sampling_filters(logits, top_p=0.45)) == [[False, True, False, False]]
    assert kept(apply_sampling_filters(logits, top_p=0.7)) == [[False, True, True, False]]
    assert kept(apply_sampling_filters(logits, top_p=0.8)) == [[False, True, True, True]]
    # tiny top_p still keeps the most likely token
    assert kept(apply_sampling_filters(logits, top_p=1e-9)) == [[False, True, False, False]]


def test_top_p_keeps_ties_with_last_kept_token():
    # sorted 0.5, 0.25, 0.125, 0.125: top_p 0.8 needs the third token; its twin is kept too
    logits = probs_logits(0.125, 0.5, 0.125, 0.25)
    assert kept(apply_sampling_filters(logits, top_p=0.8)) == [[True, True, True, True]]
    assert kept(apply_sampling_filters(logits, top_p=0.7)) == [[False, True, False, True]]


def test_filter_order_top_k_before_top_p():
    # p = [0.4, 0.3, 0.2, 0.1]. top_k 2 first -> renormalised [4/7, 3/7]; top_p 0.5 then keeps
    # only the first (mass before the second is 4/7 >= 0.5). Top-p first would keep two.
    logits = probs_logits(0.4, 0.3, 0.2, 0.1)
    out = apply_sampling_filters(logits, top_k=2, top_p=0.5)
    assert kept(out) == [[True, False, False, False]]
    assert kept(apply_sampling_filters(logits, top_p=0.5)) == [[True, True, False, False]]


def test_filter_order_temperature_before_top_p_and_min_p():
    # logits log([0.6, 0.3, 0.1]); at temperature 4 the distribution flattens to
    # p^(1/4) normalised = [0.403, 0.339, 0.258]: top_p 0.55 now needs two tokens (at T=1 the
    # first alone has 0.6)
    logits = probs_logits(0.6, 0.3, 0.1)
    assert kept(apply_sampling_filters(logits, top_p=0.55)) == [[True, False, False]]
    assert kept(apply_sampling_filters(logits, temperature=4.0, top_p=0.55)) == [
        [True, True, False]
    ]
    # min_p 0.4: at T=1 p/p_max = [1, 0.5, 0.167]; at T=0.5 it is squared: [1, 0.25, 0.028]
    assert kept(apply_sampling_filters(logits, min_p=0.4)) == [[True, True, False]]
    assert kept(apply_sampling_filters(logits, temperature=0.5, min_p=0.4)) == [
        [True, False, False]
    ]


def test_filter_order_min_p_before_top_p():
    # p = [0.4, 0.3, 0.2, 0.1]; min_p 0.5 drops 0.1 (< 0.2) -> renormalised [4/9, 3/9, 2/9];
    # top_p 0.75: mass before the third is 7/9 = 0.778 >= 0.75 -> two tokens. Without min_p the
    # mass before the third is 0.7 < 0.75 -> three tokens.
    logits = probs_logits(0.4, 0.3, 0.2, 0.1)
    assert kept(apply_sampling_filters(logits, min_p=0.5, top_p=0.75)) == [
        [True, True, False, False]
    ]
    assert kept(apply_sampling_filters(logits, top_p=0.75)) == [[True, True, True, False]]


def test_always_keeps_one_token_even_when_all_filters_are_extreme():
    logits = torch.randn(5, 7)
    out = apply_sampling_filters(logits, temperature=0.3, top_k=1, top_p=1e-6, min_p=0.999)
    assert torch.isfinite(out).sum(-1).tolist() == [1] * 5
    assert torch.equal(out.argmax(-1), logits.argmax(-1))


def test_greedy_temperature_zero():
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [5.0, 0.0, 0.0, 0.0]])
    out = apply_sampling_filters(logits, temperature=0.0)
    assert kept(out) == [[False, True, False, False], [True, False, False, False]]
    tokens, logps = sample_from_logits(logits, temperature=0.0)
    assert tokens.tolist() == [1, 0]
    # log-prob at temperature 1
    torch.testing.assert_close(logps, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_sampling_respects_filters_and_records_unfiltered_logprob():
    g = torch.Generator().manual_seed(0)
    logits = probs_logits(0.4, 0.3, 0.2, 0.1).expand(2000, 4)
    tokens, logps = sample_from_logits(logits, generator=g, temperature=0.5, top_k=2)
    assert set(tokens.unique().tolist()) == {0, 1}
    # log_softmax(logits / 0.5) ignores top-k: probs ∝ p^2 = [0.16, 0.09, 0.04, 0.01] / 0.3
    expected = torch.log(torch.tensor([0.16, 0.09, 0.04, 0.01]) / 0.3)[tokens]
    torch.testing.assert_close(logps, expected)
    # frequency of token 0 ~ 0.16 / 0.25 = 0.64
    assert abs((tokens == 0).float().mean().item() - 0.64) < 0.05


def test_sampling_is_reproducible_with_generator_and_keeps_shape():
    logits = torch.randn(2, 3, 9)
    a = sample_from_logits(logits, torch.Generator().manual_seed(3), top_p=0.9)
    b = sample_from_logits(logits, torch.Generator().manual_seed(3), top_p=0.9)
    assert a[0].shape == (2, 3) and a[1].shape == (2, 3) and a[0].dtype == torch.int64
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_sampled_logprob_equals_training_logprob():
    logits = torch.randn(3, 4, 11, dtype=torch.bfloat16)
    tokens, logps = sample_from_logits(logits, torch.Generator().manual_seed(1), temperature=0.7)
    assert torch.equal(logps, logprobs_from_logits(logits, tokens, temperature=0.7))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
    ],
)
def test_invalid_sampling_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        apply_sampling_filters(torch.zeros(1, 3), **kwargs)


def test_logprobs_from_logits_matches_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 13, generator=g) * 4
    ids = torch.randint(0, 13, (2, 5), generator=g)
    expected = torch.log_softmax(logits / 0.8, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, ids, temperature=0.8), expected)
    for chunk in (1, 3, 64):
        torch.testing.assert_close(
            logprobs_from_logits(logits, ids, temperature=0.8, chunk_size=chunk), expected
        )


def test_logprobs_hand_computed_and_bf16_upcast():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]])).bfloat16()
    out = logprobs_from_logits(logits, torch.tensor([[1]]))
    assert out.dtype == torch.float32
    assert out.item() == pytest.approx(math.log(0.25), abs=1e-2)


def test_logprobs_chunked_gradient_matches():
    x = torch.randn(4, 3, 7, requires_grad=True)
    ids = torch.randint(0, 7, (4, 3))
    (g1,) = torch.autograd.grad(logprobs_from_logits(x, ids).sum(), x)
    (g2,) = torch.autograd.grad(logprobs_from_logits(x, ids, chunk_size=5).sum(), x)
    torch.testing.assert_close(g1, g2)


def test_logprobs_bad_input():
    logits = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(logits, torch.zeros(2, 3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="shape"):
        logprobs_from_logits(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        logprobs_from_logits(logits, torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        logprobs_from_logits(logits, torch.full((2, 3), 5))


@pytest.mark.parametrize("candidates", [(1,), (2, 5), (3,), (1, 3), (1024,)])
def test_top_p_with_few_candidates_equals_the_full_sort(monkeypatch, candidates):
    """Top-p looks at the most likely tokens first and sorts the whole row only when they hold
    less than top_p of the mass; both routes keep exactly the same tokens (ties included)."""
    import groupflow.algorithms.sampling as sampling

    g = torch.Generator().manual_seed(0)
    logits = torch.cat(
        [
            torch.randn(6, 12, generator=g) * 4,  # peaked rows: the candidates suffice
            torch.randn(6, 12, generator=g) * 0.1,  # flat rows: the full sort is needed
            torch.tensor([[2.0, 1.0, 1.0, 1.0] + [0.0] * 8]),  # ties at the nucleus edge
        ]
    )
    full = [apply_sampling_filters(logits, top_p=p) for p in (0.3, 0.6, 0.9, 0.99)]
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", candidates)
    for p, expected in zip((0.3, 0.6, 0.9, 0.99), full):
        assert torch.equal(apply_sampling_filters(logits, top_p=p), expected), p


def test_top_p_skips_the_full_sort_when_the_candidates_hold_the_mass(monkeypatch):
    import groupflow.algorithms.sampling as sampling

    sorts = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: sorts.append(1) or real_sort(*a, **k))
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", (2, 3))
    peaked = torch.tensor([[5.0, 4.0, 0.0, -1.0, -2.0, -3.0]])  # top 3 hold > 99% of the mass
    assert kept(apply_sampling_filters(peaked, top_p=0.9)) == [
        [True, True, False, False, False, False]
    ]
    assert sorts == []
    apply_sampling_filters(torch.zeros(1, 6), top_p=0.9)  # flat: 3 of 6 hold only half
    assert sorts == [1]
