"""The vLLM engine against the HF engine and the training forward (runs in .venv-vllm only).

One engine serves the whole module (starting vLLM costs seconds), built for in-flight weight
updates (on CPU that changes nothing for the other tests: vLLM schedules synchronously here
anyway); the tests that update its weights restore them at the end. The model is a tiny Llama with head dim 64 (hidden 128, 2 heads):
vLLM's CPU attention rejects the demo's head dim 16.
"""

import copy
import dataclasses
import os

import pytest
import torch

from groupflow.rollout.engines.vllm_engine import vllm_available

pytestmark = pytest.mark.skipif(
    not vllm_available(),
    reason="vLLM is not installed here; these tests run in .venv-vllm (bash scripts/setup_vllm.sh, "
    "then .venv-vllm/bin/python -m pytest tests/rollout/engines/test_vllm.py)",
)

# Before vllm is first imported (the engine sets the same defaults).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from groupflow.data import train_char_tokenizer  # noqa: E402
from groupflow.models.causal_lm import build_tiny_llama  # noqa: E402
from groupflow.models.logprobs import response_logprobs  # noqa: E402
from groupflow.rollout.engines.hf import SamplingParams, generate  # noqa: E402
from tests.rollout.engines.test_hf import check_switch_at_token_3  # noqa: E402

PROMPT_TEXTS = ["12345=", "907=", "4411235=", "8="]


@pytest.fixture(scope="module")
def setup():
    from groupflow.rollout.engines.vllm_engine import VLLMEngine, VLLMOptions

    torch.set_num_threads(1)
    tok = train_char_tokenizer("0123456789=+")
    model = build_tiny_llama(
        len(tok), hidden_size=128, num_layers=2, num_heads=2, max_positions=64, seed=5,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    ).eval()  # fmt: skip
    _sharpen(model, seed=0)
    engine = VLLMEngine(
        model, tok, VLLMOptions(dtype="float32", seed=0, in_flight=True), eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
    )  # fmt: skip
    prompts = [tok(t)["input_ids"] for t in PROMPT_TEXTS]
    return model, tok, engine, prompts


