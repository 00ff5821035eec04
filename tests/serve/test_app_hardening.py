"""The server under faults and clients that misbehave (issue 31's serve items), on a tiny model
whose rows never stop early (no EOS: every row decodes to its max_tokens): one request's bad
seed or engine failure never reaches another request; a client that disconnects stops its
rows; a request the queue cannot take queues nothing; long prompts are capped and tokenized off
the event loop; every 4xx/5xx is OpenAI-shaped, as the official client parses it. 127.0.0.1,
one torch thread, every request with a hard client timeout."""

import asyncio
import json
import socket
import string
import threading
import time

import httpx
import pytest
import torch

from groupflow.data.tokenizer import train_char_tokenizer
from groupflow.models.causal_lm import build_tiny_llama
from groupflow.rollout.engines.continuous import ContinuousDecoder
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.serve.access import OpenAccess
from groupflow.serve.app import build_app
from groupflow.serve.batcher import Completion, ContinuousBatcher, DynamicBatcher
from groupflow.serve.core import ServeLimits, ServerCore
from groupflow.serve.thread import ServerThread

openai = pytest.importorskip("openai", reason="needs the openai package (pip install openai)")

TIMEOUT_S = 60
KEY = {"Authorization": "Bearer k"}


def _tiny():
    torch.set_num_threads(1)
    tok = train_char_tokenizer(string.ascii_uppercase)
    model = build_tiny_llama(
        len(tok), hidden_size=32, num_layers=2, num_heads=2, max_positions=1024, seed=0,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    ).eval()  # fmt: skip
    return tok, model


class SpyTokenizer:
    """The tokenizer, noting the thread and length of every text it encodes."""

    def __init__(self, tok):
        self._tok, self.calls = tok, []

    def __call__(self, text, **kwargs):
        self.calls.append((threading.current_thread().name, len(text)))
        return self._tok(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)


@pytest.fixture(scope="module")
def endless():
    """(server, core, tokenizer): a continuous batcher whose rows stop only at max_tokens."""
    tok, model = _tiny()
    decoder = ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id)
    step, decoder.decoded = decoder.step, 0

    def counted_step():  # the tokens the decode steps sample, counted
        progress, finished = step()
        decoder.decoded += len(progress)
        return progress, finished

    decoder.step = counted_step
    limits = ServeLimits(max_tokens=600, max_context_tokens=1024, max_n=8,
                         max_body_bytes=4_000_000, max_pending_samples=64)  # fmt: skip
    core = ServerCore(SpyTokenizer(tok), ContinuousBatcher(decoder, max_pending_samples=64),
                      SamplingParams(), model_name="tiny", limits=limits)  # fmt: skip
    server = ServerThread(build_app(core)).start()
    yield server, core, tok
    server.stop()
    core.close()


def _settle(core, timeout_s: float = 30.0) -> int:
    """Wait until no row decodes; the tokens its steps decoded so far."""
    deadline = time.monotonic() + timeout_s
    while core.batcher.decoder.active or core.batcher.pending_samples:
        assert time.monotonic() < deadline, "rows still decoding"
        time.sleep(0.02)
    return core.batcher.decoder.decoded


# ----- one request's failure stays its own -------------------------------------------------------
def test_an_out_of_range_seed_is_a_400_naming_seed_and_streams_beside_it_finish(endless):
    server, core, _ = endless
    client = openai.AsyncOpenAI(base_url=server.url, api_key="k", max_retries=0,
                                timeout=TIMEOUT_S)  # fmt: skip

    async def stream(i):
        chunks = [c async for c in await client.completions.create(
            model="tiny", prompt=f"Q{i}", max_tokens=24, seed=i, stream=True)]  # fmt: skip
        return chunks

    async def bad():
        await asyncio.sleep(0.05)  # while the streams decode
        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(model="tiny", prompt="X", max_tokens=4, seed=2**64)
        return err.value

    async def main():
        return await asyncio.gather(*(stream(i) for i in range(8)), bad())

    *streams, err = asyncio.run(main())
    assert err.param == "seed" and "seed" in err.body["message"]
    for chunks in streams:  # every stream ends normally, with all its tokens
        last = chunks[-1].choices[0]
        assert last.finish_reason == "length" and len(last.model_extra["token_ids"]) == 24
    # the extreme seeds the request model accepts work (wrapped into the engines' range)
    for seed in (2**63 - 1, -(2**63)):
        r = httpx.post(f"{server.url}/completions", headers=KEY, timeout=TIMEOUT_S, json={
            "prompt": "A", "max_tokens": 2, "seed": seed, "n": 2})  # fmt: skip
        assert r.status_code == 200, r.text


