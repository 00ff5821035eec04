"""Tests of the actor worker's pure helpers and of its update on a hand-made batch.

A 1-layer 16-wide Llama over a 12-token vocabulary is enough: the tests check schedule values,
micro-batch packing, gradient clipping, optimizer-step counts and logged metrics, all of which can
be computed by hand or compared between two workers built from the same weights.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from groupflow.batch import Batch
from groupflow.config import ActorConfig
from groupflow.models.causal_lm import build_tiny_llama
from groupflow.workers.actor import ActorRolloutWorker
from groupflow.workers.common import lr_lambda, optimizer_state_by_name
from groupflow.workers.update import micro_batches

# ----- lr_lambda ---------------------------------------------------------------------------------


def test_lr_lambda_linear_warmup_then_constant():
    f = lr_lambda("constant", warmup_steps=4, total_steps=100, min_lr_ratio=0.0)
    assert [f(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert f(1000) == 1.0


def test_lr_lambda_no_warmup_starts_at_full_lr():
    assert lr_lambda("constant", 0, 10, 0.0)(0) == 1.0
    assert lr_lambda("cosine", 0, 10, 0.0)(0) == 1.0


def test_lr_lambda_cosine_reaches_min_ratio_at_the_end():
    f = lr_lambda("cosine", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    assert f(0) == 0.5 and f(1) == 1.0  # warm-up
    assert f(2) == pytest.approx(1.0)  # cosine starts at the top
    # halfway through the 8 cosine steps: 0.1 + 0.9 * 0.5 * (1 + cos(pi / 2))
    assert f(6) == pytest.approx(0.55)
    assert f(4) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert f(10) == pytest.approx(0.1)
    assert f(50) == pytest.approx(0.1)  # clamped after total_steps
    values = [f(s) for s in range(2, 11)]
    assert values == sorted(values, reverse=True)  # non-increasing after warm-up


# ----- micro_batches -----------------------------------------------------------------------------


def test_micro_batches_by_sample_count():
    assert micro_batches([1] * 5, 2, None) == [[0, 1], [2, 3], [4]]
    assert micro_batches([1] * 4, 4, None) == [[0, 1, 2, 3]]
    assert micro_batches([1] * 3, 10, None) == [[0, 1, 2]]


def test_micro_batches_none_is_one_group():
    assert micro_batches([7, 3, 9], None, None) == [[0, 1, 2]]


def test_micro_batches_of_no_samples_are_none():
    assert micro_batches([], None, None) == [] == micro_batches([], 2, None)
    assert micro_batches([], None, 8) == []


def test_micro_batches_by_tokens_packs_padded_cost():
    # padded cost of a group = rows x longest row, kept <= 8:
    # [3,3] costs 6 (a third 3 would cost 9); 10 is over budget and goes alone; [2,2] costs 4
    assert micro_batches([3, 3, 3, 10, 2, 2], None, 8) == [[0, 1], [2], [3], [4, 5]]


def test_micro_batches_by_tokens_exact_fit_and_growing_width():
    assert micro_batches([4, 4], None, 8) == [[0, 1]]
    # a long row after a short one raises the width of the whole group: 2 x 4 = 8 > 6
    assert micro_batches([1, 4], None, 6) == [[0], [1]]
    assert micro_batches([4, 1], None, 8) == [[0, 1]]


def test_micro_batches_over_long_sample_alone():
    assert micro_batches([50], None, 8) == [[0]]
    assert micro_batches([2, 50, 2], None, 8) == [[0], [1], [2]]


def test_micro_batches_token_budget_wins_over_sample_count():
    # micro_batch_samples and micro_batch_tokens are mutually exclusive in the config; the
    # function packs by tokens whenever a token budget is given
    assert micro_batches([1, 1, 1, 1], 1, 100) == [[0, 1, 2, 3]]


# ----- the update on a hand-made batch -----------------------------------------------------------

VOCAB, PAD, EOS = 12, 0, 1


def _model():
    return build_tiny_llama(
        VOCAB, hidden_size=16, num_layers=1, num_heads=2, max_positions=32, pad_token_id=PAD,
        eos_token_id=EOS, seed=0,
    )  # fmt: skip


def _worker(model, **cfg) -> ActorRolloutWorker:
    return ActorRolloutWorker(
        copy.deepcopy(model),
        None,
        ActorConfig(**{"lr": 1e-2, **cfg}),
        total_steps=10,
        pad_id=PAD,
        eos_ids=[EOS],
    )


def _batch(n: int = 8, perturb_old: float = 0.0, seed: int = 0) -> Batch:
    """n samples: left-padded prompts of 2-4 tokens, responses of 1-5 tokens."""
    g = torch.Generator().manual_seed(seed)
    p_len = [2 + i % 3 for i in range(n)]
    r_len = [1 + (3 * i) % 5 for i in range(n)]
    prompt_ids = torch.full((n, 4), PAD)
    prompt_mask = torch.zeros(n, 4, dtype=torch.long)
    responses = torch.full((n, 5), PAD)
    response_mask = torch.zeros(n, 5, dtype=torch.long)
    for i in range(n):
        prompt_ids[i, 4 - p_len[i] :] = torch.randint(2, VOCAB, (p_len[i],), generator=g)
        prompt_mask[i, 4 - p_len[i] :] = 1
        responses[i, : r_len[i]] = torch.randint(2, VOCAB, (r_len[i],), generator=g)
        response_mask[i, : r_len[i]] = 1
    old = -2.5 + perturb_old * torch.randn(n, 5, generator=g)
    return Batch(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "responses": responses,
            "response_mask": response_mask,
            "old_logprobs": old.clamp(max=0) * response_mask,
            "advantages": torch.randn(n, generator=g),
            "group_ids": torch.arange(n) // 4,
        },
        {"uid": [str(i) for i in range(n)]},
    )


def _record_steps(worker: ActorRolloutWorker, also_step: bool = True) -> list[dict]:
    """Patch optimizer.step to record gradients and the LR it is called with."""
    seen: list[dict] = []
    real = worker.optimizer.step

    def step(*a, **k):
        seen.append(
            {
                "lr": worker.optimizer.param_groups[0]["lr"],
                "grads": [p.grad.clone() for p in worker.model.parameters() if p.grad is not None],
            }
        )
        return real(*a, **k) if also_step else None

    worker.optimizer.step = step
    return seen


def _norm(grads) -> float:
    return float(
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    )


def test_grad_clipping_is_applied_and_grad_norm_logged_before_clipping():
    model = _model()
    batch = _batch()
    unclipped = _worker(model, grad_clip=None)
    raw = _record_steps(unclipped, also_step=False)
    m_raw = unclipped.update(batch, temperature=1.0)
    clipped = _worker(model, grad_clip=1e-3)
    seen = _record_steps(clipped, also_step=False)
    m_clip = clipped.update(batch, temperature=1.0)

    raw_norm = _norm(raw[0]["grads"])
    assert raw_norm > 1e-2  # far above the clip threshold
    assert m_raw["actor/grad_norm"] == pytest.approx(raw_norm, rel=1e-5)
    # logged value: the norm before clipping; applied gradient: scaled down to the threshold
    assert m_clip["actor/grad_norm"] == pytest.approx(raw_norm, rel=1e-5)
    assert _norm(seen[0]["grads"]) == pytest.approx(1e-3, rel=1e-4)
    scale = 1e-3 / raw_norm
    for g_clip, g_raw in zip(seen[0]["grads"], raw[0]["grads"]):
        torch.testing.assert_close(g_clip, g_raw * scale, rtol=1e-4, atol=1e-9)


def test_optimizer_steps_per_update_are_epochs_times_mini_batches():
    model = _model()
    worker = _worker(model, ppo_epochs=2, mini_batch_samples=2)
    seen = _record_steps(worker)
    worker.update(_batch(n=8), temperature=1.0, shuffle_seed=0)
    assert len(seen) == 2 * (8 // 2)
    assert worker.scheduler.last_epoch == 1  # the schedule advances once per rollout step


def test_update_changes_parameters_and_logs_core_metrics():
    model = _model()
    worker = _worker(model)
    metrics = worker.update(_batch(), temperature=1.0)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/lr", "actor/loss"):
        assert math.isfinite(metrics[key]), key
    assert metrics["actor/nonfinite_skipped"] == 0.0
    assert any(
        not torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), worker.model.state_dict().values())
    )


def test_logged_lr_is_the_lr_used_by_the_update():
    model = _model()
    worker = _worker(model, lr=1e-3, warmup_steps=4)
    seen = _record_steps(worker)
    metrics = worker.update(_batch(), temperature=1.0)
    assert seen[0]["lr"] == pytest.approx(2.5e-4)  # warm-up step 0 of 4
    assert metrics["actor/lr"] == pytest.approx(seen[0]["lr"])


def test_ratio_extremes_do_not_depend_on_micro_batching():
    model = _model()
    batch = _batch(perturb_old=0.5)
    whole = _worker(model).update(batch, temperature=1.0)
    split = _worker(model, micro_batch_samples=2).update(batch, temperature=1.0)
    assert whole["actor/ratio_max"] > 1.5  # the perturbed old log-probs give ratios far from 1
    for key in ("actor/ratio_mean", "actor/clipfrac_low", "actor/pg_loss"):
        assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    assert split["actor/ratio_max"] == pytest.approx(whole["actor/ratio_max"], rel=1e-5)
    assert split["actor/ratio_min"] == pytest.approx(whole["actor/ratio_min"], rel=1e-5)


# ----- leaving zero-advantage samples out of the update -------------------------------------------


def _zero_groups(batch: Batch, groups: tuple[int, ...]) -> Batch:
    """The batch with every advantage of the given groups set to 0 (all-equal rewards)."""
    out = batch.copy()
    adv = batch["advantages"].clone()
    for g in groups:
        adv[batch["group_ids"] == g] = 0.0
    out["advantages"] = adv
    return out


def _count_forward_rows(worker: ActorRolloutWorker) -> list[int]:
    rows: list[int] = []
    real = worker.policy.forward

    def forward(prompt_ids, *args, **kwargs):
        rows.append(prompt_ids.shape[0])
        return real(prompt_ids, *args, **kwargs)

    worker.policy.forward = forward
    return rows


def _params(worker: ActorRolloutWorker) -> list[torch.Tensor]:
    return [p.detach().clone() for p in worker.model.parameters()]


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"micro_batch_samples": 3},
        {"loss_agg": "seq_mean_token_mean", "ppo_epochs": 2, "mini_batch_samples": 8},
        {"loss_agg": "seq_mean_token_sum_norm", "micro_batch_tokens": 12},
    ],
)
def test_skipping_zero_advantage_samples_gives_the_same_update(cfg):
    model = _model()
    batch = _zero_groups(_batch(n=12, perturb_old=0.3), groups=(1,))
    full = _worker(model, skip_zero_advantage=False, **cfg)
    skip = _worker(model, **cfg)
    rows_full, rows_skip = _count_forward_rows(full), _count_forward_rows(skip)
    for _ in range(2):  # the second update also checks AdamW's state stayed identical
        m_full = full.update(batch, temperature=0.7, shuffle_seed=3)
        m_skip = skip.update(batch, temperature=0.7, shuffle_seed=3)
        # float summation order differs; Adam's normalised step (lr 1e-2) magnifies it a little
        for a, b in zip(_params(full), _params(skip)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
        for key in ("actor/grad_norm", "actor/loss", "actor/pg_loss"):
            assert m_skip[key] == pytest.approx(m_full[key], rel=1e-5, abs=1e-8), key
    # group 1 (4 of 12 samples) was never run
    assert sum(rows_skip) == sum(rows_full) * 8 // 12
    if "mini_batch_samples" not in cfg:  # else: the mean of its mini-batches' shares
        assert m_skip["actor/zero_adv_skipped"] == pytest.approx(4 / 12)
    assert "actor/zero_adv_skipped" not in m_full


def test_metrics_of_a_skipping_update_cover_the_samples_it_ran():
    model = _model()
    batch = _zero_groups(_batch(n=12, perturb_old=0.5), groups=(0, 2))
    metrics = _worker(model).update(batch, temperature=1.0)
    kept = batch.index([4, 5, 6, 7])  # group 1
    reference = _worker(model, skip_zero_advantage=False).update(kept, temperature=1.0)
    for key in ("actor/ratio_mean", "actor/clipfrac_low", "actor/clipfrac_high",
                "actor/entropy", "actor/ratio_max", "actor/ratio_min"):  # fmt: skip
        assert metrics[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), key


def test_an_all_zero_advantage_update_still_steps_adamw_like_the_full_one():
    """After a normal update AdamW has momentum: a zero-gradient step still moves the weights,
    and the skipping worker (which runs one masked row) must move them identically."""
    model = _model()
    first, zero = _batch(n=8), _zero_groups(_batch(n=8, seed=1), groups=(0, 1))
    full = _worker(model, skip_zero_advantage=False)
    skip = _worker(model)
    rows = _count_forward_rows(skip)
    for worker in (full, skip):
        worker.update(first, temperature=1.0)
    before = _params(skip)
    m_full = full.update(zero, temperature=1.0)
    m_skip = skip.update(zero, temperature=1.0)
    assert rows[-1] == 1 and m_skip["actor/zero_adv_skipped"] == 1.0
    assert m_skip["actor/grad_norm"] == 0.0 == m_full["actor/grad_norm"]
    assert any(not torch.equal(a, b) for a, b in zip(before, _params(skip)))  # momentum
    for a, b in zip(_params(full), _params(skip)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "cfg",
    [
        {"kl_coef": 0.1},
        {"entropy_coef": 0.01},
        {"loss_agg": "local_token_mean"},
        {"skip_zero_advantage": False},
    ],
)
def test_samples_are_not_skipped_when_they_still_carry_gradient(cfg):
    model = _model()
    batch = _zero_groups(_batch(n=8), groups=(0,))
    if cfg.get("kl_coef"):
        batch["ref_logprobs"] = batch["old_logprobs"] - 0.1 * batch["response_mask"]
    worker = _worker(model, **cfg)
    rows = _count_forward_rows(worker)
    metrics = worker.update(batch, temperature=1.0)
    assert sum(rows) == 8 and "actor/zero_adv_skipped" not in metrics


def test_a_registered_loss_is_skipped_only_when_declared_zero_advantage_inert():
    from groupflow.algorithms import POLICY_LOSSES, register_policy_loss, zero_advantage_inert

    assert zero_advantage_inert("ppo_clip")

    @register_policy_loss("test_biased")
    def biased(logprobs, old, adv, valid):  # a term that does not vanish with A = 0
        return -(adv + 0.1) * logprobs, {}

    try:
        assert not zero_advantage_inert("test_biased")
        model = _model()
        worker = _worker(model, loss_fn="test_biased")
        rows = _count_forward_rows(worker)
        worker.update(_zero_groups(_batch(n=8), groups=(0,)), temperature=1.0)
        assert sum(rows) == 8
    finally:
        POLICY_LOSSES.unregister("test_biased")


# ----- resuming a one-worker optimizer state on N workers -----------------------------------------


def test_optimizer_state_is_rekeyed_by_parameter_name():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([a, b], lr=0.1)
    (a.sum() + 2 * b.sum()).backward()
    opt.step()
    by_name = optimizer_state_by_name(opt.state_dict(), ["lm.a", "lm.b"])
    assert set(by_name["state"]) == {"lm.a", "lm.b"}
    assert by_name["state"]["lm.b"]["exp_avg"].shape == (3,)
    assert by_name["param_groups"][0]["params"] == ["lm.a", "lm.b"]
    assert by_name["param_groups"][0]["lr"] == 0.1


def test_optimizer_state_for_another_model_is_refused():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match="holds 1 parameters but the model has 2"):
        optimizer_state_by_name(opt.state_dict(), ["lm.a", "lm.b"])


def test_skip_zero_advantage_defaults_on_and_rejects_a_non_bool():
    from pydantic import ValidationError

    assert ActorConfig().skip_zero_advantage is True
    with pytest.raises(ValidationError, match="skip_zero_advantage"):
        ActorConfig(skip_zero_advantage="maybe")


@pytest.mark.parametrize(
    "cfg, metric",
    [
        ({"loss_fn": "cispo", "ratio_level": "sequence", "loss_options": {"clip_ratio_max": 1.1}},
         "actor/cispo_clipfrac"),
        ({"loss_fn": "sapo", "loss_options": {"temperature_neg": 2.0}}, "actor/sapo_gate_mean"),
        ({"loss_fn": "vespo"}, "actor/vespo_phi_mean"),
    ],
)  # fmt: skip
def test_cispo_sapo_vespo_update_through_the_worker_and_skip_zero_groups_exactly(cfg, metric):
    model = _model()
    batch = _zero_groups(_batch(n=12, perturb_old=0.3), groups=(1,))
    full = _worker(model, skip_zero_advantage=False, **cfg)
    skip = _worker(model, **cfg)
    m_full = full.update(batch, temperature=1.0)
    m_skip = skip.update(batch, temperature=1.0)
    assert math.isfinite(m_full[metric]) and m_full["actor/grad_norm"] > 0
    for a, b in zip(_params(full), _params(skip)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
    assert m_skip["actor/zero_adv_skipped"] == pytest.approx(4 / 12)
