"""The HTTP server with the official ``openai`` client on a tiny model (127.0.0.1, one torch
thread, every request with a hard client timeout): the endpoints, the token ids and log-probs the
responses carry (equal to the engine's own for the same seed), streaming, 4xx errors naming the
field, the limits, the API key, and concurrent requests sharing engine calls."""

import asyncio
import os
import socket
import string

import httpx
import pytest
import torch

from groupflow.data.tokenizer import train_char_tokenizer
from groupflow.models.causal_lm import build_tiny_llama
from groupflow.rollout.engines.base import HF
from groupflow.rollout.engines.continuous import ContinuousDecoder
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.serve.access import OpenAccess
from groupflow.serve.app import build_app
from groupflow.serve.batcher import ContinuousBatcher, Overloaded
from groupflow.serve.core import ServeLimits, ServerCore
from groupflow.serve.errors import ApiError
from groupflow.serve.protocol import CompletionRequest
from groupflow.serve.thread import ServerThread, check_bind

openai = pytest.importorskip("openai", reason="needs the openai package (pip install openai)")

TIMEOUT_S = 60
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}},
    "required": ["expression"]}}}]  # fmt: skip


@pytest.fixture(scope="module")
def served():
    torch.set_num_threads(1)
    tok = train_char_tokenizer(string.ascii_uppercase)
    model = build_tiny_llama(
        len(tok), hidden_size=32, num_layers=2, num_heads=2, max_positions=1024, seed=0,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    ).eval()  # fmt: skip
    engine = HF.build(model, tok, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    limits = ServeLimits(max_tokens=32, max_context_tokens=1024, max_body_bytes=20_000, max_n=4)
    decoder = ContinuousDecoder(model, tok, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    core = ServerCore(tok, ContinuousBatcher(decoder), SamplingParams(),
                      model_name="tiny", limits=limits, access=OpenAccess("secret"),
                      tool_parser="hermes")  # fmt: skip
    server = ServerThread(build_app(core)).start()
    yield server, core, engine, tok
    server.stop()
    core.batcher.close()


def _client(server, key="secret"):
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=TIMEOUT_S)


def test_models_and_chat_carry_the_sampled_ids_and_logprobs(served):
    server, core, engine, tok = served
    client = _client(server)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=9, seed=5,
        logprobs=True, temperature=0.8,
    )  # fmt: skip
    choice = r.choices[0]
    prompt = r.model_extra["prompt_token_ids"]
    assert tok.decode(prompt) == "user: hi\nassistant:"
    ids, lps = choice.model_extra["token_ids"], choice.model_extra["token_logprobs"]
    # exactly what the engine samples for this prompt and seed
    ref = engine.generate([prompt], SamplingParams(temperature=0.8, max_new_tokens=9), seeds=[5])
    m = ref.response_mask[0].bool()
    assert ids == ref.responses[0][m].tolist()
    assert lps == pytest.approx(ref.logprobs[0][m].tolist(), abs=1e-6)
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(lps)
    assert r.usage.completion_tokens == len(ids) and r.usage.prompt_tokens == len(prompt)
    assert choice.message.content == tok.decode(ids, skip_special_tokens=True)


def _server_side_sockets(port: int) -> list[socket.socket]:
    """This process's accepted connections on ``port`` (the server's ends, not the listener)."""
    found = []
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.getsockname()[1] == port:
                s.getpeername()  # the listener has no peer (OSError)
                found.append(s)
                continue
        except (OSError, IndexError, TypeError):
            pass
        s.close()
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists sockets through /proc")
def test_the_servers_connections_send_without_nagle_delays(served):
    """With Nagle's algorithm on, a response body written after its headers waited for the
    client's delayed ACK (40 ms a call on Linux): every accepted connection has TCP_NODELAY."""
    server = served[0]
    client = _client(server)
    client.models.list()  # a kept-alive connection
    conns = _server_side_sockets(server.port)
    try:
        assert conns
        assert all(c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for c in conns)
    finally:
        for c in conns:
            c.close()
        client.close()


def test_completions_take_token_ids_and_return_n_choices(served):
    server, _, _, tok = served
    r = _client(server).completions.create(model="tiny", prompt=[[10, 11, 12]], max_tokens=4,
                                           n=2, seed=1)  # fmt: skip
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.model_extra["prompt_token_ids"] == [10, 11, 12]
        assert 1 <= len(c.model_extra["token_ids"]) <= 4
    text = _client(server).completions.create(model="tiny", prompt="abc", max_tokens=3)
    assert text.choices[0].model_extra["prompt_token_ids"] == tok("abc")["input_ids"]
    calls = served[1].batcher.engine_calls
    both = _client(server).completions.create(model="tiny", prompt=["ab", "cd"], max_tokens=3)
    assert [c.model_extra["prompt_token_ids"] for c in both.choices] == [
        tok("ab")["input_ids"], tok("cd")["input_ids"]]  # fmt: skip
    assert served[1].batcher.engine_calls == calls + 1  # the request's prompts share one call


