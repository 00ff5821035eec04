"""The gradient of one mini-batch must not depend on how it is split into micro-batches or ranks.

A tiny linear "policy" (logits = features @ W^T) produces log-probs for 8 samples with different
response lengths (one empty). The loss is policy loss + beta * KL - coef * entropy, all aggregated
with the same mode and the mini-batch-global denominators. Each micro-batch is trimmed to its own
longest response, as padding-free/dynamic-batch engines do, so `max_len` must come from outside.
"""

import pytest
import torch

from groupflow.algorithms import (
    aggregate,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    loss_denominators,
    policy_loss,
)

INVARIANT_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
B, T, D, V = 8, 6, 4, 5
LENGTHS = [6, 3, 1, 5, 2, 6, 4, 0]


def make_batch():
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)).long()
    w0 = torch.randn(V, D, generator=g, dtype=torch.float64)
    with torch.no_grad():
        logp0 = logprobs_from_logits(feats @ w0.T, tokens)
    # Perturbed old/ref log-probs so that some ratios fall outside the clip range.
    old = logp0 + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp0 + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    batch = {"feats": feats, "tokens": tokens, "mask": mask, "old": old, "ref": ref, "adv": adv}
    return w0, batch


def loss_of(w, batch, mode, dens, loss_fn="ppo_clip"):
    logits = batch["feats"] @ w.T
    logp = logprobs_from_logits(logits, batch["tokens"])
    mask = batch["mask"]
    pg, _ = policy_loss(logp, batch["old"], batch["adv"], mask, loss_fn=loss_fn, agg=mode, **dens)
    kl = aggregate(kl_penalty(logp, batch["ref"], "k3"), mask, mode, **dens)
    ent = aggregate(entropy_from_logits(logits), mask, mode, **dens)
    return pg + 0.05 * kl - 0.01 * ent


def micro_batches(batch, idx_chunks):
    """Slice samples and trim each micro-batch to its own longest response (>= 1 column)."""
    out = []
    for idx in idx_chunks:
        width = max(1, int(batch["mask"][idx].sum(-1).max()))
        out.append({k: (v[idx][:, :width] if v.dim() > 1 else v[idx]) for k, v in batch.items()})
    return out


def grad_of(w0, pieces, mode, dens, scale=1.0, loss_fn="ppo_clip"):
    """Sum of micro-batch gradients (gradient accumulation = summing the losses)."""
    w = w0.clone().requires_grad_(True)
    for piece in pieces:
        (scale * loss_of(w, piece, mode, dens, loss_fn)).backward()
    return w.grad


def chunks(n):
    return list(torch.arange(B).chunk(n))


def allreduce(dens_per_rank):
    """What a DP engine does with `loss_denominators` of each rank: sum counts, max the width."""
    return {
        "num_tokens": sum(d["num_tokens"] for d in dens_per_rank),
        "num_seqs": sum(d["num_seqs"] for d in dens_per_rank),
        "max_len": max(d["max_len"] for d in dens_per_rank),
    }


@pytest.mark.parametrize("mode", INVARIANT_MODES)
def test_gradient_invariant_to_micro_batches_and_ranks(mode):
    w0, batch = make_batch()
    dens = loss_denominators(batch["mask"])
    assert dens == {"num_tokens": sum(LENGTHS), "num_seqs": B, "max_len": T, "num_micro_batches": 1}
    full = grad_of(w0, [batch], mode, dens)
    assert full.abs().sum() > 0
    logp = logprobs_from_logits(batch["feats"] @ w0.T, batch["tokens"])
    _, metrics = policy_loss(logp, batch["old"], batch["adv"], batch["mask"])
    assert metrics["clipfrac_low"] + metrics["clipfrac_high"] > 0  # clipping is exercised

    for n in (1, 2, 4):
        torch.testing.assert_close(
            grad_of(w0, micro_batches(batch, chunks(n)), mode, dens), full, atol=1e-6, rtol=0
        )

    # Two data-parallel ranks, each with two micro-batches; denominators all-reduced from the
    # ranks' own micro-batch masks; gradients SUMMED across ranks.
    ranks = [micro_batches(batch, list(half.chunk(2))) for half in torch.arange(B).chunk(2)]
    global_dens = allreduce([loss_denominators([p["mask"] for p in rank]) for rank in ranks])
    summed = sum(grad_of(w0, rank, mode, global_dens) for rank in ranks)
    torch.testing.assert_close(summed, full, atol=1e-6, rtol=0)

    # Equivalent for an averaging all-reduce (DDP/FSDP): scale each rank's loss by world size.
    averaged = sum(grad_of(w0, rank, mode, global_dens, scale=2.0) for rank in ranks) / 2
    torch.testing.assert_close(averaged, full, atol=1e-6, rtol=0)


