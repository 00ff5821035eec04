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

from groupflow.models.causal_lm import build_tiny_llama
from groupflow.rollout.hf import SamplingParams, generate
from groupflow.rollout.static_cache import StaticDecoder, unsupported_reason

VOCAB, PAD, EOS = 20, 0, 1
PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]]


def _hf_model(kind: str):
    import transformers

    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=PAD, eos_token_id=EOS,
    )  # fmt: skip
    configs = {
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


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
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