def test_streaming_sends_tokens_as_they_are_decoded(served):
    server, *_ = served
    client = _client(server)
    # no EOS within 24 tokens for this seed (checked below), so the answer is long enough
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=24,
                  seed=3, temperature=1.0)  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    assert len(whole.choices[0].model_extra["token_ids"]) == 24
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))  # fmt: skip
    finish = next(k for k, c in enumerate(chunks) if c.choices and c.choices[0].finish_reason)
    pieces = [c.choices[0].delta.content for c in chunks[:finish] if c.choices]
    pieces = [p for p in pieces if p]
    assert len(pieces) > 1  # token by token, not the finished text in one piece
    assert "".join(pieces) == whole.choices[0].message.content
    assert chunks[finish].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[finish].choices[0].model_extra["token_ids"] == whole.choices[0].model_extra[
        "token_ids"]  # fmt: skip
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_required_tool_choice_and_tool_messages(served):
    server, *_ = served
    client = _client(server)
    messages = [{"role": "user", "content": "2+2"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                       tool_choice="required", max_tokens=8, seed=2)  # fmt: skip
    c = r.choices[0]
    # the random model writes no valid JSON after the forced opening: the text comes back
    assert c.message.tool_calls is None and c.message.content.startswith("<tool_call>\n")
    assert r.model_extra["prompt_token_ids"][-12:] != c.model_extra["token_ids"][:12]
    messages += [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "2+2"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"}]  # fmt: skip
    r2 = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=4)
    text = served[3].decode(r2.model_extra["prompt_token_ids"])
    assert '<tool_call>\n{"name": "calc", "arguments": {"expression": "2+2"}}\n</tool_call>' in text
    assert text.endswith("tool: 4\nassistant:")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 33}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 5}, "n"),
        (
            {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 1},
            "presence_penalty",
        ),
        ({"messages": [{"role": "user", "content": "x" * 1100}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, None),
    ],
)
def test_bad_requests_get_400_naming_the_field(served, body, param):
    server, *_ = served
    r = httpx.post(f"{server.url}/chat/completions", json={"model": "tiny", **body},
                   headers={"Authorization": "Bearer secret"}, timeout=TIMEOUT_S)  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    if param:
        assert param.split(".")[0] in err["message"]


def test_limits_and_api_key(served):
    server, *_ = served
    url = f"{server.url}/chat/completions"
    ok = {"Authorization": "Bearer secret"}
    assert httpx.get(f"{server.url}/models", timeout=TIMEOUT_S).status_code == 401
    r = httpx.get(f"{server.url}/models", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 30_000}]}
    assert httpx.post(url, json=big, headers=ok, timeout=TIMEOUT_S).status_code == 413
    r = httpx.post(url, content=b"{not json", headers={**ok, "content-type": "application/json"},
                   timeout=TIMEOUT_S)  # fmt: skip
    assert r.status_code == 400
    with pytest.raises(ValueError, match="needs an API key"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "k")
    check_bind("127.0.0.1", None)


def test_concurrent_conversations_share_engine_calls(served):
    server, core, *_ = served
    client = openai.AsyncOpenAI(base_url=server.url, api_key="secret", max_retries=0,
                                timeout=TIMEOUT_S)  # fmt: skip

    async def conversations(k):
        return await asyncio.gather(*(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=8, seed=i)
            for i in range(k)))  # fmt: skip

    before = core.batcher.engine_calls
    results = asyncio.run(conversations(16))
    calls = core.batcher.engine_calls - before
    assert len(results) == 16 and calls <= 4  # one call decodes many conversations at once
    # batched decoding gives each conversation the tokens it gets alone (same seed)
    alone = _client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "q3"}], max_tokens=8, seed=3
    )
    assert (
        alone.choices[0].model_extra["token_ids"] == results[3].choices[0].model_extra["token_ids"]
    )


def test_completions_stream_token_by_token(served):
    server, *_ = served
    client = _client(server)
    # two prompts × 2 samples: choices 0..3, streamed side by side
    kwargs = dict(model="tiny", prompt=["AB", "QRS"], max_tokens=20, n=2, seed=3,
                  temperature=1.0, logprobs=0)  # fmt: skip
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump() and not chunks[-1].choices
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    for want in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == want.index]
        *pieces, last = mine
        assert all(p.finish_reason is None for p in pieces) and last.finish_reason
        assert len([p for p in pieces if p.text]) > 1  # token by token, not in one piece
        assert "".join(p.text for p in mine) == want.text
        assert last.finish_reason == want.finish_reason
        extra, ref = last.model_extra, want.model_extra
        ids = [t for p in mine for t in (p.model_extra.get("token_ids") or [])]
        assert ids == ref["token_ids"] and extra["prompt_token_ids"] == ref["prompt_token_ids"]
        assert extra["token_logprobs"] == pytest.approx(ref["token_logprobs"], abs=1e-5)
        assert last.logprobs.tokens == want.logprobs.tokens
    assert len({c.model_extra["token_ids"][0] for c in whole.choices}) > 1  # distinct samples


@pytest.mark.parametrize(
    "body, param",
    [({"prompt": [[10, 100_000]]}, "prompt.0"), ({"prompt": "x", "max_tokens": 33}, "max_tokens")],
)
def test_a_bad_streamed_completion_gets_a_400_not_a_stream(served, body, param):
    server, *_ = served
    r = httpx.post(f"{server.url}/completions", json={"model": "tiny", "stream": True, **body},
                   headers={"Authorization": "Bearer secret"}, timeout=TIMEOUT_S)  # fmt: skip
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == param


def test_a_full_queue_is_a_429_before_a_streamed_completion_starts(served):
    _, core, _, tok = served

    class Full:  # a batcher whose queue is full: its checks fail when a request is queued
        def check_room(self, samples):
            raise Overloaded("1024 samples are waiting")

        def enqueue(self, prompts, params, seeds, listener=None):
            raise AssertionError("a request the queue has no room for is not queued")

    full = ServerCore(tok, Full(), SamplingParams(), model_name="tiny", limits=core.limits)
    req = CompletionRequest(prompt=["AB", "CD"], max_tokens=4, stream=True)
    with pytest.raises(ApiError) as err:
        asyncio.run(asyncio.wait_for(full.complete_stream(None, req, False), TIMEOUT_S))
    assert err.value.status == 429 and err.value.kind == "rate_limit_error"
