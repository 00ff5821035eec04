"""Architectures that transform the LM head's output: training log-probs include the transform.

Per architecture, a tiny random model with a strong transform (so that leaving it out costs
tenths of a nat or more): the chunked training log-probs (one pass and shared prompt, with
entropy) equal ``log_softmax(model(...).logits / T)``; sampled log-probs equal the recomputed
ones, so with μ = 1 the first ratio the actor sees is 1; and the load-time check passes. A model
with a transform groupflow does not know is refused at load.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from groupflow.algorithms import entropy_from_logits
from groupflow.config import ActorConfig, ModelConfig
from groupflow.models.causal_lm import ModelLoadError, build_tiny_llama, decoder_hidden_states
from groupflow.models.logit_transform import (
    TRANSFORMED_MODEL_TYPES,
    check_logit_transform,
    logit_transform,
)
from groupflow.models.logprobs import response_logprobs
from groupflow.rollout.engines.batching import prompts_batch
from groupflow.rollout.engines.hf import SamplingParams, generate
from groupflow.workers.actor import ActorRolloutWorker

VOCAB, PAD, EOS = 40, 0, 1
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    pad_token_id=PAD, bos_token_id=2, eos_token_id=EOS,
)  # fmt: skip
# (config class, model class, the transform's settings): soft caps far below the logits' range
ARCHITECTURES = {
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"final_logit_softcapping": 2.0, "initializer_range": 0.2},
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"final_logit_softcapping": 2.0, "initializer_range": 0.2},
    ),
    "vaultgemma": (
        "VaultGemmaConfig",
        "VaultGemmaForCausalLM",
        {"final_logit_softcapping": 2.0, "initializer_range": 0.2},
    ),
    "nanochat": ("NanoChatConfig", "NanoChatForCausalLM", {"final_logit_softcapping": 0.1}),
    "beam": ("BeamConfig", "BeamForCausalLM", {"final_logit_softcapping": 0.1}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 8.0}),
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        {"logits_scaling": 8.0, "num_local_experts": 2, "num_experts_per_tok": 1},
    ),  # fmt: skip
    "hyperclovax": ("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", {"logits_scaling": 4.0}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 4.0}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {"logit_scale": 4.0}),
}


def tiny(model_type: str):
    config_name, model_name, transform = ARCHITECTURES[model_type]
    config = getattr(transformers, config_name)(**_COMMON, **transform)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    assert model.config.model_type == model_type
    return model


def batch(seed: int = 0):
    """Left-padded prompts (two rows share one), right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, VOCAB, (4, 5), generator=g)
    prompt_ids[1] = prompt_ids[0]
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[2, :2] = 0
    prompt_ids[2, :2] = PAD
    responses = torch.randint(3, VOCAB, (4, 6), generator=g)
    response_mask = (torch.arange(6)[None] < torch.tensor([6, 3, 4, 1])[:, None]).long()
    return prompt_ids, prompt_mask, responses * response_mask, response_mask


