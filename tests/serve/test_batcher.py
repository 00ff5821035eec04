"""The continuous batcher: a request that arrives while another decodes joins it at the next step
and leaves when done (it does not wait for the long one), its tokens reach its listener as they
are decoded, both get what they sample alone, and an engine error reaches the requests it hit
while the batcher goes on serving."""

import asyncio
import string

import pytest
import torch

from groupflow.data.tokenizer import train_char_tokenizer
from groupflow.models.causal_lm import build_tiny_llama
from groupflow.rollout.engines.base import HF
from groupflow.rollout.engines.continuous import ContinuousDecoder
from groupflow.rollout.engines.hf import SamplingParams, generate
from groupflow.serve.batcher import ContinuousBatcher, DynamicBatcher, engine_generate

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    tok = train_char_tokenizer(string.ascii_letters + " ")
    model = build_tiny_llama(
        len(tok), hidden_size=32, num_layers=2, num_heads=2, max_positions=1024, seed=0,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    ).eval()  # fmt: skip
    return model, tok


def _alone(model, tok, prompt, params, seed):
    out = generate(model, [prompt], params, seeds=[seed], pad_id=tok.pad_token_id, eos_ids=[])
    return out.responses[0].tolist(), out.logprobs[0].tolist()


def test_a_request_joins_a_running_decode_and_leaves_before_it(tiny):
    model, tok = tiny
    batcher = ContinuousBatcher(
        ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id), wait_s=0.001
    )
    long_p, short_p = tok("tell me a long story")["input_ids"], tok("hi")["input_ids"]
    long_params = SamplingParams(temperature=1.0, max_new_tokens=250)
    short_params = SamplingParams(temperature=0.8, max_new_tokens=4)

    async def main():
        streamed: list[int] = []
        started = asyncio.Event()

        def listener(j, ids):
            streamed.extend(ids)
            started.set()

        long = asyncio.ensure_future(batcher.submit([long_p], long_params, [1], listener))
        await asyncio.wait_for(started.wait(), TIMEOUT_S)
        short = await asyncio.wait_for(batcher.submit([short_p], short_params, [2]), TIMEOUT_S)
        running = not long.done()  # the short request did not wait for the long one
        during = len(streamed)
        return short, await asyncio.wait_for(long, TIMEOUT_S), running, during, streamed

    try:
        short, long, running, during, streamed = asyncio.run(main())
    finally:
        batcher.close()
    assert running and 0 < during < 250  # tokens arrived while the long request was decoding
    assert batcher.engine_calls == 2 and batcher.samples == 2  # two joins, one decode
    for (c,), prompt, params, seed in [(short, short_p, short_params, 2),
                                      (long, long_p, long_params, 1)]:  # fmt: skip
        ids, lps = _alone(model, tok, prompt, params, seed)
        assert c.ids == ids and c.logprobs == pytest.approx(lps, abs=1e-5)
        assert c.finish == "length"
    assert streamed == long[0].ids


@pytest.mark.parametrize("kind", ["continuous", "dynamic"])
def test_an_idle_batcher_starts_as_soon_as_every_expected_request_is_queued(tiny, kind):
    model, tok = tiny
    if kind == "continuous":
        decoder = ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id)
        batcher = ContinuousBatcher(decoder, wait_s=TIMEOUT_S)
    else:
        engine = HF.build(model, tok, eos_ids=[], pad_id=tok.pad_token_id)
        batcher = DynamicBatcher(engine_generate(engine), wait_s=TIMEOUT_S)
    batcher.expected = lambda: 2  # a training run's two open episodes
    params = SamplingParams(temperature=1.0, max_new_tokens=3)

    async def main():
        first = asyncio.ensure_future(batcher.submit([[5, 6]], params, [1]))
        await asyncio.sleep(0.05)  # the second call comes a moment later
        second = batcher.submit([[7]], params, [2])
        # each arrival wakes the wait: nothing waits out wait_s (a minute) once both are queued
        return await asyncio.wait_for(asyncio.gather(first, second), TIMEOUT_S / 4)

    try:
        done = asyncio.run(main())
    finally:
        batcher.close()
    assert [len(c.ids) for (c,) in done] == [3, 3]
    assert batcher.engine_calls == 1 and batcher.samples == 2  # one prefill for both


def test_an_engine_error_reaches_its_request_and_the_batcher_goes_on(tiny):
    model, tok = tiny
    batcher = ContinuousBatcher(ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id))
    params = SamplingParams(max_new_tokens=3)

    async def main():
        with pytest.raises(IndexError):  # a token id outside the embedding table
            await asyncio.wait_for(batcher.submit([[10_000]], params, [1]), TIMEOUT_S)
        return await asyncio.wait_for(batcher.submit([[5, 6]], params, [1]), TIMEOUT_S)

    try:
        (ok,) = asyncio.run(main())
    finally:
        batcher.close()
    assert len(ok.ids) == 3


def test_a_cancelled_request_leaves_the_decode(tiny):
    model, tok = tiny
    decoder = ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id)
    batcher = ContinuousBatcher(decoder)
    params = SamplingParams(max_new_tokens=1000)
    dropped, drop = [], decoder.drop
    decoder.drop = lambda gone: dropped.append(drop(gone)) or dropped[-1]  # a spy

    async def main():
        started = asyncio.Event()
        task = asyncio.ensure_future(
            batcher.submit([[5, 6]], params, [1], lambda j, ids: started.set())
        )
        await asyncio.wait_for(started.wait(), TIMEOUT_S)
        task.cancel()  # e.g. an agent past rollout.agent_timeout_s
        for _ in range(TIMEOUT_S * 100):
            if decoder.active == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    try:
        left = asyncio.run(main())
    finally:
        batcher.close()
    assert left and sum(dropped) == 1  # dropped, not decoded to its 1000 tokens


