"""Ulysses sequence parallelism on two gloo ranks (torch.multiprocessing, one torch thread each):
log-probs, entropy, a loss and every parameter gradient equal the single-process forward's.

Models: tiny Llamas with grouped-query attention (4 query heads over 2 K/V heads, which split
over 2 ranks, and over 1, which is repeated), a Qwen2 (biased q/k/v projections) and a Llama
with activation checkpointing; rows are left-padded prompts and responses of different lengths,
with odd total widths so that the sequence padding to a multiple of the group size is exercised.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from groupflow.distributed.ulysses import padded_length, sequence_groups
from groupflow.models.logprobs import response_logprobs
from groupflow.models.sequence_parallel import check_heads, sequence_parallel_logprobs

VOCAB = 20
VARIANTS = {
    "llama_gqa": {"kind": "llama", "kv": 2},
    "llama_kv1": {"kind": "llama", "kv": 1},
    "qwen2_gqa": {"kind": "qwen2", "kv": 2},
    "llama_checkpointed": {"kind": "llama", "kv": 2, "checkpointing": True},
}
FULL_PROMPTS = "llama_gqa_causal"  # the same model on rows without left padding: no mask built


def _model(kind: str, kv: int, checkpointing: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cls, config_cls = (LlamaForCausalLM, LlamaConfig) if kind == "llama" else (Qwen2ForCausalLM, Qwen2Config)  # fmt: skip
    config = config_cls(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _rows(full_prompts: bool = False):
    """4 rows: prompts of 2-5 tokens left-padded to 5 (or all of 5), responses of 1-6 tokens in
    width 6, one response with a gap (an observation token, mask 0, between actions)."""
    g = torch.Generator().manual_seed(1)
    p_len, r_len = [5] * 4 if full_prompts else [5, 2, 3, 4], [6, 1, 4, 3]
    prompt_ids = torch.randint(2, VOCAB, (4, 5), generator=g)
    prompt_mask = torch.zeros(4, 5, dtype=torch.long)
    responses = torch.randint(2, VOCAB, (4, 6), generator=g)
    response_mask = torch.zeros(4, 6, dtype=torch.long)
    for i in range(4):
        prompt_mask[i, 5 - p_len[i] :] = 1
        prompt_ids[i, : 5 - p_len[i]] = 0
        response_mask[i, : r_len[i]] = 1
    response_mask[2, 1] = 0
    weights = torch.randn(4, 6, generator=g)
    return prompt_ids, prompt_mask, responses, response_mask, weights


def _loss(logp, entropy, mask, weights):
    return ((logp * weights + 0.1 * entropy) * mask).sum() / mask.sum()


def _forward(model, rows, sp=None):
    prompt_ids, prompt_mask, responses, response_mask, weights = rows
    kw = {"temperature": 0.7, "with_entropy": True}
    if sp is None:
        logp, ent = response_logprobs(
            model, prompt_ids, prompt_mask, responses, response_mask, share_prompt=False, **kw
        )
    else:
        logp, ent = sequence_parallel_logprobs(
            model, prompt_ids, prompt_mask, responses, response_mask, sp, **kw
        )
    loss = _loss(logp, ent, response_mask, weights)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"logp": logp.detach() * response_mask, "entropy": ent.detach() * response_mask,
            "loss": float(loss.detach()), "grads": grads}  # fmt: skip


def _rank(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        sp = sequence_groups(rank, world, world)
        results = {}
        for name, kw in VARIANTS.items():
            r = _forward(_model(**kw), _rows(), sp)
            for g in r["grads"].values():  # the members' gradients add up (FSDP2 does it there)
                dist.all_reduce(g)
            results[name] = r
        r = _forward(_model(**VARIANTS["llama_gqa"]), _rows(full_prompts=True), sp)
        for g in r["grads"].values():
            dist.all_reduce(g)
        results[FULL_PROMPTS] = r
        if rank == 0:
            torch.save(results, out)
        dist.barrier()  # neither rank tears gloo down while its peer still talks
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes importing torch and transformers
def test_two_sequence_parallel_ranks_equal_one_process(tmp_path):
    out = tmp_path / "results.pt"
    mp.spawn(_rank, args=(2, str(tmp_path / "store"), str(out)), nprocs=2)
    got = torch.load(out, weights_only=False)
    cases = [(name, kw, False) for name, kw in VARIANTS.items()]
    for name, kw, full in [*cases, (FULL_PROMPTS, VARIANTS["llama_gqa"], True)]:
        want = _forward(_model(**kw), _rows(full_prompts=full))
        g = got[name]
        assert torch.allclose(g["logp"], want["logp"], rtol=1e-5, atol=1e-6), name
        assert torch.allclose(g["entropy"], want["entropy"], rtol=1e-5, atol=1e-6), name
        assert g["loss"] == pytest.approx(want["loss"], rel=1e-6), name
        assert g["grads"].keys() == want["grads"].keys()
        for k, v in want["grads"].items():
            assert v.abs().sum() > 0 or "embed" in k, (name, k)  # every layer gets a gradient
            assert torch.allclose(g["grads"][k], v, rtol=1e-4, atol=1e-6), (name, k)


def test_padded_length_is_the_next_multiple():
    assert [padded_length(n, 2) for n in (1, 2, 11)] == [2, 2, 12]
    assert [padded_length(n, 4) for n in (4, 5, 8)] == [4, 8, 8]


def test_query_heads_that_do_not_split_are_refused():
    from transformers import LlamaConfig

    config = LlamaConfig(num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    with pytest.raises(ValueError, match=r"sequence_parallel=4 must divide the model's 6 attention heads"):  # fmt: skip
        check_heads(config, 4)
    check_heads(config, 2)  # 6 query heads over 2 ranks: fine (K/V heads 2 split too)
    check_heads(config, 3)  # 2 K/V heads over 3 ranks: repeated, allowed


def test_sequence_groups_need_a_divisor_of_the_workers():
    with pytest.raises(ValueError, match="must divide the role's 6 workers"):
        sequence_groups(0, 6, 4)
    assert sequence_groups(0, 6, 1) is None
