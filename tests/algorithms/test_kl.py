import math

import pytest
import torch

from groupflow.algorithms import (
    KL_ESTIMATORS,
    UnknownNameError,
    entropy_from_logits,
    importance_weighted_kl,
    kl_penalty,
)

LOGP = torch.tensor([[-1.0, -2.0, -0.5]])
REF = torch.tensor([[-1.5, -2.0, 0.5]])
# delta = ref - logp = [-0.5, 0, 1]


def test_k1():
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k1"), torch.tensor([[0.5, 0.0, -1.0]]))


def test_k2():
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k2"), torch.tensor([[0.125, 0.0, 0.5]]))


def test_k3():
    # exp(-0.5) + 0.5 - 1 = 0.10653066;  exp(1) - 1 - 1 = 0.71828183
    torch.testing.assert_close(
        kl_penalty(LOGP, REF, "k3"), torch.tensor([[0.10653066, 0.0, 0.71828183]])
    )


def test_verl_aliases():
    for alias, name in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        assert torch.equal(kl_penalty(LOGP, REF, alias), kl_penalty(LOGP, REF, name))


def test_k3_clamped_like_verl():
    logp = torch.tensor([[0.0, 0.0, 0.0]])
    ref = torch.tensor([[30.0, -30.0, 3.0]])
    # delta 30 -> clamped to 20, exp(20) - 21 -> clamp 10; delta -30 -> 20 - 1 = 19 -> 10;
    # delta 3 -> exp(3) - 4 = 16.0855 -> 10
    out = kl_penalty(logp, ref, "k3")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.tensor([[10.0, 10.0, 10.0]]))


def test_gradient_only_through_logprobs():
    logp = LOGP.clone().requires_grad_(True)
    ref = REF.clone().requires_grad_(True)
    kl_penalty(logp, ref, "k3").sum().backward()
    assert ref.grad is None
    # d/dlogp (exp(ref - logp) + logp - ref - 1) = 1 - exp(delta)
    torch.testing.assert_close(logp.grad, 1 - torch.exp(REF - LOGP))


def test_unknown_kind_lists_valid():
    with pytest.raises(UnknownNameError) as err:
        kl_penalty(LOGP, REF, "abs")
    msg = str(err.value)
    assert "k1" in msg and "k2" in msg and "k3" in msg and "low_var_kl" in msg
    assert set(KL_ESTIMATORS.names()) == {"k1", "k2", "k3"}


def test_shape_mismatch():
    with pytest.raises(ValueError, match="same shape"):
        kl_penalty(LOGP, REF[:, :2], "k1")


OLD = torch.tensor([[-1.2, -2.0, -0.4]])  # log-ratio logp - old = [0.2, 0, -0.1]


def test_k3_times_the_token_ratio_trl_bias_correction():
    logp = LOGP.clone().requires_grad_(True)
    out = importance_weighted_kl(kl_penalty(logp, REF, "k3"), logp, OLD, torch.ones(1, 3))
    # e^0.2 (e^-0.5 + 0.5 - 1) = 0.13011684;  e^-0.1 (e^1 - 2) = 0.64992828
    expected = [math.exp(0.2) * (math.exp(-0.5) - 0.5), 0.0, math.exp(-0.1) * (math.e - 2)]
    torch.testing.assert_close(out.detach(), torch.tensor([expected]))
    torch.testing.assert_close(out.detach(), torch.tensor([[0.13011684, 0.0, 0.64992828]]))
    # the ratio carries gradient: d(rho k3)/dlogp = rho (k3 + 1 - e^delta) = rho (logp - ref)
    out.sum().backward()
    rho = torch.tensor([[math.exp(0.2), 1.0, math.exp(-0.1)]])
    torch.testing.assert_close(logp.grad, rho * (LOGP - REF))
    torch.testing.assert_close(logp.grad, torch.tensor([[0.61070138, 0.0, -0.90483742]]))