def _sharpen(model, seed):
    """Random weights large enough that the next-token distributions are far from uniform (a
    freshly initialised model's logits differ by ~1e-3: greedy ties would test rounding)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.15 if "embed" in name else 0.08))


def _hf(model, tok, prompts, params, seeds):
    return generate(
        model, prompts, params, seeds=seeds, pad_id=tok.pad_token_id,
        eos_ids=[tok.eos_token_id], tokenizer=tok,
    )  # fmt: skip


def _train_logprobs(model, out, temperature):
    with torch.no_grad():
        lp, _ = response_logprobs(
            model, out.prompt_ids, out.prompt_mask, out.responses, out.response_mask,
            temperature=temperature,
        )  # fmt: skip
    return lp * out.response_mask


def _same_outputs(a, b):
    assert torch.equal(a.prompt_ids, b.prompt_ids)
    assert torch.equal(a.prompt_mask, b.prompt_mask)
    width = max(a.responses.shape[1], b.responses.shape[1])
    pad = a.responses.new_zeros(())

    def widen(t, fill):
        return torch.cat([t, t.new_full((t.shape[0], width - t.shape[1]), fill)], dim=1)

    assert torch.equal(widen(a.response_mask, 0), widen(b.response_mask, 0))
    ra = widen(a.responses, int(pad)) * widen(a.response_mask, 0)
    rb = widen(b.responses, int(pad)) * widen(b.response_mask, 0)
    assert torch.equal(ra, rb)
    assert a.finish_reasons == b.finish_reasons


def test_greedy_tokens_equal_the_hf_engine(setup):
    model, tok, engine, prompts = setup
    params = SamplingParams(temperature=0.0, max_new_tokens=20, n=2)
    seeds = list(range(len(prompts) * 2))
    v = engine.generate(prompts, params, seeds=seeds)
    h = _hf(model, tok, prompts, params, seeds)
    _same_outputs(v, h)
    assert v.response_mask.sum() > len(prompts) * 2  # more than one token per sample


def test_logprobs_match_the_training_forward_in_fp32(setup):
    model, tok, engine, prompts = setup
    for temperature in (1.0, 0.7):
        params = SamplingParams(temperature=temperature, max_new_tokens=16, n=3)
        out = engine.generate(prompts, params, seeds=list(range(100, 112)))
        train = _train_logprobs(model, out, temperature)
        diff = ((out.logprobs - train).abs() * out.response_mask).max().item()
        print(f"T={temperature}: max |vLLM - training forward| log-prob = {diff:.2e}")
        assert diff < 1e-3
        assert bool((out.logprobs[out.response_mask.bool()] < 0).all())


def test_one_seed_per_sample(setup):
    _, _, engine, prompts = setup
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=2)
    a = engine.generate(prompts[:2], params, seeds=[1, 2, 3, 4])
    b = engine.generate(prompts[:2], params, seeds=[1, 2, 3, 4])
    assert torch.equal(a.responses, b.responses)
    # sample 1 of prompt 0 alone, with its seed, repeats its tokens
    single = engine.generate(
        prompts[:1], SamplingParams(temperature=1.0, max_new_tokens=12), seeds=[2]
    )
    n = int(single.response_mask.sum())
    assert torch.equal(single.responses[0, :n], a.responses[1, :n])
    # the samples of one prompt differ (their seeds do)
    assert not torch.equal(a.responses[0], a.responses[1])


def test_stop_strings_and_length_limits_match_the_hf_engine(setup):
    model, tok, engine, prompts = setup
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
    ref = _hf(model, tok, prompts, greedy, seeds=[0] * len(prompts))
    # a stop string that the greedy continuation of the first prompt contains
    text = tok.decode(ref.responses[0, : int(ref.response_mask[0].sum())], skip_special_tokens=True)
    assert len(text) >= 3, text
    params = SamplingParams(temperature=0.0, max_new_tokens=20, stop=(text[1:3],))
    seeds = [0] * len(prompts)
    v = engine.generate(prompts, params, seeds=seeds)
    h = _hf(model, tok, prompts, params, seeds)
    _same_outputs(v, h)
    assert v.finish_reasons[0] == "stop"
    short = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=2), seeds=seeds)
    assert short.responses.shape[1] <= 2
    assert all(
        r == ("length" if int(m.sum()) == 2 and tok.eos_token_id not in s.tolist() else "stop")
        for r, m, s in zip(short.finish_reasons, short.response_mask, short.responses)
    )


def test_top_k_top_p_min_p_keep_samples_inside_the_filtered_set(setup):
    model, tok, engine, prompts = setup
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.9, min_p=0.05, max_new_tokens=8, n=4)
    out = engine.generate(prompts, params, seeds=list(range(16)))
    # with top_k=2, every sampled token is one of the two most likely under the training forward
    ids = torch.cat([out.prompt_ids, out.responses], dim=1)
    mask = torch.cat([out.prompt_mask, out.response_mask], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    p = out.prompt_ids.shape[1]
    top2 = logits[:, p - 1 : -1].topk(2, dim=-1).indices
    hit = (top2 == out.responses[..., None]).any(-1)
    assert bool(hit[out.response_mask.bool()].all())


def test_weight_update_reaches_the_engine(setup):
    model, tok, engine, prompts = setup
    params = SamplingParams(temperature=0.0, max_new_tokens=16, n=1)
    seeds = [0] * len(prompts)
    before = engine.generate(prompts, params, seeds=seeds)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        _sharpen(model, seed=1)  # "the update": new weights everywhere
        seconds = engine.load_weights(model.state_dict().items())
        assert seconds > 0
        after = engine.generate(prompts, params, seeds=seeds)
        _same_outputs(after, _hf(model, tok, prompts, params, seeds))
        assert not torch.equal(before.responses, after.responses)
        sampled = engine.generate(
            prompts, SamplingParams(max_new_tokens=12, n=2), seeds=list(range(8))
        )
        diff = ((sampled.logprobs - _train_logprobs(model, sampled, 1.0)).abs()).max().item()
        assert diff < 1e-3
    finally:
        model.load_state_dict(original)
        engine.load_weights(model.state_dict().items())
    again = engine.generate(prompts, params, seeds=seeds)
    _same_outputs(again, before)


def test_bad_input_is_rejected(setup):
    _, _, engine, prompts = setup
    with pytest.raises(ValueError, match="one seed per output sample"):
        engine.generate(prompts, SamplingParams(n=2), seeds=[1])
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        engine.generate([[5], []], SamplingParams(), seeds=[1, 2])


def test_in_flight_weights_switch_between_engine_steps_and_each_token_records_its_version(
    setup, monkeypatch
):
    """rollout.async_mode=in_flight on vLLM: a new version arrives before the engine step that
    samples token 3 (step 1 prefills and samples token 0). It differs from the old one in the
    final norm only, which no key or value passes through, so the KV blocks kept from the old
    weights are the new version's own as well and the exact reference is the teacher-forced
    log-probs: tokens 0-2 are the old model's (the very tokens it samples alone), tokens 3 on
    have the new model's log-probs, token_versions says which version gave each (-1 where
    masked), and the prefix cache is reset once the call is over."""
    model, tok, engine, prompts = setup
    new = copy.deepcopy(model)
    with torch.no_grad():
        new.model.norm.weight.mul_(torch.linspace(0.2, 3.0, new.model.norm.weight.numel()))
    params = SamplingParams(max_new_tokens=10, n=2)
    seeds = list(range(40, 48))
    alone = engine.generate(prompts, params, seeds=seeds)
    assert alone.token_versions is None  # only with in-flight updates
    calls, resets = [], []
    reset = engine.llm.reset_prefix_cache

    def spy(*args, **kwargs):
        resets.append(len(calls))
        return reset(*args, **kwargs)

    def updates():
        calls.append(len(calls))
        if len(calls) == 4:
            return 7, new.state_dict()
        return (6 if len(calls) < 4 else 7), None

    monkeypatch.setattr(engine.llm, "reset_prefix_cache", spy)
    engine.updates = updates
    try:
        out = engine.generate(prompts, params, seeds=seeds)
        assert engine.version == 7
    finally:
        engine.updates = None
        engine.load_weights(model.state_dict().items())
    check_switch_at_token_3(out, alone, calls)  # one updates call per engine step: one token each
    mask = out.response_mask.bool()
    assert resets[0] == len(calls)  # after the last step (then load_weights' own reset)
    by_old, by_new = _train_logprobs(model, out, 1.0), _train_logprobs(new, out, 1.0)
    before, after = mask.clone(), mask.clone()
    before[:, 3:], after[:, :3] = False, False
    assert (out.logprobs[before] - by_old[before]).abs().max() < 1e-3
    assert (out.logprobs[after] - by_new[after]).abs().max() < 1e-3
    assert (out.logprobs[after] - by_old[after]).abs().max() > 1e-2  # the check tells them apart
    _same_outputs(engine.generate(prompts, params, seeds=seeds), alone)  # the old weights again


def test_in_flight_updates_need_an_engine_built_for_them(setup):
    _, _, engine, prompts = setup
    options = engine.options
    engine.options, engine.updates = (
        dataclasses.replace(options, in_flight=False),
        lambda: (0, None),
    )
    try:
        with pytest.raises(ValueError, match="built without VLLMOptions.in_flight"):
            engine.generate(prompts, SamplingParams(max_new_tokens=2), seeds=[0, 1, 2, 3])
    finally:
        engine.options, engine.updates = options, None
