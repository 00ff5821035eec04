"""The actor's update against losses written out by hand, through ``ActorRolloutWorker``.

The reference is computed the plain way — one HF forward over [prompt | response] with the
attention spelled out per row, log-softmax, the PPO-clip formula, the aggregation's formula — and
its gradient is compared with the one the worker hands to the optimizer (no clipping), for every
aggregation and every way of cutting the batch into micro-batches:

* ``local_token_mean`` is TRL's ``bnpo``: each micro-batch's own token mean divided by the number
  of gradient-accumulation steps, so the gradient keeps its scale whatever the micro-batch count;
* responses whose masks have gaps (``1 1 0 0 1 1 1``: tool/observation tokens between the model's
  tokens) keep every column up to their last action, attend to the gap tokens, and give them no
  loss, KL or entropy;
* ``kl_bias_correction`` multiplies k3 by the importance ratio (TRL ``use_bias_correction_kl``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from groupflow.batch import Batch
from groupflow.config import ActorConfig, CriticConfig
from groupflow.models.causal_lm import build_tiny_llama
from groupflow.models.value import value_model_from_config
from groupflow.workers.actor import ActorRolloutWorker
from groupflow.workers.critic import CriticWorker
from groupflow.workers.update import micro_batches, row_widths

# the tests read the gradient by replacing optimizer.step, which the LR scheduler warns about
pytestmark = pytest.mark.filterwarnings(
    "ignore:Seems like `optimizer.step\\(\\)` has been overridden"
)

VOCAB, PAD, EOS = 12, 0, 1
P, T = 4, 7
# model tokens (1) around tool/observation tokens (0); trailing zeros are padding
GAPPED = [
    [1, 1, 0, 0, 1, 1, 1],
    [1, 0, 1, 0, 0, 0, 0],
    [1, 1, 1, 0, 0, 0, 0],
    [0, 0, 1, 1, 0, 0, 0],
    [1, 1, 1, 1, 1, 1, 1],
    [1, 0, 0, 0, 0, 0, 1],
    [1, 1, 0, 0, 0, 0, 0],
    [0, 1, 1, 1, 0, 1, 0],
]
PREFIX = [[1] * n + [0] * (T - n) for n in (5, 2, 3, 1, 7, 4, 2, 6)]
PROMPT_LENS = [2, 3, 4, 2, 3, 4, 2, 3]


def _model():
    return build_tiny_llama(
        VOCAB, hidden_size=16, num_layers=2, num_heads=2, max_positions=32, pad_token_id=PAD,
        eos_token_id=EOS, seed=0,
    )  # fmt: skip


def _span(mask: list[int]) -> int:
    """Columns a response occupies: its last model token + 1."""
    return max((t + 1 for t, m in enumerate(mask) if m), default=0)


def _batch(masks=GAPPED, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    n = len(masks)
    prompt_ids = torch.full((n, P), PAD)
    prompt_mask = torch.zeros(n, P, dtype=torch.long)
    responses = torch.full((n, T), PAD)
    for i in range(n):
        p = PROMPT_LENS[i]
        prompt_ids[i, P - p :] = torch.randint(2, VOCAB, (p,), generator=g)
        prompt_mask[i, P - p :] = 1
        w = _span(masks[i])  # gap tokens are real tokens; padding only after the last action
        responses[i, :w] = torch.randint(2, VOCAB, (w,), generator=g)
    response_mask = torch.tensor(masks)
    old = (-2.5 + 0.3 * torch.randn(n, T, generator=g)).clamp(max=0) * response_mask
    ref = (-2.5 + 0.3 * torch.randn(n, T, generator=g)).clamp(max=0) * response_mask
    return Batch(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "responses": responses,
            "response_mask": response_mask,
            "old_logprobs": old,
            "ref_logprobs": ref,
            "advantages": torch.randn(n, generator=g),
            "group_ids": torch.arange(n) // 4,
        }
    )


# ----- the reference, written out -----------------------------------------------------------------


def _hand_logits(model, b: Batch, temperature: float = 1.0) -> torch.Tensor:
    """Logits [B, T, V] predicting each response token: one pass over [prompt | response] that
    attends to every response column up to the row's last model token (gap tokens included)."""
    span = torch.zeros_like(b["response_mask"])
    for i, row in enumerate(b["response_mask"].tolist()):
        span[i, : _span(row)] = 1
    ids = torch.cat([b["prompt_ids"], b["responses"]], dim=1)
    attention = torch.cat([b["prompt_mask"], span], dim=1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    width = b["prompt_ids"].shape[1]
    return logits[:, width - 1 : width + T - 1].float() / temperature


def _hand_terms(model, b: Batch, temperature: float = 1.0, level: str = "token"):
    logits = _hand_logits(model, b, temperature)
    logp = logits.log_softmax(-1).gather(-1, b["responses"][..., None])[..., 0]
    ratio = (logp - b["old_logprobs"]).exp()
    if level == "sequence":  # GSPO: exp of the mean log-ratio over the row's model tokens
        m = b["response_mask"]
        log_ratio = ((logp - b["old_logprobs"]) * m).sum(1) / m.sum(1)
        ratio = log_ratio.exp()[:, None].expand_as(logp)
    a = b["advantages"][:, None]
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))  # PPO clip, eps 0.2
    pg = torch.where(a < 0, torch.minimum(pg, -3.0 * a), pg)  # dual clip, c = 3
    delta = b["ref_logprobs"] - logp
    k3 = delta.exp() - delta - 1
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    return pg, k3, entropy, ratio