def test_an_engine_failure_in_a_join_fails_that_request_alone():
    """A seed the generator refuses, given to the batcher directly (past the request model): the
    join that prefills it fails, but only its own request — the requests decoding already and
    those joining with it get exactly the tokens they get alone."""
    tok, model = _tiny()
    decoder = ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id)
    batcher = ContinuousBatcher(decoder)
    params = SamplingParams(max_new_tokens=30)

    async def main():
        started = asyncio.Event()
        first = asyncio.ensure_future(batcher.submit(
            [[5, 6, 7]], params, [1], lambda j, ids: started.set()))  # fmt: skip
        await asyncio.wait_for(started.wait(), TIMEOUT_S)  # decoding
        joined = [asyncio.ensure_future(batcher.submit(p, params, s)) for p, s in (
            ([[8, 9]], [2]), ([[3]], [2**64]), ([[4, 4]], [3]))]  # fmt: skip
        done = await asyncio.wait_for(
            asyncio.gather(first, *joined, return_exceptions=True), TIMEOUT_S
        )
        alone = [await batcher.submit(p, params, s) for p, s in
                 (([[5, 6, 7]], [1]), ([[8, 9]], [2]), ([[4, 4]], [3]))]  # fmt: skip
        return done, alone

    try:
        (first, ok1, bad, ok2), alone = asyncio.run(main())
    finally:
        batcher.close()
    assert isinstance(bad, ValueError) and "overflow" in str(bad).lower()
    assert [[c.ids for c in r] for r in (first, ok1, ok2)] == [[c.ids for c in r] for r in alone]


def test_an_engine_call_failing_for_one_request_fails_it_alone():
    calls = []

    def generate(prompts, params, seeds):
        calls.append(len(prompts))
        if [99] in prompts:
            raise RuntimeError("the engine cannot take token 99")
        return [Completion([p[0] + 1], [-0.5], "length") for p in prompts]

    batcher = DynamicBatcher(generate, wait_s=0.01)
    params = SamplingParams(max_new_tokens=1)

    async def main():
        return await asyncio.gather(
            *(batcher.submit([p], params, [0]) for p in ([1], [99], [2])), return_exceptions=True
        )

    try:
        ok1, bad, ok2 = asyncio.run(main())
    finally:
        batcher.close()
    assert ok1[0].ids == [2] and ok2[0].ids == [3]
    assert isinstance(bad, RuntimeError) and "99" in str(bad)
    assert calls[0] == 3 and sorted(calls[1:]) == [1, 1, 1]  # together, then one by one


# ----- clients that left, and requests the queue cannot take --------------------------------------
def test_a_stream_whose_client_disconnects_stops_decoding(endless):
    server, core, _ = endless
    before = _settle(core)
    body = {"prompt": "ABC", "max_tokens": 500, "n": 8, "seed": 0, "stream": True}
    with httpx.Client(timeout=TIMEOUT_S) as http:
        with http.stream("POST", f"{server.url}/completions", json=body, headers=KEY) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if '"text": "' in line and '"text": ""' not in line:
                    break  # the first token's text: the client leaves
    decoded = _settle(core) - before
    # 8 rows × 500 tokens if decoding went on; the rows leave within a few steps
    assert decoded < 8 * 500 // 4, decoded


