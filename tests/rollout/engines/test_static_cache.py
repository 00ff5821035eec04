"""The static-KV-cache decode gives the HF forward's tokens and log-probs, per architecture.

Tiny random models of every supported type (Llama; Mistral and Qwen2 with grouped-query
attention, Qwen2 with q/k/v biases; Qwen3 with its q/k norms), left-padded prompts of different
lengths, several samples per prompt and an EOS id, so padding masks, the shared prefill and early
stops are all exercised. Unsupported models fall back to HF's forward.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from groupflow.models.causal_lm import build_tiny_llama, token_positions
from groupflow.rollout.engines.hf import SamplingParams, generate
from groupflow.rollout.engines.kernels import onednn_linear_available
from groupflow.rollout.engines.static_cache import (
    StaticDecoder,
    _sdpa,
    grouped_attention,
    unsupported_reason,
)

VOCAB, PAD, EOS = 20, 0, 1
PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]]


@pytest.fixture(autouse=True)
def _heads_take_the_fast_kernel(monkeypatch):
    """The tiny models' heads are below the size at which the decode picks oneDNN for the LM
    head; drop the threshold so every static-decode test here runs that path too."""
    from groupflow.rollout.engines import kernels

    monkeypatch.setattr(kernels, "MIN_HEAD_ELEMENTS", 0)


def _hf_model(kind: str):
    import transformers

    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=PAD, eos_token_id=EOS,
    )  # fmt: skip
    configs = {
        # SmolLM2's grouping: 9 query heads on 3 key/value heads
        "llama-gqa": lambda: transformers.LlamaConfig(
            **{**common, "hidden_size": 72, "num_attention_heads": 9, "num_key_value_heads": 3}
        ),
        "mistral": lambda: transformers.MistralConfig(**common, sliding_window=None),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=8),
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(configs[kind]())
    return model.eval()


def _model(kind: str):
    if kind == "llama":
        return build_tiny_llama(
            VOCAB, hidden_size=32, num_layers=2, num_heads=4, pad_token_id=PAD, seed=0
        ).eval()
    return _hf_model(kind)


def _both(model, params: SamplingParams, prompts=PROMPTS):
    seeds = list(range(len(prompts) * params.n))
    kw = dict(seeds=seeds, pad_id=PAD, eos_ids=[EOS])
    dynamic = generate(model, prompts, dataclasses.replace(params, static_kv_cache=False), **kw)
    static = generate(model, prompts, dataclasses.replace(params, static_kv_cache=True), **kw)
    return dynamic, static


@pytest.mark.parametrize("kind", ["llama", "llama-gqa", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, max_new_tokens=12, n=3),
        SamplingParams(temperature=0.0, max_new_tokens=8, n=1),
        SamplingParams(temperature=1.2, top_k=5, top_p=0.9, max_new_tokens=10, n=2),
    ],
)
def test_static_cache_decode_matches_the_hf_forward(kind, params):
    model = _model(kind)
    assert unsupported_reason(model, 64) is None
    dynamic, static = _both(model, params)
    assert torch.equal(static.responses, dynamic.responses)
    assert torch.equal(static.response_mask, dynamic.response_mask)
    torch.testing.assert_close(static.logprobs, dynamic.logprobs, rtol=0, atol=1e-5)
    assert static.finish_reasons == dynamic.finish_reasons


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_static_cache_decode_matches_the_hf_forward_on_cuda(kind):
    """The same comparison on a CUDA device in fp32 (no oneDNN head there: the module's own)."""
    model = _model(kind).to("cuda")
    dynamic, static = _both(model, SamplingParams(temperature=0.8, max_new_tokens=12, n=3))
    assert torch.equal(static.responses.cpu(), dynamic.responses.cpu())
    assert torch.equal(static.response_mask.cpu(), dynamic.response_mask.cpu())
    torch.testing.assert_close(static.logprobs.cpu(), dynamic.logprobs.cpu(), rtol=0, atol=1e-4)


def test_the_comparison_sees_early_stops_and_padding():
    """Guard against a vacuous comparison: some samples stop at EOS, prompts are padded."""
    model = _model("llama")
    with torch.no_grad():  # make EOS likely so some samples stop early
        model.lm_head.weight[EOS] += 0.3 * model.lm_head.weight.abs().max()
    dynamic, static = _both(model, SamplingParams(temperature=1.0, max_new_tokens=12, n=4))
    assert "stop" in static.finish_reasons and "length" in static.finish_reasons
    assert bool((static.prompt_mask == 0).any())
    assert torch.equal(static.responses, dynamic.responses)
    torch.testing.assert_close(static.logprobs, dynamic.logprobs, rtol=0, atol=1e-5)


def test_the_static_path_is_actually_taken(monkeypatch):
    steps = []
    real = StaticDecoder.step

    def counting(self, *args):
        steps.append(1)
        return real(self, *args)

    monkeypatch.setattr(StaticDecoder, "step", counting)
    _both(_model("llama"), SamplingParams(temperature=0.0, max_new_tokens=5, n=2))
    assert len(steps) == 4  # tokens 2..5 of the static run; the dynamic run never calls it


def test_unsupported_models_fall_back_to_the_hf_forward():
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, eos_token_id=EOS
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        gpt2 = transformers.GPT2LMHeadModel(config).eval()
    assert "gpt2" in unsupported_reason(gpt2, 32)
    dynamic, static = _both(gpt2, SamplingParams(temperature=0.9, max_new_tokens=6, n=2))
    assert torch.equal(static.responses, dynamic.responses)
    assert torch.equal(static.logprobs, dynamic.logprobs)


def test_a_sliding_window_shorter_than_the_sequence_is_not_driven_statically():
    import transformers

    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, sliding_window=8,
    )  # fmt: skip
    model = transformers.MistralForCausalLM(config)
    assert "sliding" in unsupported_reason(model, 16)
    assert unsupported_reason(model, 7) is None