def test_an_idle_batcher_frees_the_decoders_buffer(tiny):
    model, tok = tiny
    decoder = ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id)
    batcher = ContinuousBatcher(decoder, max_batch_samples=4, release_s=0.05)
    params = SamplingParams(max_new_tokens=3)

    async def freed():
        for _ in range(TIMEOUT_S * 100):
            if decoder.slots == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    async def main():
        first = await asyncio.wait_for(batcher.submit([[5, 6]], params, [1]), TIMEOUT_S)
        was_freed = await freed()
        again = await asyncio.wait_for(batcher.submit([[5, 6]], params, [1]), TIMEOUT_S)
        return first, was_freed, again

    try:
        first, was_freed, again = asyncio.run(main())
    finally:
        batcher.close()
    assert decoder.max_rows == 4  # the slots grow to the batcher's max_batch_samples
    assert was_freed and first == again  # a new buffer after the release, the same samples


def test_in_flight_updates_switch_the_continuous_decoder_between_steps(tiny):
    """rollout.async_mode=in_flight through the agent server's batcher (``group_batcher`` over a
    one-worker local group, the updates given to its engine after the batcher was built, as the
    rollout side does): version 7 arrives before the step that samples token 3 (the join is the
    1st call). Tokens 0-2 are the old model's own, the rest have the new model's teacher-forced
    log-probs, and each completion says which version sampled each token. The row that spanned
    the switch is not kept for the prefix cache: the next call, which continues it, prefills all
    of its prompt with the new weights."""
    import copy
    from types import SimpleNamespace

    from groupflow.models.logprobs import response_logprobs
    from groupflow.serve.batcher import group_batcher
    from groupflow.workers.inference import InferenceWorker

    model, tok = tiny
    old, new = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():  # the final norm only: the kept keys/values are the new version's too
        new.model.norm.weight.mul_(torch.linspace(0.2, 3.0, new.model.norm.weight.numel()))
    worker = InferenceWorker(copy.deepcopy(model), tok, None, pad_id=tok.pad_token_id, eos_ids=[],
                             role="rollout")  # fmt: skip
    group = SimpleNamespace(backend="local", world_size=1, local_worker=lambda: worker)
    batcher = group_batcher(group, wait_s=0.001)
    assert isinstance(batcher, ContinuousBatcher)
    calls = []

    def updates():
        calls.append(len(calls))
        if len(calls) == 4:
            return 7, new.state_dict()
        return (6, None) if len(calls) < 4 else (7, None)

    worker.engine.updates = updates
    prompt = tok("tell me")["input_ids"]
    params = SamplingParams(temperature=1.0, max_new_tokens=10)

    async def main():
        (first,) = await asyncio.wait_for(batcher.submit([prompt], params, [5]), TIMEOUT_S)
        follow = prompt + first.ids + tok(" more")["input_ids"]
        (second,) = await asyncio.wait_for(batcher.submit([follow], params, [6]), TIMEOUT_S)
        return first, second

    try:
        first, second = asyncio.run(main())
    finally:
        batcher.close()
    alone, _ = _alone(old, tok, prompt, params, 5)
    assert first.ids[:3] == alone[:3] and first.ids != alone
    assert first.versions == [6, 6, 6] + [7] * 7
    ids = torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long)
    response = torch.tensor([first.ids]), torch.ones(1, 10, dtype=torch.long)
    by_old = response_logprobs(old, *ids, *response)[0][0]
    by_new = response_logprobs(new, *ids, *response)[0][0]
    got = torch.tensor(first.logprobs)
    torch.testing.assert_close(got[:3], by_old[:3], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[3:], by_new[3:], atol=1e-5, rtol=0)
    assert (got[3:] - by_old[3:]).abs().max() > 1e-2
    assert second.versions == [7] * 10 and batcher.reused_tokens == 0
    follow = prompt + first.ids + tok(" more")["input_ids"]
    assert second.ids == _alone(new, tok, follow, params, 6)[0]  # all of it the new weights'


def test_the_per_call_batcher_passes_each_token_s_version_through(tiny):
    """The route of a Ray pool or vLLM (``group_generate`` over a worker group, here a local one):
    the engine's token versions reach each completion, also when a completion decoded for a
    longer request is cut back to its own max_tokens."""
    import copy
    from types import SimpleNamespace

    from groupflow.serve.batcher import group_generate
    from groupflow.workers.inference import InferenceWorker

    model, tok = tiny
    worker = InferenceWorker(copy.deepcopy(model), tok, None, pad_id=tok.pad_token_id, eos_ids=[],
                             role="rollout")  # fmt: skip
    calls = []

    def updates():
        calls.append(1)
        return (3 if len(calls) < 3 else 4), None  # version 4 from the 3rd decode step on

    worker.engine.updates = updates
    group = SimpleNamespace(generate=worker.generate)
    batcher = DynamicBatcher(group_generate(group), wait_s=0.05)

    async def main():
        return await asyncio.gather(
            batcher.submit([[5, 6]], SamplingParams(max_new_tokens=6), [1]),
            batcher.submit([[7]], SamplingParams(max_new_tokens=2), [2]),
        )

    try:
        (long,), (short,) = asyncio.run(main())
    finally:
        batcher.close()
    assert batcher.engine_calls == 1  # both in one call: the short one cut back
    assert long.versions == [3, 3, 4, 4, 4, 4] and short.versions == [3, 3]
    assert len(short.ids) == len(short.logprobs) == 2
