"""The actor worker on several gloo ranks (torch.multiprocessing, one torch thread each): an
update with FSDP2 CPU offload equals one without, and both equal a single worker; Ulysses
sequence parallelism — 2 workers as one group of 2 equal one worker, 4 workers as 2 data-parallel
replicas × groups of 2 equal 2 plain data-parallel workers (log-probs, metrics, weights).

Each variant builds the same tiny Llama on every rank, receives its ``dp`` share of one hand-made
batch (the WorkerGroup's own ``split_args``), runs two updates of two epochs each (so
AdamW's state, offloaded or not, is used), and rank 0 writes the metrics and gathered weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from groupflow.batch import Batch
from groupflow.config import ActorConfig
from groupflow.distributed.dispatch import split_args
from groupflow.distributed.parallel import full_model_state
from groupflow.models.causal_lm import build_tiny_llama
from groupflow.workers.actor import ActorRolloutWorker

VOCAB, PAD, EOS = 12, 0, 1
# one optimizer step per update: ranks shuffle their own shares, so mini-batches would differ
CFG = {"lr": 1e-2, "ppo_epochs": 2}
KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/loss", "actor/approx_kl",
        "actor/ratio_max")  # fmt: skip


def _model(num_heads: int = 2, kv_heads: int | None = None):
    model = build_tiny_llama(
        VOCAB, hidden_size=16, num_layers=2, num_heads=num_heads, max_positions=32,
        pad_token_id=PAD, eos_token_id=EOS, seed=0,
    )  # fmt: skip
    if kv_heads is not None:  # grouped-query attention: rebuild with fewer K/V heads
        from transformers import LlamaForCausalLM

        config = model.config
        config.num_key_value_heads = kv_heads
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
    return model


def _batch(n: int = 8, seed: int = 0) -> Batch:
    """n samples: left-padded prompts of 2-4 tokens, responses of 1-5 tokens, 2 groups of 4."""
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
    old = (-2.5 + 0.3 * torch.randn(n, 5, generator=g)).clamp(max=0)
    return Batch(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "responses": responses,
            "response_mask": response_mask,
            "old_logprobs": old * response_mask,
            "advantages": torch.randn(n, generator=g),
            "group_ids": torch.arange(n) // 4,
        },
        {"uid": [str(i) for i in range(n)]},
    )


def _sft_rows(n: int = 4) -> Batch:
    """Supervised warm-start rows: prompts of 2-3 tokens, targets of 2-5 tokens."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, VOCAB, (2 + i % 2,), generator=g).tolist() for i in range(n)]
    targets = [torch.randint(2, VOCAB, (2 + i,), generator=g).tolist() for i in range(n)]
    return Batch({"sft_row": torch.arange(n)}, {"prompt_token_ids": prompts, "target_ids": targets})


def run_variant(rank: int, world: int, model_kw: dict, cfg: dict, worker_kw: dict) -> dict:
    """Two updates of one worker on this rank's share of the batch: the metrics and the full
    (gathered) weights after them, the log-probs of the batch before them; and the losses of two
    supervised warm-start steps of another such worker."""

    def worker():
        return ActorRolloutWorker(
            _model(**model_kw), None, ActorConfig(**{**CFG, **cfg}), total_steps=10, pad_id=PAD,
            eos_ids=[EOS], rank=rank, world_size=world, **worker_kw,
        )  # fmt: skip

    sft, sft_worker = split_args("dp", world, (_sft_rows(),), {})[0][rank][0][0], worker()
    sft_loss = [sft_worker.sft_step(sft, lr=1e-3) for _ in range(2)]
    worker = worker()
    batch = _batch()
    share = split_args("dp", world, (batch,), {})[0][rank][0][0]
    logprobs = worker.compute_logprobs(share, temperature=1.0)["logprobs"]
    metrics = [worker.update(share, temperature=1.0, shuffle_seed=s) for s in (0, 1)]
    weights = {k.removeprefix("lm."): v.clone() for k, v in full_model_state(worker.policy).items()}
    # FSDP2's own record of offloading (private state, read only here to see the switch land)
    groups = [m._get_fsdp_state()._fsdp_param_group for m in worker.policy.modules()
              if hasattr(m, "_get_fsdp_state")]  # fmt: skip
    params = [fp for g in groups if g is not None for fp in g.fsdp_params]
    offloaded = [fp.offload_to_cpu for fp in params]
    return {
        "offloaded": offloaded,
        "metrics": metrics,
        "weights": weights,
        "logprobs": logprobs,
        "sft_loss": sft_loss,
    }