def test_rollout_static_kv_cache_is_a_config_switch():
    from pydantic import ValidationError

    from groupflow.config import RolloutConfig

    assert RolloutConfig().static_kv_cache is True
    assert RolloutConfig(static_kv_cache=False).static_kv_cache is False
    with pytest.raises(ValidationError, match="static_kv_cache"):
        RolloutConfig(static_kv_cache="maybe")


def _eager_attention(q, keys, values, key_pad, scale):
    """HF's eager attention with ``repeat_kv``: every query head gets its own copy of its keys."""
    groups = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(groups, dim=1)
    v = values.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if key_pad is not None:
        scores = scores.masked_fill(key_pad, float("-inf"))
    out = scores.softmax(-1) @ v  # [B, Hq, 1, D]
    return out.transpose(1, 2).reshape(q.shape[0], -1)


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("padded", [False, True])
def test_grouped_attention_is_eager_attention_with_repeated_key_value_heads(
    q_heads, kv_heads, padded
):
    g = torch.Generator().manual_seed(0)
    rows, length, dim = 5, 11, 8
    q = torch.randn(rows, q_heads, 1, dim, generator=g)
    keys = torch.randn(rows, kv_heads, length, dim, generator=g)
    values = torch.randn(rows, kv_heads, length, dim, generator=g)
    key_pad = None
    if padded:  # left padding of 0..4 columns per row
        key_pad = (torch.arange(length)[None, :] < torch.arange(rows)[:, None])[:, None, None]
    ours = grouped_attention(q, keys, values, key_pad, dim**-0.5)
    torch.testing.assert_close(ours, _eager_attention(q, keys, values, key_pad, dim**-0.5))
    # the SDPA form other devices use computes the same
    torch.testing.assert_close(_sdpa(q, keys, values, key_pad, dim**-0.5), ours)
    if padded:  # a padded key changes nothing, whatever it holds
        keys2 = keys.masked_fill(key_pad.transpose(-1, -2), 1e4)
        torch.testing.assert_close(grouped_attention(q, keys2, values, key_pad, dim**-0.5), ours)


def _decoder(model, prompt_mask, n=2, new=4):
    prompt_ids = torch.full(prompt_mask.shape, 3) * prompt_mask
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, use_cache=True)
    from groupflow.models.causal_lm import output_cache

    return StaticDecoder.build(model, output_cache(out), prompt_mask, n, new)


@pytest.mark.skipif(not onednn_linear_available(), reason="no oneDNN linear in this build")
def test_the_decoder_runs_the_head_on_the_faster_kernel():
    model = _model("llama")
    with torch.inference_mode():
        decoder = _decoder(model, torch.ones(2, 3, dtype=torch.long))
    assert decoder.head is not model.lm_head


def test_a_hooked_head_is_called_as_a_module_and_its_hook_counts():
    """A forward hook on the head (here one that reshapes the distribution) must run in the
    static decode too: the kernel path would bypass it, so the module is called."""
    model = _model("qwen2")
    model.lm_head.register_forward_hook(lambda module, args, out: out * 3.0)
    with torch.inference_mode():
        decoder = _decoder(model, torch.ones(2, 3, dtype=torch.long))
    assert decoder.head is model.lm_head
    dynamic, static = _both(model, SamplingParams(temperature=1.0, max_new_tokens=8, n=2))
    assert torch.equal(static.responses, dynamic.responses)
    torch.testing.assert_close(static.logprobs, dynamic.logprobs, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_smollm2_static_decode_matches_the_hf_forward_and_the_training_log_probs(
    smollm2_path, smollm2_tokenizer
):
    """The real SmolLM2-135M-Instruct (9/3 heads, 49k vocabulary, tied head): greedy tokens are
    HF's; sampled log-probs are log_softmax of the model's own logits over the whole sequence."""
    from groupflow.models.causal_lm import load_causal_lm

    model = load_causal_lm(smollm2_path).eval()
    tok = smollm2_tokenizer
    messages = ["What is 47 + 38?", "Write one sentence about the sea."]
    prompts = []
    for m in messages:
        ids = tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    kw = dict(seeds=list(range(4)), pad_id=pad, eos_ids=[])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, n=2)
    dynamic = generate(model, prompts, dataclasses.replace(greedy, static_kv_cache=False), **kw)
    static = generate(model, prompts, greedy, **kw)
    assert torch.equal(static.responses, dynamic.responses)
    torch.testing.assert_close(static.logprobs, dynamic.logprobs, rtol=0, atol=1e-4)

    sampled = generate(
        model, prompts, SamplingParams(temperature=1.0, max_new_tokens=12, n=2), **kw
    )
    ids = torch.cat([sampled.prompt_ids, sampled.responses], dim=1)
    mask = torch.cat([sampled.prompt_mask, sampled.response_mask], dim=1)
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=token_positions(mask)
        ).logits
    p = sampled.prompt_ids.shape[1]
    expected = logits[:, p - 1 : -1].log_softmax(-1).gather(-1, sampled.responses[..., None])
    torch.testing.assert_close(sampled.logprobs, expected.squeeze(-1), rtol=0, atol=1e-4)