def _hand_aggregate(x: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    m = mask.float()
    if mode == "token_mean":
        return (x * m).sum() / m.sum()
    if mode == "seq_mean_token_mean":
        return ((x * m).sum(1) / m.sum(1)).mean()
    if mode == "seq_mean_token_sum_norm":
        return (x * m).sum() / (x.shape[0] * T)
    raise AssertionError(mode)


def _hand_loss(
    model, b: Batch, mode: str, kl: float, ent: float, groups=None, level="token", corrected=False
):
    """The loss of one optimizer step; ``local_token_mean`` as TRL's bnpo: per micro-batch
    (``groups``) its own token mean, divided by the number of accumulation steps; ``corrected``:
    TRL's use_bias_correction_kl, k3 times the importance ratio of the loss's level."""
    pg, k3, entropy, ratio = _hand_terms(model, b, level=level)
    mask = b["response_mask"]
    total = pg + kl * (ratio * k3 if corrected else k3) - ent * entropy
    if mode != "local_token_mean":
        return _hand_aggregate(total, mask, mode)
    means = [_hand_aggregate(total[g], mask[g], "token_mean") for g in groups]
    return sum(means) / len(groups)


def _hand_grads(model, b: Batch, mode: str, kl: float = 0.0, ent: float = 0.0, groups=None, **kw):
    ref = copy.deepcopy(model)
    _hand_loss(ref, b, mode, kl, ent, groups, **kw).backward()
    return [p.grad for p in ref.parameters()]


# ----- the worker ---------------------------------------------------------------------------------


def _worker(model, **cfg) -> ActorRolloutWorker:
    return ActorRolloutWorker(
        copy.deepcopy(model), None, ActorConfig(**{"lr": 1e-2, "grad_clip": None, **cfg}),
        total_steps=10, pad_id=PAD, eos_ids=[EOS],
    )  # fmt: skip


def _update_grads(worker: ActorRolloutWorker, batch: Batch) -> tuple[list, dict]:
    seen = []
    worker.optimizer.step = lambda *a, **k: seen.append(
        [p.grad.clone() for p in worker.model.parameters()]
    )
    metrics = worker.update(batch, temperature=1.0)
    assert len(seen) == 1
    return seen[0], metrics


def _norm(grads) -> float:
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def _assert_grads(actual, expected):
    assert _norm(expected) > 1e-3  # a real gradient
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


# ----- local_token_mean is TRL's bnpo -------------------------------------------------------------

# 8 samples: one micro-batch, 2 of 4 samples, 4 of 2 samples (a token budget: below)
_SPLITS = [
    ({}, [range(8)]),
    ({"micro_batch_samples": 4}, [range(0, 4), range(4, 8)]),
    ({"micro_batch_samples": 2}, [range(i, i + 2) for i in range(0, 8, 2)]),
]


@pytest.mark.parametrize("split, groups", _SPLITS)
def test_local_token_mean_is_trl_bnpo_through_the_worker(split, groups):
    model, batch = _model(), _batch(PREFIX)
    grads, metrics = _update_grads(_worker(model, loss_agg="local_token_mean", **split), batch)
    expected = _hand_grads(model, batch, "local_token_mean", groups=[list(g) for g in groups])
    _assert_grads(grads, expected)
    assert metrics["actor/grad_norm"] == pytest.approx(_norm(expected), rel=1e-4)


def test_local_token_mean_with_a_token_budget_is_trl_bnpo():
    model, batch = _model(), _batch(PREFIX)
    groups = micro_batches(row_widths(batch), None, 20)
    # (prompt, response) widths (2,5) (3,2) (4,3) (2,1) (3,7) (4,4) (2,2) (3,6), packed by hand
    assert groups == [[0, 1], [2, 3], [4], [5, 6], [7]]
    grads, _ = _update_grads(
        _worker(model, loss_agg="local_token_mean", micro_batch_tokens=20), batch
    )
    _assert_grads(grads, _hand_grads(model, batch, "local_token_mean", groups=groups))


def test_local_token_mean_gradient_keeps_its_scale_with_more_micro_batches():
    """The issue's measurement: the norm doubled with each doubling of the micro-batch count
    (0.662 -> 1.325 -> 2.649) while token_mean stayed put."""
    model, batch = _model(), _batch(PREFIX)
    norms = [
        _update_grads(_worker(model, loss_agg="local_token_mean", **split), batch)[1][
            "actor/grad_norm"
        ]
        for split, _ in _SPLITS
    ]
    assert max(norms) / min(norms) < 1.5, norms


def test_local_token_mean_metrics_are_means_over_micro_batches():
    model, batch = _model(), _batch(PREFIX)
    _, whole = _update_grads(_worker(model, loss_agg="local_token_mean"), batch)
    _, split = _update_grads(
        _worker(model, loss_agg="local_token_mean", micro_batch_samples=2), batch
    )
    # entropy: the mean of the 4 micro-batches' token means, of the same order as the whole's
    assert split["actor/entropy"] == pytest.approx(whole["actor/entropy"], rel=0.1)
    with torch.no_grad():
        _, _, entropy, _ = _hand_terms(model, batch)
        m = batch["response_mask"]
        by_hand = sum(
            _hand_aggregate(entropy[i : i + 2], m[i : i + 2], "token_mean") for i in (0, 2, 4, 6)
        )
    assert split["actor/entropy"] == pytest.approx(float(by_hand) / 4, rel=1e-5)


# ----- gaps in the response mask ------------------------------------------------------------------

_GAP_SPLITS = [{}, {"micro_batch_samples": 3}, {"micro_batch_tokens": 20}]


@pytest.mark.parametrize("split", _GAP_SPLITS)
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_gapped_masks_give_the_hand_computed_gradient(mode, split):
    model, batch = _model(), _batch(GAPPED)
    worker = _worker(model, loss_agg=mode, kl_coef=0.1, entropy_coef=0.01, **split)
    grads, metrics = _update_grads(worker, batch)
    _assert_grads(grads, _hand_grads(model, batch, mode, kl=0.1, ent=0.01))
    with torch.no_grad():
        pg, k3, _, _ = _hand_terms(model, batch)
    mask = batch["response_mask"]
    assert metrics["actor/pg_loss"] == pytest.approx(
        float(_hand_aggregate(pg, mask, mode)), rel=1e-4
    )
    assert metrics["actor/kl_loss"] == pytest.approx(
        float(_hand_aggregate(k3, mask, mode)), rel=1e-4
    )


@pytest.mark.parametrize("split", _GAP_SPLITS)
def test_gapped_masks_with_local_token_mean(split):
    model, batch = _model(), _batch(GAPPED)
    groups = micro_batches(
        row_widths(batch), split.get("micro_batch_samples"), split.get("micro_batch_tokens")
    )
    grads, _ = _update_grads(_worker(model, loss_agg="local_token_mean", **split), batch)
    _assert_grads(grads, _hand_grads(model, batch, "local_token_mean", groups=groups))


def test_micro_batch_widths_reach_the_last_model_token():
    batch = _batch(GAPPED)
    assert row_widths(batch) == [(p, _span(m)) for p, m in zip(PROMPT_LENS, GAPPED)]
    assert [w for _, w in row_widths(batch)] == [7, 3, 3, 4, 7, 7, 2, 6]
    # packing (prompt + response width) x rows <= 20
    assert micro_batches(row_widths(batch), None, 20) == [[0, 1], [2, 3], [4], [5], [6, 7]]


def test_log_probs_of_gapped_responses_are_the_hand_computed_ones():
    model, batch = _model(), _batch(GAPPED)
    for split in _GAP_SPLITS:
        worker = _worker(model, **split)
        out = worker.compute_logprobs(batch, temperature=0.7)["logprobs"]
        with torch.no_grad():
            logits = _hand_logits(model, batch, 0.7)
            expected = logits.log_softmax(-1).gather(-1, batch["responses"][..., None])[..., 0]
        mask = batch["response_mask"].bool()
        torch.testing.assert_close(out[mask], expected[mask], atol=1e-5, rtol=0)
        assert (out[~mask] == 0).all()  # gap tokens get no log-prob


def test_skipping_zero_advantage_samples_with_gaps():
    model, batch = _model(), _batch(GAPPED)
    batch["advantages"][4:] = 0.0  # group 1: all rewards equal
    grads, metrics = _update_grads(_worker(model, micro_batch_tokens=20), batch)
    assert metrics["actor/zero_adv_skipped"] == 0.5
    _assert_grads(grads, _hand_grads(model, batch, "token_mean"))


def test_a_sample_whose_advantages_sit_only_on_gap_tokens_is_skipped():
    model, batch = _model(), _batch(GAPPED)
    adv = batch["advantages"][:, None].repeat(1, T) * batch["response_mask"]
    adv[0] = torch.tensor([0.0, 0.0, 5.0, -5.0, 0.0, 0.0, 0.0])  # only on row 0's gap
    batch["advantages"] = adv
    worker = _worker(model)
    rows = []
    forward = worker.policy.forward
    worker.policy.forward = lambda ids, *a, **k: rows.append(ids.shape[0]) or forward(ids, *a, **k)
    _, metrics = _update_grads(worker, batch)
    assert sum(rows) == 7 and metrics["actor/zero_adv_skipped"] == pytest.approx(1 / 8)


def test_critic_values_of_gapped_responses_attend_to_the_gap_tokens():
    policy, batch = _model(), _batch(GAPPED)
    torch.manual_seed(1)
    critic = CriticWorker(
        value_model_from_config(policy.config), CriticConfig(micro_batch_samples=3), total_steps=1
    )
    values = critic.compute_values(batch)["values"]
    span = torch.zeros_like(batch["response_mask"])
    for i, row in enumerate(GAPPED):
        span[i, : _span(row)] = 1
    attention = torch.cat([batch["prompt_mask"], span], dim=1)
    with torch.no_grad():
        out = critic.model(
            input_ids=torch.cat([batch["prompt_ids"], batch["responses"]], dim=1),
            attention_mask=attention,
            position_ids=(attention.cumsum(1) - 1).clamp(min=0),
        ).logits[:, P - 1 : P + T - 1, 0]
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(values[mask], out[mask], atol=1e-5, rtol=0)
    assert (values[~mask] == 0).all()


# ----- TRL's bias-corrected KL -------------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("split", [{}, {"micro_batch_samples": 3}])
def test_bias_corrected_kl_is_k3_times_the_ratio(level, split):
    model, batch = _model(), _batch(GAPPED)
    cfg = {"kl_coef": 0.5, "kl_bias_correction": True, "ratio_level": level, **split}
    grads, metrics = _update_grads(_worker(model, **cfg), batch)
    expected = _hand_grads(model, batch, "token_mean", kl=0.5, level=level, corrected=True)
    _assert_grads(grads, expected)
    with torch.no_grad():
        _, k3, _, ratio = _hand_terms(model, batch, level=level)
        kl = _hand_aggregate(ratio * k3, batch["response_mask"], "token_mean")
    assert metrics["actor/kl_loss"] == pytest.approx(float(kl), rel=1e-4)
    # and it is not the plain k3 gradient (the old log-probs are off-policy here)
    plain = _hand_grads(model, batch, "token_mean", kl=0.5, level=level)
    assert max(float((a - b).abs().max()) for a, b in zip(expected, plain)) > 1e-4


def test_bias_corrected_kl_on_policy_adds_the_score_function_term():
    """mu = 1 without old log-probs: rho = 1 in value, yet the gradient differs from plain k3."""
    model, batch = _model(), _batch(GAPPED)
    del batch["old_logprobs"]
    grads, _ = _update_grads(_worker(model, kl_coef=0.5, kl_bias_correction=True), batch)
    plain, _ = _update_grads(_worker(model, kl_coef=0.5), batch)
    with torch.no_grad():
        logits = _hand_logits(model, batch)
        logp = logits.log_softmax(-1).gather(-1, batch["responses"][..., None])[..., 0]
    batch["old_logprobs"] = logp  # rho == 1 exactly, with the ratio's gradient
    _assert_grads(grads, _hand_grads(model, batch, "token_mean", kl=0.5, corrected=True))
    assert max(float((a - b).abs().max()) for a, b in zip(grads, plain)) > 1e-4


def test_gapped_responses_behind_a_shared_prompt():
    """GRPO's G samples repeat one prompt: the update encodes it once and shares its K/V; the
    response pass then attends to the gap tokens exactly like the single pass."""
    from groupflow.models.causal_lm import prompt_sharing_applies

    model, batch = _model(), _batch(GAPPED)
    for i in range(8):  # each group of 4 repeats its first row's prompt
        for key in ("prompt_ids", "prompt_mask"):
            batch[key][i] = batch[key][4 * (i // 4)]
    assert prompt_sharing_applies(
        model, batch["prompt_ids"], batch["prompt_mask"], batch["responses"]
    )
    for split in ({}, {"micro_batch_tokens": 40}):
        worker = _worker(model, kl_coef=0.1, **split)
        calls = []
        worker.model.get_decoder().register_forward_hook(lambda *_, calls=calls: calls.append(1))
        grads, _ = _update_grads(worker, batch)
        if not split:
            assert len(calls) == 2  # the prompts, then the responses: the shared path ran
        _assert_grads(grads, _hand_grads(model, batch, "token_mean", kl=0.1))


# ----- two data-parallel ranks with different micro-batch counts ---------------------------------

_RANK_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from groupflow.config import ActorConfig
from groupflow.distributed.parallel import init_process_group
from groupflow.models.causal_lm import build_tiny_llama
from groupflow.workers.actor import ActorRolloutWorker

rank, folder = int(sys.argv[1]), sys.argv[2]
init_process_group(rank, 2, 120)
model = build_tiny_llama(12, hidden_size=16, num_layers=2, num_heads=2, max_positions=32,
                         pad_token_id=0, eos_token_id=1, seed=0)
cfg = ActorConfig(lr=1e-2, grad_clip=None, loss_agg="local_token_mean", micro_batch_tokens=20)
worker = ActorRolloutWorker(model, None, cfg, total_steps=1, pad_id=0, eos_ids=[1], rank=rank,
                            world_size=2)
def step(*a, **k):
    grads = [p.grad.full_tensor() for p in worker.model.parameters()]  # a collective
    if rank == 0:
        torch.save(grads, folder + "/grads.pt")
worker.optimizer.step = step
metrics = worker.update(torch.load(folder + f"/half{rank}.pt", weights_only=False), temperature=1.0)
torch.save(metrics, folder + f"/metrics{rank}.pt")
"""


@pytest.mark.slow
def test_local_token_mean_on_two_ranks_with_different_micro_batch_counts(tmp_path):
    """Rank 0 packs its 4 samples into 2 micro-batches, rank 1 into 3 (token budget): the
    gradient is the mean of the 5 micro-batches' token-mean gradients — TRL's bnpo when ranks
    run as many micro-batches, each micro-batch weighted alike when they do not."""
    import os
    import subprocess
    import sys

    from groupflow.distributed.group import free_port

    model, batch = _model(), _batch(PREFIX)
    halves = [batch.index(list(range(0, 4))), batch.index(list(range(4, 8)))]
    groups = [micro_batches(row_widths(h), None, 20) for h in halves]
    assert groups == [[[0, 1], [2, 3]], [[0], [1, 2], [3]]]
    for r, h in enumerate(halves):
        torch.save(h, tmp_path / f"half{r}.pt")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["OMP_NUM_THREADS"] = "1"
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, str(r), str(tmp_path)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]  # fmt: skip
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    grads = torch.load(tmp_path / "grads.pt")
    all_groups = groups[0] + [[4 + i for i in g] for g in groups[1]]
    _assert_grads(grads, _hand_grads(model, batch, "local_token_mean", groups=all_groups))
