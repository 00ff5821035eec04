"""actor.share_prompt_prefix: an update and a log-prob recomputation give the same numbers with the
prompt encoded once per group as with one pass per sample (the switch only changes the compute)."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError

from groupflow.batch import Batch
from groupflow.config import ActorConfig
from groupflow.models.causal_lm import build_tiny_llama
from groupflow.workers.actor import ActorRolloutWorker

VOCAB, PAD, EOS = 16, 0, 1
G, PROMPTS = 3, 4


def _model():
    return build_tiny_llama(
        VOCAB, hidden_size=16, num_layers=2, num_heads=2, max_positions=32, pad_token_id=PAD,
        eos_token_id=EOS, seed=0,
    )  # fmt: skip


def _worker(model, share: bool, **cfg) -> ActorRolloutWorker:
    return ActorRolloutWorker(
        copy.deepcopy(model), None,
        ActorConfig(**{"lr": 1e-2, "share_prompt_prefix": share, **cfg}),
        total_steps=10, pad_id=PAD, eos_ids=[EOS],
    )  # fmt: skip


def _group_batch(seed: int = 0) -> Batch:
    """PROMPTS left-padded prompts of 2-5 tokens, G samples each, rows shuffled."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.full((PROMPTS, 5), PAD)
    prompt_mask = torch.zeros(PROMPTS, 5, dtype=torch.long)
    for i in range(PROMPTS):
        n = 2 + i
        prompt_ids[i, 5 - n :] = torch.randint(2, VOCAB, (n,), generator=g)
        prompt_mask[i, 5 - n :] = 1
    rows = torch.arange(PROMPTS).repeat_interleave(G)[torch.randperm(PROMPTS * G, generator=g)]
    n = len(rows)
    r_len = [1 + (3 * i) % 6 for i in range(n)]
    responses = torch.full((n, 6), PAD)
    response_mask = torch.zeros(n, 6, dtype=torch.long)
    for i, k in enumerate(r_len):
        responses[i, :k] = torch.randint(2, VOCAB, (k,), generator=g)
        response_mask[i, :k] = 1
    old = (-2.5 + 0.3 * torch.randn(n, 6, generator=g)).clamp(max=0)
    return Batch(
        {
            "prompt_ids": prompt_ids[rows],
            "prompt_mask": prompt_mask[rows],
            "responses": responses,
            "response_mask": response_mask,
            "old_logprobs": old * response_mask,
            "advantages": torch.randn(n, generator=g),
            "group_ids": rows,
        },
        {"uid": [str(i) for i in range(n)]},
    )


def _count_decoder_calls(worker) -> list[int]:
    calls = [0]
    worker.model.get_decoder().register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize(
    "cfg",
    [
        {},  # one micro-batch holding every group
        # 4 shuffled mini-batches of 6 rows from 4 prompts: each has a repeated prompt
        {"ppo_epochs": 2, "mini_batch_samples": 6, "entropy_coef": 0.01},
    ],
)
def test_update_is_the_same_with_and_without_prompt_sharing(cfg):
    # lr 1e-4: Adam's first step is lr * g / (|g| + eps), which turns float-rounding differences
    # of near-zero gradients into differences of up to lr; 1e-4 keeps those under 1e-6.
    model, batch = _model(), _group_batch()
    shared, single = _worker(model, True, lr=1e-4, **cfg), _worker(model, False, lr=1e-4, **cfg)
    calls_shared, calls_single = _count_decoder_calls(shared), _count_decoder_calls(single)
    m_shared = shared.update(batch, temperature=0.8, shuffle_seed=3)
    m_single = single.update(batch, temperature=0.8, shuffle_seed=3)
    assert calls_shared[0] == 2 * calls_single[0]  # every micro-batch took the shared path
    moved = 0.0
    with torch.no_grad():
        for (name, a), b, p0 in zip(
            shared.model.named_parameters(), single.model.parameters(), model.parameters()
        ):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=f"{name} differs")
            moved = max(moved, float((a - p0).abs().max()))
    assert moved > 5e-5  # the step did change the weights
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert m_shared[key] == pytest.approx(m_single[key], rel=1e-5, abs=1e-7), key


def test_compute_logprobs_is_the_same_with_and_without_prompt_sharing():
    model, batch = _model(), _group_batch(seed=1)
    lp_shared = _worker(model, True).compute_logprobs(batch, temperature=0.8)["logprobs"]
    lp_single = _worker(model, False).compute_logprobs(batch, temperature=0.8)["logprobs"]
    torch.testing.assert_close(lp_shared, lp_single, atol=1e-5, rtol=1e-5)
    assert bool((lp_single[batch["response_mask"].bool()] < 0).all())
    assert bool((lp_single[~batch["response_mask"].bool()] == 0).all())


def test_share_prompt_prefix_defaults_on_and_is_a_strict_bool():
    assert ActorConfig().share_prompt_prefix is True
    with pytest.raises(ValidationError, match="share_prompt_prefix"):
        ActorConfig(share_prompt_prefix="maybe")


@pytest.mark.parametrize(
    ("rows", "global_min", "calls"),
    [
        ([0, 0, 1, 1], 1, 2),  # repeats here and on every rank: shared (prompt + response pass)
        ([0, 0, 1, 1], 0, 1),  # another rank cannot share: one pass here too
        ([0, 1, 2, 3], 1, 2),  # no repeats here, but the ranks decided to share: shared anyway
    ],
)
def test_sharded_ranks_decide_prompt_sharing_together(monkeypatch, rows, global_min, calls):
    """FSDP2 gathers every layer once per decoder call, so all ranks must make the same calls:
    a sharded policy asks every rank (all_reduce min) and follows the common answer."""
    import groupflow.workers.policy_forward as forward_module

    asked = []

    def fake_all_reduce(value, op="sum"):
        asked.append((value, op))
        return float(global_min)

    monkeypatch.setattr(forward_module, "all_reduce", fake_all_reduce)
    model = _model()
    policy = forward_module.PolicyForward(model, share_prompt_prefix=True, sharded=True)
    batch = _group_batch()
    idx = [int((batch["group_ids"] == g).nonzero()[k]) for k, g in zip([0, 1, 0, 1], rows)]
    mb = batch.index(idx)
    counter = [0]
    model.get_decoder().register_forward_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
    logp, _ = policy(
        mb["prompt_ids"], mb["prompt_mask"], mb["responses"], mb["response_mask"], 1.0, 4096, False
    )
    assert asked == [(int(len(set(rows)) < len(rows)), "min")]
    assert counter[0] == calls
    single, _ = forward_module.response_logprobs(
        model, mb["prompt_ids"], mb["prompt_mask"], mb["responses"], mb["response_mask"],
        share_prompt=False,
    )  # fmt: skip
    valid = mb["response_mask"] != 0
    torch.testing.assert_close(logp[valid], single[valid], rtol=0, atol=1e-5)
