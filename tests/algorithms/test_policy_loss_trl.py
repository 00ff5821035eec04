"""CISPO, SAPO, VESPO (and the PPO-clip modes) against TRL's own ``GRPOTrainer._compute_loss``.

TRL's method is called unchanged on a stand-in ``self`` that holds only the attributes it reads;
its model forward (``_get_per_token_logps_and_entropies``) returns our log-prob leaf, so both
sides see identical inputs and we compare the loss value and the full gradient w.r.t. every
log-prob. One process, one optimizer step's view: no gradient accumulation (its factors are 1),
one rank, ``num_items_in_batch`` = the batch's valid-token count (TRL's "dapo"-style losses then
equal our ``token_mean``). TRL is in the ``test`` extra; without it these tests skip.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from groupflow.algorithms import policy_loss

trl_grpo = pytest.importorskip(
    "trl.trainer.grpo_trainer", reason="TRL is not installed (pip install 'trl==1.16.*')"
)
GRPOTrainer = trl_grpo.GRPOTrainer


class _Accelerator:
    num_processes = 1

    def gather(self, t):
        return t

    gather_for_metrics = gather

    def reduce(self, t, reduction="sum"):
        return t


def trl_loss(logp, old, adv, mask, loss_type, level="token", epsilon_high=None, **args):
    """TRL 1.16's loss for these inputs, with TRL's config defaults unless given in ``args``."""
    defaults = {
        "epsilon": 0.2,
        "delta": None,
        "use_bias_correction_kl": True,
        "steps_per_generation": 1,
        "sapo_temperature_neg": 1.05,
        "sapo_temperature_pos": 1.0,
        "vespo_k_pos": 2.0,
        "vespo_lambda_pos": 3.0,
        "vespo_k_neg": 3.0,
        "vespo_lambda_neg": 2.0,
    }
    a = SimpleNamespace(**{**defaults, **args})
    fake = SimpleNamespace(
        args=a,
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_low=a.epsilon,
        epsilon_high=a.epsilon if epsilon_high is None else epsilon_high,  # as GRPOTrainer.__init__
        beta=0.0,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        max_completion_length=logp.shape[1],
        current_gradient_accumulation_steps=1,
        accelerator=_Accelerator(),
        model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
    )
    b, t = logp.shape
    inputs = {
        "prompt_ids": torch.zeros(b, 1, dtype=torch.long),
        "prompt_mask": torch.ones(b, 1, dtype=torch.long),
        "completion_ids": torch.zeros(b, t, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum().float(),
    }
    return GRPOTrainer._compute_loss(fake, None, inputs), fake._metrics["train"]


def _inputs(seed=0, b=6, t=7, spread=0.6):
    """Log-probs off-policy enough that CISPO's cap, SAPO's gate and VESPO's weights all bite."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    logp = old + spread * torch.randn(b, t, generator=g)
    lengths = torch.tensor([t, t - 1, 3, 1, t - 2, 5])[:b]
    mask = torch.arange(t)[None, :] < lengths[:, None]
    adv = torch.randn(b, generator=g)
    adv[2] = 0.0  # VESPO picks (k_pos, lambda_pos) at A == 0, SAPO the negative temperature
    return logp, old, adv, mask


def _compare(loss_type, ours_opts, trl_args, level="token", agg="token_mean", spread=0.6):
    logp, old, adv, mask = _inputs(spread=spread)
    leaf_trl = logp.clone().requires_grad_(True)
    leaf_ours = logp.clone().requires_grad_(True)
    ref, metrics = trl_loss(leaf_trl, old, adv, mask, loss_type, level=level, **trl_args)
    (g_ref,) = torch.autograd.grad(ref, leaf_trl)
    ours, ours_metrics = policy_loss(leaf_ours, old, adv, mask, agg=agg, **ours_opts)
    (g_ours,) = torch.autograd.grad(ours, leaf_ours)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-6, atol=1e-7)
    assert g_ref.abs().sum() > 0  # the comparison covers a real gradient
    return ours_metrics, metrics


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_cispo_equals_trl_at_trl_default_cap(level):
    # TRL's default: epsilon_high unset -> the cap on rho is epsilon = 0.2
    _compare("cispo", {"loss_fn": "cispo", "ratio_level": level, "clip_ratio_max": 0.2}, {}, level)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_cispo_equals_trl_at_recommended_cap(level):
    # groupflow's default cap 5.0 = TRL's documented recommendation epsilon_high=5.0; a wide
    # spread of log-ratios so that some rho exceed 5 and the cap is exercised
    ours, theirs = _compare(
        "cispo",
        {"loss_fn": "cispo", "ratio_level": level},
        {"epsilon_high": 5.0},
        level,
        spread=2.0,
    )
    if level == "token":
        assert ours["cispo_clipfrac"].item() == pytest.approx(theirs["cispo_clip_ratio"][0])
        assert 0 < ours["cispo_clipfrac"].item() < 1


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sapo_equals_trl(level):
    # TRL aggregates sapo like "grpo": the mean over sequences of each one's token mean
    _compare("sapo", {"loss_fn": "sapo", "ratio_level": level}, {}, level, "seq_mean_token_mean")


def test_sapo_equals_trl_with_other_temperatures():
    opts = {"loss_fn": "sapo", "temperature_pos": 0.5, "temperature_neg": 2.0}
    args = {"sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0}
    _compare("sapo", opts, args, agg="seq_mean_token_mean")


@pytest.mark.parametrize("spread", [0.05, 0.6])
def test_vespo_equals_trl(spread):
    ours, theirs = _compare("vespo", {"loss_fn": "vespo"}, {}, spread=spread)
    assert torch.isfinite(ours["vespo_phi_mean"])


def test_vespo_equals_trl_with_other_shape_parameters():
    opts = {"loss_fn": "vespo", "k_pos": 1.0, "lambda_pos": 0.5, "k_neg": 4.0, "lambda_neg": 1.5}
    args = {
        "vespo_k_pos": 1.0,
        "vespo_lambda_pos": 0.5,
        "vespo_k_neg": 4.0,
        "vespo_lambda_neg": 1.5,
    }
    _compare("vespo", opts, args, spread=0.1)


@pytest.mark.parametrize(
    ("loss_type", "agg", "level"),
    [
        ("dapo", "token_mean", "token"),
        ("grpo", "seq_mean_token_mean", "token"),
        ("grpo", "seq_mean_token_mean", "sequence"),
        ("dr_grpo", "seq_mean_token_sum_norm", "token"),
        ("bnpo", "token_mean", "token"),  # one micro-batch: bnpo's local mean is the global one
    ],
)
def test_ppo_clip_modes_equal_trl(loss_type, agg, level):
    """The existing loss, same harness: TRL has no dual clip, so clip_ratio_c=None."""
    opts = {"loss_fn": "ppo_clip", "ratio_level": level, "clip_ratio_c": None}
    _compare(loss_type, opts, {}, level, agg)