@pytest.mark.parametrize("loss_fn", ["cispo", "sapo", "vespo"])
@pytest.mark.parametrize("mode", INVARIANT_MODES)
def test_other_losses_are_invariant_too(mode, loss_fn):
    # VESPO's sequence weight sums a row's log-ratios: trimming a micro-batch must not change it
    w0, batch = make_batch()
    dens = loss_denominators(batch["mask"])
    full = grad_of(w0, [batch], mode, dens, loss_fn=loss_fn)
    assert full.abs().sum() > 0
    four = grad_of(w0, micro_batches(batch, chunks(4)), mode, dens, loss_fn=loss_fn)
    torch.testing.assert_close(four, full, atol=1e-6, rtol=0)
    ranks = [micro_batches(batch, list(half.chunk(2))) for half in torch.arange(B).chunk(2)]
    global_dens = allreduce([loss_denominators([p["mask"] for p in rank]) for rank in ranks])
    summed = sum(grad_of(w0, rank, mode, global_dens, loss_fn=loss_fn) for rank in ranks)
    torch.testing.assert_close(summed, full, atol=1e-6, rtol=0)


def test_local_token_mean_is_not_invariant():
    w0, batch = make_batch()
    full = grad_of(w0, [batch], "local_token_mean", loss_denominators(batch["mask"]))
    pieces = micro_batches(batch, chunks(2))
    averaged = grad_of(
        w0, pieces, "local_token_mean", loss_denominators([p["mask"] for p in pieces])
    )
    # Averaging per-micro-batch token means does not recover the full-batch gradient: the
    # samples of the shorter micro-batch get more weight per token.
    assert (averaged - full).abs().max() > 1e-3


def test_local_token_mean_is_the_mean_of_micro_batch_token_means_trl_bnpo():
    """TRL's bnpo, by hand: each micro-batch's token mean / gradient-accumulation steps, averaged
    over ranks (DDP). With the micro-batch count as denominator the gradient keeps its scale."""
    w0, batch = make_batch()
    for n in (1, 2, 4):
        pieces = micro_batches(batch, chunks(n))
        by_hand = sum(grad_of(w0, [p], "local_token_mean", {}) for p in pieces) / n
        dens = loss_denominators([p["mask"] for p in pieces])
        assert dens["num_micro_batches"] == n
        torch.testing.assert_close(grad_of(w0, pieces, "local_token_mean", dens), by_hand)
    # two ranks with two micro-batches each: the counts are summed, DDP averages (x world size)
    ranks = [micro_batches(batch, list(half.chunk(2))) for half in torch.arange(B).chunk(2)]
    per_rank = [loss_denominators([p["mask"] for p in rank]) for rank in ranks]
    dens = {
        **allreduce(per_rank),
        "num_micro_batches": sum(d["num_micro_batches"] for d in per_rank),
    }
    ddp = sum(grad_of(w0, rank, "local_token_mean", dens, scale=2.0) for rank in ranks) / 2
    trl = sum(sum(grad_of(w0, [p], "local_token_mean", {}) for p in rank) / 2 for rank in ranks) / 2
    torch.testing.assert_close(ddp, trl)
    # the gradient does not grow with the number of micro-batches (it did when they were summed)
    one = grad_of(w0, [batch], "local_token_mean", {}).norm()
    four = grad_of(
        w0, micro_batches(batch, chunks(4)), "local_token_mean", {"num_micro_batches": 4}
    )
    assert 0.5 < float(four.norm() / one) < 2.0


def test_local_denominators_are_not_invariant_either():
    """Forgetting to pass the global denominators is the TRL 3021 / verl 5625 bug."""
    w0, batch = make_batch()
    full = grad_of(w0, [batch], "seq_mean_token_sum_norm", {})
    summed = grad_of(w0, micro_batches(batch, chunks(2)), "seq_mean_token_sum_norm", {})
    assert (summed - full).abs().max() > 1e-3
