"""On-policy distillation advantages against hand-computed values."""

import math

import pytest
import torch

from groupflow.algorithms import distillation_advantages, policy_loss, reverse_kl_per_token

LN2 = math.log(2.0)
# two samples, three tokens; the second sample's last token is padding (garbage log-probs there)
STUDENT = torch.tensor([[-1.0, -2.0, -0.5], [-LN2, -3.0, 99.0]])
TEACHER = torch.tensor([[-0.5, -2.5, -0.5], [-2 * LN2, -1.0, -99.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_reverse_kl_per_token_is_student_minus_teacher_on_valid_tokens():
    kl = reverse_kl_per_token(STUDENT, TEACHER, MASK)
    torch.testing.assert_close(kl, torch.tensor([[-0.5, 0.5, 0.0], [LN2, -2.0, 0.0]]))


def test_distillation_alone():
    adv = distillation_advantages(None, STUDENT, TEACHER, MASK, coef=2.0)
    # -2 * (student - teacher)
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1.0, 0.0], [-2 * LN2, 4.0, 0.0]]))
    same = distillation_advantages(torch.tensor([5.0, -5.0]), STUDENT, TEACHER, MASK, coef=2.0,
                                   reward_weight=0.0)  # fmt: skip
    torch.testing.assert_close(same, adv)


def test_mixed_with_outcome_advantages():
    outcome = torch.tensor([1.0, -0.5])
    adv = distillation_advantages(outcome, STUDENT, TEACHER, MASK, coef=1.0, reward_weight=0.5)
    expected = torch.tensor([[0.5 + 0.5, 0.5 - 0.5, 0.5], [-0.25 - LN2, -0.25 + 2.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    # per-token outcome advantages are accepted as they are
    adv2 = distillation_advantages(outcome[:, None].expand(2, 3), STUDENT, TEACHER, MASK,
                                   coef=1.0, reward_weight=0.5)  # fmt: skip
    torch.testing.assert_close(adv2, expected)


def test_a_perfect_student_gets_no_distillation_signal():
    adv = distillation_advantages(None, TEACHER, TEACHER, MASK)
    assert torch.equal(adv, torch.zeros(2, 3))


def test_the_policy_gradient_pushes_up_tokens_the_teacher_likes_more():
    # on-policy (ratio 1), token_mean: dL/dlogp_t = -A_t / n_valid, A_t = teacher - student
    logp = STUDENT.clone().requires_grad_(True)
    adv = distillation_advantages(None, STUDENT, TEACHER, MASK)
    loss, _ = policy_loss(logp, logp.detach(), adv, MASK)
    loss.backward()
    expected = -torch.tensor([[0.5, -0.5, 0.0], [-LN2, 2.0, 0.0]]) / 5
    torch.testing.assert_close(logp.grad, expected)


def test_no_gradient_flows_into_the_signal():
    student = STUDENT.clone().requires_grad_(True)
    adv = distillation_advantages(None, student, TEACHER, MASK)
    assert not adv.requires_grad


@pytest.mark.parametrize("kwargs", [{"coef": -1.0}, {"reward_weight": -0.1}])
def test_bad_coefficients(kwargs):
    with pytest.raises(ValueError, match="must be >= 0"):
        distillation_advantages(None, STUDENT, TEACHER, MASK, **kwargs)


def test_shape_mismatch_names_the_shapes():
    with pytest.raises(ValueError, match=r"teacher_logprobs \(2, 2\)"):
        reverse_kl_per_token(STUDENT, TEACHER[:, :2], MASK)