def test_a_request_whose_client_disconnects_stops_decoding(endless):
    server, core, _ = endless
    before = _settle(core)
    body = json.dumps({"prompt": "ABC", "max_tokens": 500, "n": 8, "seed": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    with socket.create_connection((server.host, server.port), timeout=TIMEOUT_S) as conn:
        conn.sendall(head.encode() + body)
        deadline = time.monotonic() + TIMEOUT_S
        while core.batcher.decoder.decoded == before:  # decoding: the client leaves
            assert time.monotonic() < deadline
            time.sleep(0.001)
    decoded = _settle(core) - before
    assert decoded < 8 * 500 // 4, decoded


def test_a_request_the_queue_cannot_take_queues_nothing():
    """A 429 (the queue too full now) and a 400 (larger than the whole queue) queue none of the
    request's prompts: the engine never sees them."""
    entered, gate, seen = threading.Event(), threading.Event(), []

    def generate(prompts, params, seeds):  # holds the engine until the gate opens
        entered.set()
        assert gate.wait(TIMEOUT_S)
        seen.extend(prompts)
        return [Completion([1], [-0.1], "length") for _ in prompts]

    tok, _ = _tiny()
    batcher = DynamicBatcher(generate, max_pending_samples=16, wait_s=0.001)
    limits = ServeLimits(max_tokens=8, max_context_tokens=64, max_pending_samples=16)
    core = ServerCore(tok, batcher, SamplingParams(), model_name="tiny", limits=limits)
    server = ServerThread(build_app(core)).start()
    url = f"{server.url}/completions"

    def post(prompt):
        return threading.Thread(target=httpx.post, args=(url,), kwargs={
            "json": {"prompt": prompt, "max_tokens": 1}, "timeout": TIMEOUT_S})  # fmt: skip

    first, waiting = post("A"), post(["B"] * 10)
    try:
        first.start()
        assert entered.wait(TIMEOUT_S)  # in the engine, held there
        waiting.start()  # queued behind it: 10 samples pending
        deadline = time.monotonic() + TIMEOUT_S
        while batcher.pending_samples < 10:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        full = httpx.post(url, json={"prompt": ["C"] * 10, "max_tokens": 1}, timeout=TIMEOUT_S)
        assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error"
        huge = httpx.post(url, json={"prompt": ["D"] * 17, "max_tokens": 1}, timeout=TIMEOUT_S)
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "prompt"
        assert batcher.pending_samples == 10  # nothing of either was queued
        gate.set()
        first.join(TIMEOUT_S)
        waiting.join(TIMEOUT_S)
    finally:
        gate.set()
        server.stop()
        core.close()
    letters = sorted(tok.decode(p) for p in seen)
    assert letters == ["A"] + ["B"] * 10


# ----- long prompts -------------------------------------------------------------------------------
def test_long_prompts_are_tokenized_off_the_event_loop_and_capped(endless):
    server, core, _ = endless
    spy: SpyTokenizer = core.tokenizer
    spy.calls.clear()
    long_prompt = "AB" * 3000  # 6000 characters: the tokenizer thread
    r = httpx.post(f"{server.url}/completions", headers=KEY, timeout=TIMEOUT_S,
                   json={"prompt": long_prompt[:900], "max_tokens": 1})  # fmt: skip
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/completions", headers=KEY, timeout=TIMEOUT_S,
                   json={"prompt": long_prompt, "max_tokens": 1})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # > 1024 tokens
    threads = {n: name for name, n in spy.calls}
    assert threads[6000] == "groupflow-tokenize_0"  # not the server's event loop
    assert threads[900] == "groupflow-server"  # short: inline (a thread hop costs more)
    spy.calls.clear()
    cap = core.limits.prompt_chars  # 16 × 1024 characters by default
    assert cap == 16 * 1024
    for path, body, param in [
        ("completions", {"prompt": "A" * (cap + 1)}, "prompt"),
        ("completions", {"prompt": ["A", "B" * (cap + 1)]}, "prompt.1"),
        ("chat/completions", {"messages": [{"role": "user", "content": "A" * (cap + 1)}]},
         "messages"),
    ]:  # fmt: skip
        r = httpx.post(f"{server.url}/{path}", headers=KEY, timeout=TIMEOUT_S, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "serve.max_prompt_chars" in err["message"]
    assert spy.calls == []  # refused before tokenizing


# ----- errors as the official client parses them --------------------------------------------------
def test_every_error_is_openai_shaped(endless):
    server, core, _ = endless
    client = openai.OpenAI(base_url=server.url, api_key="k", max_retries=0, timeout=TIMEOUT_S)
    shape = {"message", "type", "param", "code"}

    def caught(kind, fn):
        with pytest.raises(kind) as err:
            fn()
        assert isinstance(err.value.body, dict) and set(err.value.body) == shape, err.value.body
        return err.value

    e = caught(openai.NotFoundError, lambda: client.post("/nope", cast_to=object, body={}))
    assert "/v1/nope" in e.body["message"]
    e = caught(openai.APIStatusError, lambda: client.get("/completions", cast_to=object))
    assert e.status_code == 405
    e = caught(openai.BadRequestError, lambda: client.completions.create(
        model="tiny", prompt="A", temperature=3))  # fmt: skip
    assert e.param == "temperature"
    e = caught(openai.BadRequestError, lambda: client.completions.create(
        model="tiny", prompt="A", max_tokens=0))  # fmt: skip
    assert e.param == "max_tokens"
    e = caught(openai.APIStatusError, lambda: client.completions.create(
        model="tiny", prompt="A" * 4_100_000))  # fmt: skip
    assert e.status_code == 413

    class Broken:  # an engine that fails: the request's 500, in OpenAI's shape
        pending_samples = 0

        def check_room(self, samples):
            pass

        def enqueue(self, prompts, params, seeds, listener=None):
            raise RuntimeError("the engine fell over")

        def close(self):
            pass

    tok = core.tokenizer
    broken = ServerCore(tok, Broken(), SamplingParams(), model_name="tiny", limits=core.limits,
                        access=OpenAccess("k"))  # fmt: skip
    other = ServerThread(build_app(broken)).start()
    try:
        caught(openai.AuthenticationError, lambda: openai.OpenAI(
            base_url=other.url, api_key="wrong", max_retries=0).models.list())  # fmt: skip
        bad = openai.OpenAI(base_url=other.url, api_key="k", max_retries=0, timeout=TIMEOUT_S)
        e = caught(openai.InternalServerError, lambda: bad.completions.create(
            model="tiny", prompt="A", max_tokens=2))  # fmt: skip
        assert e.type == "server_error" and "the engine fell over" in e.body["message"]
    finally:
        other.stop()
