import pytest
import torch
from torch import nn

from groupflow.models.causal_lm import build_tiny_llama
from groupflow.models.logprobs import response_logprobs
from groupflow.rollout.engines.hf import SamplingParams, generate, left_pad

PAD, EOS = 0, 2


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_tiny_llama(
        24, hidden_size=32, num_layers=2, num_heads=4, seed=3, pad_token_id=PAD, eos_token_id=EOS
    )
    return m.eval()


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


def run(model, prompts, params, seeds):
    return generate(model, prompts, params, seeds=seeds, pad_id=PAD, eos_ids=[EOS])


def unpadded(out, i):
    n = int(out.response_mask[i].sum())
    return out.responses[i, :n], out.logprobs[i, :n]


def test_batched_equals_unbatched_with_same_seeds(model):
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=2)
    seeds = list(range(100, 106))
    batched = run(model, PROMPTS, params, seeds)
    for p, prompt in enumerate(PROMPTS):
        single = run(model, [prompt], params, seeds[2 * p : 2 * p + 2])
        for j in range(2):
            tb, lb = unpadded(batched, 2 * p + j)
            ts, ls = unpadded(single, j)
            assert torch.equal(tb, ts)
            torch.testing.assert_close(lb, ls, atol=1e-5, rtol=0)


def test_shared_prefill_equals_repeated_prompts(model):
    seeds = [7, 8, 9, 10]
    shared = run(model, [PROMPTS[0]], SamplingParams(max_new_tokens=10, n=4), seeds)
    repeated = run(model, [PROMPTS[0]] * 4, SamplingParams(max_new_tokens=10, n=1), seeds)
    assert torch.equal(shared.responses, repeated.responses)
    torch.testing.assert_close(shared.logprobs, repeated.logprobs, atol=1e-5, rtol=0)


def test_different_seeds_differ_and_same_seed_repeats(model):
    params = SamplingParams(max_new_tokens=10, n=1)
    a = run(model, [PROMPTS[0]], params, [1])
    b = run(model, [PROMPTS[0]], params, [1])
    c = run(model, [PROMPTS[0]], params, [2])
    assert torch.equal(a.responses, b.responses)
    assert not torch.equal(a.responses, c.responses)


def test_rollout_logprobs_match_training_forward(model):
    params = SamplingParams(temperature=0.7, top_k=10, max_new_tokens=12, n=3)
    out = run(model, PROMPTS, params, list(range(9)))
    logp, _ = response_logprobs(
        model,
        out.prompt_ids,
        out.prompt_mask,
        out.responses,
        out.response_mask,
        temperature=0.7,
        chunk_tokens=7,
    )
    mask = out.response_mask.bool()
    assert mask.sum() > 10
    torch.testing.assert_close(logp[mask], out.logprobs[mask], atol=1e-5, rtol=0)
    assert (out.logprobs[~mask] == 0).all()


def test_eos_ends_sample_and_is_kept_in_mask():
    m = build_tiny_llama(
        24, hidden_size=32, num_layers=2, num_heads=4, seed=4, tie_embeddings=False
    ).eval()
    head = torch.nn.Linear(32, 24, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[EOS] = 100.0  # EOS is (almost surely) sampled first
    m.lm_head = head
    out = run(
        m, [PROMPTS[1], PROMPTS[0]], SamplingParams(temperature=1.0, max_new_tokens=6, n=1), [0, 1]
    )
    assert out.responses.shape == (2, 1)  # the loop stops once every sample ended
    assert out.responses[:, 0].tolist() == [EOS, EOS]
    assert out.response_mask.tolist() == [[1], [1]] and out.finish_reasons == ["stop", "stop"]
    free = run(model_without_eos(), [PROMPTS[1]], SamplingParams(max_new_tokens=6, n=1), [0])
    assert free.finish_reasons == ["length"] and free.response_mask.sum() == 6


def model_without_eos():
    m = build_tiny_llama(
        24, hidden_size=32, num_layers=2, num_heads=4, seed=4, tie_embeddings=False
    ).eval()
    head = torch.nn.Linear(32, 24, bias=True)
    with torch.no_grad():
        head.bias[EOS] = -1e4
    m.lm_head = head
    return m


def test_greedy_is_deterministic_across_seeds(model):
    params = SamplingParams(temperature=0, max_new_tokens=8, n=2)
    out = run(model, [PROMPTS[2]], params, [1, 2])
    assert torch.equal(out.responses[0], out.responses[1])


def test_stop_strings():
    from groupflow.data.tokenizer import train_char_tokenizer

    tok = train_char_tokenizer()
    m = build_tiny_llama(len(tok), hidden_size=32, num_layers=2, num_heads=4, seed=5).eval()
    ids = tok("reverse 12 =", add_special_tokens=False)["input_ids"]
    free = generate(
        m,
        [ids],
        SamplingParams(max_new_tokens=20, n=4),
        seeds=[1, 2, 3, 4],
        pad_id=tok.pad_token_id,
        eos_ids=[tok.eos_token_id],
        tokenizer=tok,
    )
    texts = [tok.decode(r[m_.bool()]) for r, m_ in zip(free.responses, free.response_mask)]
    # pick a character that occurs in some completion and stop on it
    ch = next(c for t in texts for c in t if c.strip())
    stopped = generate(
        m,
        [ids],
        SamplingParams(max_new_tokens=20, n=4, stop=(ch,)),
        seeds=[1, 2, 3, 4],
        pad_id=tok.pad_token_id,
        eos_ids=[tok.eos_token_id],
        tokenizer=tok,
    )
    for i in range(4):
        text = tok.decode(stopped.responses[i][stopped.response_mask[i].bool()])
        if ch in texts[i]:
            assert text.endswith(ch) and text.count(ch) == 1 and stopped.finish_reasons[i] == "stop"


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="one seed per output sample"):
        run(model, PROMPTS, SamplingParams(n=2), [1, 2])
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        left_pad([[1], []], PAD)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        run(model, PROMPTS[:1], SamplingParams(stop=("x",)), [1])