def test_on_policy_the_correction_adds_the_score_function_term():
    logp = LOGP.clone().requires_grad_(True)
    k3 = kl_penalty(logp, REF, "k3")
    out = importance_weighted_kl(k3, logp, logp.detach(), torch.ones(1, 3))
    torch.testing.assert_close(out, k3)  # rho = 1: same value ...
    out.sum().backward()
    # ... but gradient (1 - e^delta) + k3 = logp - ref instead of the plain 1 - e^delta
    torch.testing.assert_close(logp.grad, LOGP - REF)


def test_k3_times_the_sequence_ratio():
    logp = LOGP.clone().requires_grad_(True)
    mask = torch.tensor([[1, 1, 0]])  # mean log-ratio over the valid tokens: (0.2 + 0) / 2
    out = importance_weighted_kl(
        kl_penalty(logp, REF, "k3"), logp, OLD, mask, ratio_level="sequence"
    )
    rho = math.exp(0.1)
    k3 = [math.exp(-0.5) - 0.5, 0.0]
    torch.testing.assert_close(out.detach()[0, :2], torch.tensor([rho * k3[0], 0.0]))
    (out * mask).sum().backward()
    # d/dlogp_t sum_s rho k3_s = rho (1 - e^delta_t) + rho * sum_s k3_s / 2, for valid t
    expected = [rho * (1 - math.exp(-0.5)) + rho * k3[0] / 2, rho * k3[0] / 2, 0.0]
    torch.testing.assert_close(logp.grad, torch.tensor([expected]))


def test_bias_correction_bad_input():
    k3 = kl_penalty(LOGP, REF, "k3")
    with pytest.raises(ValueError, match="unknown ratio_level 'seq'"):
        importance_weighted_kl(k3, LOGP, OLD, torch.ones(1, 3), ratio_level="seq")
    with pytest.raises(ValueError, match="old_logprobs must be a tensor shaped like kl"):
        importance_weighted_kl(k3, LOGP, OLD[:, :2], torch.ones(1, 3))


def test_entropy_hand_computed():
    # probs 1/6, 2/6, 3/6: H = ln6/6 + ln3/3 + ln2/2
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])) + 5.0
    expected = [math.log(6) / 6 + math.log(3) / 3 + math.log(2) / 2, math.log(3)]
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor(expected))
    assert expected[0] == pytest.approx(1.0114042647)


def test_entropy_matches_manual_and_chunked():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 3
    p = torch.softmax(logits, -1)
    manual = -(p * torch.log(p)).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits), manual)
    for chunk in (1, 4, 100):
        torch.testing.assert_close(entropy_from_logits(logits, chunk_size=chunk), manual)


def test_entropy_stable_for_huge_and_minus_inf_logits():
    logits = torch.tensor([[1000.0, 1000.0, -torch.inf], [-1e4, 0.0, 0.0]])
    torch.testing.assert_close(
        entropy_from_logits(logits), torch.tensor([math.log(2), math.log(2)])
    )


def test_entropy_gradient_finite_with_minus_inf_logits():
    x = torch.tensor([[0.0, 1.0, -torch.inf]], requires_grad=True)
    entropy_from_logits(x).sum().backward()
    assert torch.isfinite(x.grad).all()
    # dH/dz_j = -p_j (log p_j + H); p = softmax([0, 1]) on the finite entries
    p = torch.softmax(torch.tensor([0.0, 1.0]), -1)
    h = -(p * p.log()).sum()
    torch.testing.assert_close(x.grad[0, :2], -p * (p.log() + h))
    assert x.grad[0, 2].item() == 0.0


def test_entropy_bf16_upcast_and_chunked_grad():
    logits = torch.randn(6, 7, dtype=torch.bfloat16)
    assert entropy_from_logits(logits).dtype == torch.float32
    x = torch.randn(6, 7, requires_grad=True)
    (g_full,) = torch.autograd.grad(entropy_from_logits(x).sum(), x)
    (g_chunk,) = torch.autograd.grad(entropy_from_logits(x, chunk_size=4).sum(), x)
    torch.testing.assert_close(g_full, g_chunk)


def test_entropy_bad_chunk():
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(torch.zeros(2, 3), chunk_size=0)
