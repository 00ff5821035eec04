"""Per-rank memory of a sharded actor (2 gloo ranks, torch.multiprocessing, one torch thread each):
the reference is FSDP2-sharded like the policy, and its and the policy's log-probs — computed in
lockstep, each rank running as many forwards as the other though a token budget gives them
different numbers of micro-batches — equal one unsharded worker's.

Every rank builds the same tiny Llama, takes its ``dp`` share of one hand-made batch (the
WorkerGroup's own ``split_args``); rank 0 writes what the ranks computed, in batch order.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from groupflow.batch import Batch
from groupflow.config import ActorConfig
from groupflow.distributed.dispatch import split_args
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.workers.actor import ActorRolloutWorker
from groupflow.workers.update import micro_batches, row_widths
from tests.workers.test_actor_parallel import EOS, PAD, _batch, _model

# a token budget: the two ranks' halves of _batch() pack into different numbers of micro-batches
CFG = {"kl_coef": 0.1, "micro_batch_tokens": 14, "lr": 0.05}


def _reference_weights() -> dict[str, torch.Tensor]:
    """A reference unlike the policy (so the two log-probs differ and each is checked)."""
    g = torch.Generator().manual_seed(5)
    model = _model()
    with torch.no_grad():
        for p in model.parameters():  # once per tensor: the embeddings and head may be tied
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return {k: v.detach() for k, v in model.state_dict().items()}


def _prompts() -> Batch:
    """4 prompts of 1-4 tokens, 2 samples each, one seed per sample."""
    ids = [[3 + i] * (1 + i) for i in range(4)]
    seeds = [[10 * i, 10 * i + 1] for i in range(4)]
    return Batch({"group_ids": torch.arange(4)}, {"prompt_token_ids": ids, "seeds": seeds})


# EOS is one of 12 tokens: rows (and so the ranks) finish at different steps
SAMPLING = [
    SamplingParams(n=2, max_new_tokens=8),
    SamplingParams(n=2, max_new_tokens=8, static_kv_cache=False),
]


def _generate(worker, rank: int, world: int) -> list[torch.Tensor]:
    share = split_args("dp", world, (_prompts(),), {})[0][rank][0][0]
    return [worker.generate(share, params)["responses"] for params in SAMPLING]


def run(rank: int, world: int, generation_weights: str = "gather") -> dict:
    cfg = ActorConfig(**CFG, generation_weights=generation_weights)
    worker = ActorRolloutWorker(
        _model(), None, cfg, total_steps=10, pad_id=PAD, eos_ids=[EOS], rank=rank,
        world_size=world,
    )  # fmt: skip
    # generation first: FSDP2 has not seen a forward yet (the root must still be the root)
    before = _generate(worker, rank, world)
    worker.load_reference(_reference_weights())
    share = split_args("dp", world, (_batch(),), {})[0][rank][0][0]
    ref_root = worker.reference.root if worker.reference is not None else None
    ref_params = list(ref_root.parameters()) if ref_root is not None else []
    out = {
        "n_micro": len(micro_batches(row_widths(share), None, CFG["micro_batch_tokens"])),
        "ref": worker.compute_logprobs(share, temperature=1.0, reference=True)["logprobs"],
        "old": worker.compute_logprobs(share, temperature=0.7)["logprobs"],
        "ref_weights": worker.reference_weights(),
        "ref_dtensor": bool(ref_params) and all(isinstance(p, DTensor) for p in ref_params),
        # what this rank holds of the reference's parameters (shards) and of the policy's
        "ref_numel": sum(p.to_local().numel() for p in ref_params),
        "copy": worker.rollout_model is not None,
    }
    share["ref_logprobs"] = out["ref"]
    worker.update(share, temperature=1.0)
    out["tokens"] = before + _generate(worker, rank, world)  # after the update: new weights
    out["weights"] = worker.full_weights()  # an unsharded model rebuilt on rank 0
    worker.reset_reference()  # the trained policy becomes the reference (shard into shard)
    out["reset"] = [worker.compute_logprobs(share, temperature=1.0, reference=r)["logprobs"]
                    for r in (True, False)]  # fmt: skip
    return out


def _rank(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        mine = {w: run(rank, world, w) for w in ("gather", "copy")}
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            torch.save(gathered, out)
        dist.barrier()  # neither rank tears gloo down while its peer still talks
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes importing torch and transformers
def test_a_sharded_reference_lockstep_logprobs_and_gathered_generation_equal_one_worker(tmp_path):
    single = run(0, 1)
    out = tmp_path / "results.pt"
    mp.spawn(_rank, args=(2, str(tmp_path / "store"), str(out)), nprocs=2)
    ranks = torch.load(out, weights_only=False)
    gather, copied = [r["gather"] for r in ranks], [r["copy"] for r in ranks]
    # the premise: the ranks' token budgets give them different numbers of forwards
    assert gather[0]["n_micro"] != gather[1]["n_micro"]
    for key in ("ref", "old"):
        for variant in (gather, copied):
            two = torch.cat([r[key] for r in variant])
            assert torch.allclose(two, single[key], rtol=1e-5, atol=1e-6), key
    assert not torch.allclose(single["ref"], single["old"], atol=1e-3)
    # the reference is sharded: half of it on each rank, the full weights gathered on rank 0
    total = sum(v.numel() for v in _model().parameters())
    assert all(r["ref_dtensor"] for r in gather) and not single["ref_dtensor"]
    assert sum(r["ref_numel"] for r in gather) == total
    assert max(r["ref_numel"] for r in gather) <= total // 2 + 64
    want = _reference_weights()
    for k, v in gather[0]["ref_weights"].items():
        assert torch.allclose(v, want[k]), k
    # generation from the sharded policy, layer by layer, samples what the full copy samples
    assert not any(r["copy"] for r in gather) and all(r["copy"] for r in copied)
    for i in range(len(single["tokens"])):  # static and dynamic cache, before and after update
        g = torch.cat([r["tokens"][i] for r in gather])
        assert torch.equal(g, torch.cat([r["tokens"][i] for r in copied])), i
        assert torch.equal(g, single["tokens"][i]), i
    lengths = (single["tokens"][0] != PAD).sum(-1)
    assert len(set(lengths.tolist())) > 1  # rows stopped at different steps
    assert not torch.equal(single["tokens"][0], single["tokens"][2])  # the update changed them
    for r in gather + [single]:
        assert torch.allclose(r["reset"][0], r["reset"][1], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(single["reset"][0], single["ref"], atol=1e-3)
    # full weights rebuilt from the weightless template equal those gathered through the copy
    assert gather[0]["weights"].keys() == copied[0]["weights"].keys()
    for k, v in copied[0]["weights"].items():
        assert torch.equal(gather[0]["weights"][k], v), k