# ----- the sampler ---------------------------------------------------------------------------------


def _frequencies(logits: torch.Tensor, params, rows: int) -> torch.Tensor:
    from groupflow.rollout.engines.hf import _sample

    generators = [torch.Generator().manual_seed(1000 + i) for i in range(rows)]
    tokens, _ = _sample(logits.expand(rows, -1), params, generators)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / rows


def test_sampled_tokens_follow_the_temperature_scaled_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -3.0]])
    params = SamplingParams(temperature=0.8)
    freq = _frequencies(logits, params, rows=20000)
    expected = (logits[0] / 0.8).softmax(-1).double()
    # 20000 draws: standard error <= 0.0036 per token; 5 sigma
    assert torch.allclose(freq, expected, atol=0.018), (freq, expected)
    assert freq[5] > 0  # a rare (0.2%) token is reachable


def test_filtered_tokens_are_never_sampled_and_kept_ones_renormalise():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -3.0]])
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_k=2), rows=20000)
    assert freq[[2, 3, 4, 5]].sum() == 0
    kept = logits[0, :2].softmax(-1).double()
    assert torch.allclose(freq[:2], kept, atol=0.018)


def test_a_sample_draws_one_uniform_per_token_from_its_own_generator():
    """The k-th token of a sample depends on its seed's k-th uniform only: the same seed in
    another row, batch or batch size gives the same token for the same logits."""
    from groupflow.rollout.engines.hf import _sample

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0)
    alone, _ = _sample(logits, params, [torch.Generator().manual_seed(7)])
    gens = [torch.Generator().manual_seed(s) for s in (3, 7, 9)]
    batch, _ = _sample(logits.expand(3, -1), params, gens)
    assert batch[1] == alone[0]
    u = torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    cdf = logits.softmax(-1).double().cumsum(-1)[0]
    assert int(alone[0]) == int((cdf <= u * cdf[-1]).sum())  # first index with cdf > u·total