def model_logprobs(model, prompt_ids, prompt_mask, responses, response_mask, temperature):
    """log_softmax(model(...).logits / T) of the responses, and the entropy: the reference."""
    ids = torch.cat([prompt_ids, responses], dim=1)
    attention = torch.cat([prompt_mask, response_mask], dim=1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    p = prompt_ids.shape[1]
    logits = logits[:, p - 1 : -1].float() / temperature
    logp = logits.log_softmax(-1).gather(-1, responses[..., None])[..., 0]
    return logp, entropy_from_logits(logits)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_training_log_probs_are_those_of_the_model_logits(model_type):
    model, b = tiny(model_type), batch()
    mask = b[3].bool()
    assert model_type in TRANSFORMED_MODEL_TYPES and logit_transform(model) is not None
    with torch.no_grad():
        expected, expected_ent = model_logprobs(model, *b, temperature=0.7)
        for share in (True, False):
            logp, ent = response_logprobs(
                model, *b, temperature=0.7, with_entropy=True, share_prompt=share, chunk_tokens=8
            )
            torch.testing.assert_close(logp[mask], expected[mask], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ent[mask], expected_ent[mask], atol=1e-5, rtol=1e-5)
        # what the LM head alone gives: the gap this module closes (fails without the transform)
        hidden = decoder_hidden_states(model, torch.cat(b[:3:2], 1), torch.cat(b[1::2], 1))
        raw = model.get_output_embeddings()(hidden[:, 4:-1]).float() / 0.7
        raw = raw.log_softmax(-1).gather(-1, b[2][..., None])[..., 0]
        assert float((raw - expected)[mask].abs().max()) > 0.05
    check_logit_transform(model)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_training_log_probs_carry_the_transform_into_the_gradient(model_type):
    model, b = tiny(model_type).train(), batch()
    mask = b[3]
    logp, _ = response_logprobs(model, *b, temperature=1.0, chunk_tokens=8, share_prompt=False)
    (logp * mask).sum().backward()
    ours = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    expected, _ = model_logprobs(model, *b, temperature=1.0)
    (expected * mask).sum().backward()
    for a, e in zip(ours, [p.grad for p in model.parameters() if p.grad is not None]):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_sampled_log_probs_are_the_recomputed_ones(model_type):
    model = tiny(model_type)
    prompts = [[5, 9, 12, 7], [8, 3]]
    params = SamplingParams(temperature=0.8, max_new_tokens=6, n=2, static_kv_cache=False)
    out = generate(model, prompts, params, seeds=[1, 2, 3, 4], pad_id=PAD, eos_ids=[EOS])
    with torch.no_grad():
        logp, _ = response_logprobs(
            model, out.prompt_ids, out.prompt_mask, out.responses, out.response_mask,
            temperature=0.8,
        )  # fmt: skip
    mask = out.response_mask.bool()
    torch.testing.assert_close(logp[mask], out.logprobs[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", ["gemma2", "granite", "cohere"])
def test_the_first_ratio_of_an_on_policy_update_is_one(model_type):
    """μ = 1: the trainer uses the rollout's log-probs as old ones; the update's ratio is 1."""
    model = tiny(model_type)
    worker = ActorRolloutWorker(
        copy.deepcopy(model), None, ActorConfig(lr=1e-3), total_steps=1, pad_id=PAD, eos_ids=[EOS]
    )
    params = SamplingParams(temperature=0.9, max_new_tokens=6, n=4)
    rollout = worker.generate(prompts_batch([[5, 9, 12, 7], [8, 3]], [[1, 2, 3, 4], [5, 6, 7, 8]],
                                            [0, 1]), params)  # fmt: skip
    rollout["old_logprobs"] = rollout["rollout_logprobs"]
    rollout["advantages"] = torch.linspace(-1, 1, len(rollout))
    metrics = worker.update(rollout, temperature=0.9)
    assert metrics["actor/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["actor/ratio_min"] == pytest.approx(1.0, abs=1e-5)


# ----- models whose transform is unknown ---------------------------------------------------------


class _ScaledLlama(transformers.LlamaForCausalLM):
    """A model whose forward rescales its logits after the LM head, as custom code might."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 3.0
        return out


def test_a_model_with_an_unknown_transform_is_refused():
    plain = build_tiny_llama(VOCAB, hidden_size=16, num_layers=1, num_heads=2)
    check_logit_transform(plain)  # Llama: logits are the LM head's output
    model = _ScaledLlama(plain.config)
    with pytest.raises(ModelLoadError) as err:
        check_logit_transform(model)
    msg = str(err.value)
    assert "_ScaledLlama (model_type 'llama')" in msg and "max difference" in msg
    assert "granite" in msg and "groupflow/models/logit_transform.py" in msg


def test_loading_refuses_a_model_with_an_unknown_transform(monkeypatch, tmp_path):
    from groupflow.assembly import models

    plain = build_tiny_llama(VOCAB, hidden_size=16, num_layers=1, num_heads=2)
    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: _ScaledLlama(plain.config))
    with pytest.raises(ModelLoadError, match="_ScaledLlama"):
        models.build_model(ModelConfig(path=str(tmp_path)), None, seed=0)