def _rank(rank: int, world: int, store: str, out: str, variants: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        results = {name: run_variant(rank, world, *args) for name, args in variants.items()}
        gathered = [None] * world
        dist.all_gather_object(gathered, {k: r["logprobs"] for k, r in results.items()})
        if rank == 0:
            for name, r in results.items():  # the ranks' log-probs, in batch order
                r["logprobs"] = torch.cat([g[name] for g in gathered])
            torch.save(results, out)
        dist.barrier()  # neither rank tears gloo down while its peer still talks
    finally:
        dist.destroy_process_group()


def spawn(tmp_path, world: int, variants: dict) -> dict:
    out = tmp_path / "results.pt"
    mp.spawn(_rank, args=(world, str(tmp_path / "store"), str(out), variants), nprocs=world)
    return torch.load(out, weights_only=False)


def assert_same_run(got: dict, want: dict, rel: float = 1e-5, abs_: float = 1e-6) -> None:
    assert got["sft_loss"] == pytest.approx(want["sft_loss"], rel=1e-4)
    assert torch.allclose(got["logprobs"], want["logprobs"], rtol=rel, atol=abs_)
    for step, (g, w) in enumerate(zip(got["metrics"], want["metrics"])):
        for k in KEYS:
            assert g[k] == pytest.approx(w[k], rel=rel, abs=abs_), (step, k)
    assert got["weights"].keys() == want["weights"].keys()
    for k, v in want["weights"].items():
        assert torch.allclose(got["weights"][k], v, rtol=rel, atol=abs_), k


@pytest.mark.slow  # two processes importing torch and transformers
def test_an_update_with_cpu_offload_equals_one_without_and_one_worker(tmp_path):
    single = run_variant(0, 1, {}, {}, {})
    two = spawn(tmp_path, 2, {
        "plain": ({}, {}, {}),
        "offload": ({}, {"cpu_offload": True}, {}),
    })  # fmt: skip
    # offload moves where shards live, not a number: the same as without, to float tolerance
    assert two["offload"]["offloaded"] and all(two["offload"]["offloaded"])
    assert two["plain"]["offloaded"] and not any(two["plain"]["offloaded"])
    assert_same_run(two["offload"], two["plain"], rel=1e-6, abs_=1e-7)
    assert_same_run(two["plain"], single)
    # the update moved the weights (the comparison is not between two untrained models)
    start = _model().state_dict()
    assert any(not torch.equal(v, start[k]) for k, v in single["weights"].items())


# Mini-batches (two optimizer steps per epoch), a per-sequence loss and an entropy bonus with
# gradient: the sequence-parallel bookkeeping (pooled rows, denominators, the entropy's gather)
# all matter. A grouped-query model: 4 query heads over 2 K/V heads.
SP_CFG = {"mini_batch_samples": 4, "loss_agg": "seq_mean_token_mean", "entropy_coef": 0.01}
GQA = {"num_heads": 4, "kv_heads": 2}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn(tmp_path_factory.mktemp("two"), 2, {
        "sp": (GQA, SP_CFG, {"sequence_parallel": 2}),
        "sp_offload": (GQA, {**SP_CFG, "cpu_offload": True}, {"sequence_parallel": 2}),
        "dp": (GQA, SP_CFG, {}),
    })  # fmt: skip


@pytest.mark.slow
def test_two_workers_as_one_sequence_parallel_group_equal_one_worker(two_ranks):
    single = run_variant(0, 1, GQA, SP_CFG, {})
    assert_same_run(two_ranks["sp"], single)
    assert_same_run(two_ranks["sp_offload"], single)
    assert all(two_ranks["sp_offload"]["offloaded"])
    # the plain 2-rank run shuffles each rank's half on its own: its mini-batches differ, so
    # its numbers do (the comparison above could tell the two apart)
    assert two_ranks["dp"]["metrics"][0]["actor/pg_loss"] != pytest.approx(
        single["metrics"][0]["actor/pg_loss"], rel=1e-4
    )


@pytest.mark.slow  # four processes
def test_two_data_parallel_replicas_of_two_sequence_parallel_ranks_equal_two_workers(
    two_ranks, tmp_path
):
    four = spawn(tmp_path, 4, {"dp_sp": (GQA, SP_CFG, {"sequence_parallel": 2})})
    assert_same_run(four["dp_sp"], two_ranks["dp"])