def test_large_vocabularies_are_searched_by_blocks_with_the_same_distribution():
    """Above 16 × 256 entries the CDF is searched block by block: the kept tokens (spread over
    many blocks, padding at the end) still get their probabilities, the others none."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 10_001, generator=g)
    logits[0, -1] = 6.0  # the very last entry (in the partly padded last block) is likely
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_k=6), rows=20000)
    kept = logits[0].topk(6).indices
    others = torch.ones(freq.shape[0], dtype=torch.bool)
    others[kept] = False
    assert int((freq[others] > 0).sum()) == 0
    assert torch.allclose(freq[kept], logits[0, kept].softmax(-1).double(), atol=0.018)
    assert freq[-1] > 0.5


def test_sampling_log_probs_are_the_temperature_scaled_log_softmax():
    from groupflow.rollout.engines.hf import _sample

    logits = torch.randn(5, 9000, generator=torch.Generator().manual_seed(2)) * 3
    gens = [torch.Generator().manual_seed(i) for i in range(5)]
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_p=0.9)):
        tokens, logp = _sample(logits, params, gens)
        ref = (logits / params.temperature).log_softmax(-1).gather(-1, tokens[:, None])
        torch.testing.assert_close(logp, ref.squeeze(-1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("vocab", [8192, 8193])  # a whole number of 256-blocks, and one over
def test_the_block_search_picks_the_inverse_cdf_token_with_and_without_padding(vocab):
    """Every row's token is the first index whose cumulative probability exceeds u × total, for
    a vocabulary that fills its blocks exactly (no padded copy is made) and one that does not."""
    from groupflow.rollout.engines.hf import _sample

    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * 2
    gens = [torch.Generator().manual_seed(s) for s in range(6)]
    tokens, _ = _sample(logits, SamplingParams(temperature=1.0), gens)
    for row in range(6):
        u = torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(row))
        cdf = logits[row].softmax(-1).double().cumsum(-1)
        assert int(tokens[row]) == int((cdf <= u * cdf[-1]).sum())


def check_switch_at_token_3(out, alone, calls: list) -> None:
    """Version 6 sampled tokens 0-2 (the very tokens ``alone``, the old weights, sample), version
    7 the rest (-1 where masked); one ``between``/``updates`` call per token position (also used
    by tests/rollout/engines/test_vllm.py)."""
    mask = out.response_mask.bool()
    assert mask[:, 3:].sum() > 10  # enough tokens after the switch to check
    assert torch.equal(out.responses[:, :3], alone.responses[:, :3])
    assert not torch.equal(out.responses, alone.responses)  # the new weights sampled the rest
    per_step = torch.tensor([6, 6, 6] + [7] * (out.responses.shape[1] - 3))
    assert torch.equal(out.token_versions, torch.where(mask, per_step, -1))
    assert len(calls) == out.responses.shape[1]


@pytest.mark.parametrize("static_kv_cache", [True, False])
def test_in_flight_weights_switch_between_decode_steps_and_each_token_records_its_version(
    model, static_kv_cache
):
    """A new version arrives before the forward of token 3 (rollout.async_mode=in_flight). It
    differs from the old one in the final norm only, which no key or value passes through, so
    the KV cache kept from the old weights is the new version's own as well and the exact
    reference is the teacher-forced log-probs: tokens 0-2 are the old model's (the very tokens
    it samples alone, with its log-probs), tokens 3 on have the new model's log-probs, and
    token_versions says which version gave each (-1 where masked)."""
    import copy

    old, new, decoding = model, copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        new.model.norm.weight.mul_(torch.linspace(0.2, 3.0, new.model.norm.weight.numel()))
    calls = []

    def between() -> int:
        calls.append(len(calls))
        if len(calls) == 4:  # before the forward of token 3: load in place, as the engine does
            decoding.load_state_dict(new.state_dict())
        return 6 if len(calls) < 4 else 7

    params = SamplingParams(max_new_tokens=10, n=2, static_kv_cache=static_kv_cache)
    seeds = list(range(40, 46))
    out = generate(decoding, PROMPTS, params, seeds=seeds, pad_id=PAD, eos_ids=[EOS],
                   between=between)  # fmt: skip
    alone = run(old, PROMPTS, params, seeds)
    check_switch_at_token_3(out, alone, calls)  # the prefill's call and one per decode step
    check_logprobs_switch_at_token_3(out, old, new)
    assert run(old, PROMPTS, params, seeds).token_versions is None  # only with in-flight updates


def check_logprobs_switch_at_token_3(out, old, new, atol: float = 1e-5) -> None:
    """Tokens 0-2 have ``old``'s teacher-forced log-probs, the later ones ``new``'s, which the
    check tells apart (also used by tests/workers/test_inference.py)."""
    mask = out.response_mask.bool()
    args = (out.prompt_ids, out.prompt_mask, out.responses, out.response_mask)
    with torch.no_grad():
        by_old, by_new = response_logprobs(old, *args)[0], response_logprobs(new, *args)[0]
    before, after = mask.clone(), mask.clone()
    before[:, 3:], after[:, :3] = False, False
    torch.testing.assert_close(out.logprobs[before], by_old[before], atol=atol, rtol=0)
    torch.testing.assert_close(out.logprobs[after], by_new[after], atol=atol, rtol=0)
    assert (out.logprobs[after] - by_old[after]).abs().max() > 1e-2  # the check can tell them apart


def test_in_flight_updates_refuse_lockstep(model):
    with pytest.raises(
        ValueError, match="in-flight weight updates .* do not combine with lockstep"
    ):
        generate(model, PROMPTS, SamplingParams(max_new_tokens=2), seeds=[0, 1, 2], pad_id=PAD,
                 eos_ids=[EOS], lockstep=lambda flag, how: flag, between=lambda: 0)  # fmt: skip


def test_a_prefill_that_returns_no_kv_cache_is_an_error_naming_the_model(model):
    """A forward that answers use_cache=True without a cache cannot be decoded incrementally."""
    from types import SimpleNamespace

    class NoCache(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            out = self.inner(**kwargs)
            return SimpleNamespace(logits=out.logits)

    with pytest.raises(RuntimeError, match="NoCache returned no KV cache from its prefill"):
        generate(NoCache(model), PROMPTS, SamplingParams(max_new_tokens=2), seeds=[0, 1, 2],
                 pad_id=PAD, eos_ids=[EOS])  # fmt: skip
