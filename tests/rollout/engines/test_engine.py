"""The rollout-engine interface (``groupflow.rollout.engines.base``): the HF engine gives exactly the
decode loop's tokens and log-probs, loads weights by version, and every generating worker builds
its engine from picklable options (no ``engine is None`` anywhere)."""

import copy
import pickle

import torch

from groupflow.models.causal_lm import build_tiny_llama
from groupflow.rollout.engines import vllm_engine
from groupflow.rollout.engines.base import HF, HFEngine, HFOptions
from groupflow.rollout.engines.hf import SamplingParams, generate

PAD, EOS = 0, 2
PROMPTS = [[5, 6, 7, 8, 9], [10, 11]]


def _model(seed: int):
    m = build_tiny_llama(
        24, hidden_size=32, num_layers=2, num_heads=4, seed=seed, pad_token_id=PAD,
        eos_token_id=EOS,
    )  # fmt: skip
    return m.eval()


def test_hf_engine_is_the_decode_loop():
    model = _model(3)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2)
    seeds = [11, 12, 13, 14]
    engine = HF.build(model, None, eos_ids=[EOS], pad_id=PAD)
    out = engine.generate(PROMPTS, params, seeds=seeds)
    ref = generate(model, PROMPTS, params, seeds=seeds, pad_id=PAD, eos_ids=[EOS])
    assert torch.equal(out.responses, ref.responses)
    assert torch.equal(out.logprobs, ref.logprobs)
    assert out.finish_reasons == ref.finish_reasons
    assert engine.name == "hf" and not engine.separate_weights  # decodes with the worker's model


def test_hf_engine_loads_weights_by_version():
    a, b = _model(3), _model(4)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=1)
    engine = HFEngine(copy.deepcopy(a), None, eos_ids=[EOS], pad_id=PAD)
    assert engine.version == -1
    engine.load_weights(b.state_dict().items(), version=7)
    assert engine.version == 7
    out = engine.generate(PROMPTS, params, seeds=[1, 2])
    ref = generate(b, PROMPTS, params, seeds=[1, 2], pad_id=PAD, eos_ids=[EOS])
    assert torch.equal(out.logprobs, ref.logprobs)  # b's weights now, not a's
    engine.pause()  # nothing to release: no error, weights stay
    engine.resume()
    assert torch.equal(engine.generate(PROMPTS, params, seeds=[1, 2]).logprobs, ref.logprobs)


def test_engine_options_are_picklable_and_build_their_engine(monkeypatch):
    assert pickle.loads(pickle.dumps(HF)) == HFOptions()
    built = []

    class FakeVLLM:
        def __init__(self, model, tokenizer, options, *, eos_ids, pad_id):
            built.append((model, options, eos_ids, pad_id))

    monkeypatch.setattr(vllm_engine, "VLLMEngine", FakeVLLM)
    options = vllm_engine.VLLMOptions(seed=5)
    engine = pickle.loads(pickle.dumps(options)).build("m", None, eos_ids=[EOS], pad_id=PAD)
    assert isinstance(engine, FakeVLLM) and built == [("m", options, [EOS], PAD)]


def test_generating_workers_hold_an_engine_whatever_was_chosen():
    from groupflow.workers.inference import InferenceWorker

    class Tok:
        pad_token_id = PAD

    worker = InferenceWorker(_model(3), Tok(), None, pad_id=PAD, eos_ids=[EOS], role="rollout")
    assert isinstance(worker.engine, HFEngine) and worker.engine.model is worker.model
