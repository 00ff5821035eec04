"""Prompt log-probs and top alternatives (``serve.scoring``): equal to a direct forward of the
model (``log_softmax(model(ids).logits)``), through the function and through the server's
``echo`` / ``logprobs`` / ``top_logprobs``; the tokenizer endpoints lm-evaluation-harness uses."""

import math
import string

import httpx
import pytest
import torch

from groupflow.data.tokenizer import train_char_tokenizer
from groupflow.models.causal_lm import build_tiny_llama
from groupflow.rollout.engines.continuous import ContinuousDecoder
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.serve.app import build_app
from groupflow.serve.batcher import Completion, ContinuousBatcher, DynamicBatcher
from groupflow.serve.core import ServeLimits, ServerCore
from groupflow.serve.scoring import ScoreJob, score_sequences
from groupflow.serve.thread import ServerThread

openai = pytest.importorskip("openai", reason="needs the openai package (pip install openai)")

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    tok = train_char_tokenizer(string.ascii_uppercase + " ")
    model = build_tiny_llama(
        len(tok), hidden_size=32, num_layers=2, num_heads=2, max_positions=256, seed=3,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    ).eval()  # fmt: skip
    return tok, model


def _direct(model, ids: list[int], temperature: float = 1.0, start: int | None = None):
    """log_softmax of the model's own logits for ids[1:]: [len-1, V] (positions predicting
    ids[start:] divided by ``temperature`` first)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    if start is not None and temperature > 0:
        logits[start - 1 :] = logits[start - 1 :] / temperature
    return torch.log_softmax(logits, -1)


def test_scores_equal_a_direct_forward(tiny):
    tok, model = tiny
    jobs = [
        ScoreJob([5, 6, 7, 8, 9, 10], start=4, temperature=0.7),  # a prompt of 4, 2 sampled
        ScoreJob([11, 12], start=2),
        ScoreJob([3, 4, 5, 6, 7, 8, 9, 10, 11], start=5, temperature=1.3, first=5),  # sampled only
        ScoreJob([7], start=1),  # nothing predicts a lone token
    ]
    scores = score_sequences(model, jobs, 3, tok.pad_token_id)
    for job, s in zip(jobs, scores):
        ref = _direct(model, job.ids, job.temperature, job.start)[job.first - 1 :]
        targets = torch.tensor(job.ids[job.first :])
        assert len(s.logprobs) == len(job.ids) - job.first
        if not s.logprobs:
            continue
        want = ref.gather(-1, targets[:, None]).squeeze(-1)
        assert s.logprobs == pytest.approx(want.tolist(), abs=1e-5)
        values, index = ref.topk(3, -1)
        assert [[t for t, _ in top] for top in s.top] == index.tolist()
        got = [v for top in s.top for _, v in top]
        assert got == pytest.approx(values.flatten().tolist(), abs=1e-5)
    assert score_sequences(model, jobs[:1], 0, tok.pad_token_id)[0].top == [[], [], [], [], []]


@pytest.fixture(scope="module")
def served(tiny):
    tok, model = tiny
    decoder = ContinuousDecoder(model, tok, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    limits = ServeLimits(max_tokens=16, max_context_tokens=256, max_n=4)
    core = ServerCore(tok, ContinuousBatcher(decoder), SamplingParams(), model_name="tiny",
                      limits=limits)  # fmt: skip
    server = ServerThread(build_app(core)).start()
    yield server, tok, model
    server.stop()
    core.close()


def _client(server):
    return openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=TIMEOUT_S)


def test_echo_gives_the_prompts_log_probs_as_lm_eval_reads_them(served):
    """lm-evaluation-harness's log-likelihood request: token ids, echo, logprobs=1, max_tokens=1,
    temperature 0 — it sums token_logprobs[ctxlen:-1] and compares each with the best of its
    top_logprobs ("is greedy")."""
    server, tok, model = served
    ids = tok("ABC DEF")["input_ids"]
    r = _client(server).completions.create(model="tiny", prompt=[ids], echo=True, logprobs=1,
                                           max_tokens=1, temperature=0, seed=1234)  # fmt: skip
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.tokens[: len(ids)] == [
        tok.decode([t]) for t in ids
    ]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _direct(model, ids + c.model_extra["token_ids"])
    want = ref.gather(-1, torch.tensor(ids[1:] + c.model_extra["token_ids"])[:, None]).squeeze(-1)
    assert lp.token_logprobs[1:] == pytest.approx(want.tolist(), abs=1e-5)
    for p, (top, value) in enumerate(zip(lp.top_logprobs[1:], lp.token_logprobs[1:])):
        best = int(ref[p].argmax())
        assert max(top.values()) == pytest.approx(ref[p].max().item(), abs=1e-5)
        assert tok.decode([best]) in top and lp.tokens[p + 1] in top  # the best and the token
        assert (value == max(top.values())) == (best == (ids + c.model_extra["token_ids"])[p + 1])
    # the greedy token is the argmax after the prompt, and its log-prob the sampler's
    assert c.model_extra["token_ids"] == [int(ref[-1].argmax())]
    assert lp.token_logprobs[-1] == pytest.approx(c.model_extra["token_logprobs"][0], abs=1e-5)
    assert c.text.startswith("ABC DEF") and lp.text_offset[0] == 0
    # max_tokens 0: the prompt scored, nothing sampled
    r0 = _client(server).completions.create(model="tiny", prompt="ABC DEF", echo=True,
                                            logprobs=0, max_tokens=0)  # fmt: skip
    c0 = r0.choices[0]
    assert c0.text == "ABC DEF" and c0.model_extra["token_ids"] == []
    assert c0.logprobs.token_logprobs == [None, *lp.token_logprobs[1 : len(ids)]]
    assert c0.logprobs.top_logprobs is None and r0.usage.completion_tokens == 0
    # echo without logprobs: the text only; a streamed echo starts with the prompt
    plain = _client(server).completions.create(model="tiny", prompt="AB", echo=True, max_tokens=3,
                                               seed=2)  # fmt: skip
    assert plain.choices[0].logprobs is None and plain.choices[0].text.startswith("AB")
    chunks = list(_client(server).completions.create(model="tiny", prompt="AB", echo=True,
                                                     max_tokens=3, seed=2, stream=True))  # fmt: skip
    assert chunks[0].choices[0].text == "AB"
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == plain.choices[0].text


def test_top_logprobs_of_sampled_tokens_are_at_the_sampling_temperature(served):
    server, tok, model = served
    client = _client(server)
    r = client.completions.create(model="tiny", prompt="QRS", logprobs=3, max_tokens=6,
                                  temperature=0.8, seed=5)  # fmt: skip
    c = r.choices[0]
    ids, sampled = c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
    ref = _direct(model, ids + sampled, 0.8, len(ids))[len(ids) - 1 :]
    assert c.logprobs.token_logprobs == pytest.approx(c.model_extra["token_logprobs"], abs=1e-4)
    for p, top in enumerate(c.logprobs.top_logprobs):
        values, index = ref[p].topk(3)
        for t, v in zip(index.tolist(), values.tolist()):
            assert top[tok.decode([t])] == pytest.approx(v, abs=1e-5)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "HI"}], logprobs=True,
        top_logprobs=2, max_tokens=5, temperature=1.2, seed=7,
    )  # fmt: skip
    ch = chat.choices[0]
    ids, sampled = chat.model_extra["prompt_token_ids"], ch.model_extra["token_ids"]
    ref = _direct(model, ids + sampled, 1.2, len(ids))[len(ids) - 1 :]
    for p, entry in enumerate(ch.logprobs.content):
        values, index = ref[p].topk(2)
        assert [a.token for a in entry.top_logprobs] == [tok.decode([t]) for t in index.tolist()]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-5)
        assert entry.logprob == pytest.approx(ch.model_extra["token_logprobs"][p], abs=1e-4)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A"}],
                                       top_logprobs=2)  # fmt: skip
    assert err.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="A", logprobs=21)
    assert err.value.param == "logprobs"


def test_the_tokenizer_endpoints(served):
    server, tok, _ = served
    root = server.url.removesuffix("/v1")
    info = httpx.get(f"{root}/tokenizer_info", timeout=TIMEOUT_S).json()
    assert info["eos_token"] == tok.eos_token and info["model_max_length"] == 256
    r = httpx.post(f"{root}/tokenize", json={"prompt": "AB C", "add_special_tokens": False},
                   timeout=TIMEOUT_S).json()  # fmt: skip
    assert r["tokens"] == tok("AB C", add_special_tokens=False)["input_ids"] and r["count"] == 4
    eos = httpx.post(f"{root}/tokenize", json={"prompt": tok.eos_token, "add_special_tokens": False},
                     timeout=TIMEOUT_S).json()  # fmt: skip
    assert eos["tokens"] == [tok.eos_token_id]  # lm-eval finds the EOS id this way
    chat = httpx.post(f"{root}/tokenize", json={"messages": [{"role": "user", "content": "HI"}]},
                      timeout=TIMEOUT_S).json()  # fmt: skip
    c = _client(server).chat.completions.create(model="tiny", max_tokens=1,
                                                messages=[{"role": "user", "content": "HI"}])  # fmt: skip
    assert chat["tokens"] == c.model_extra["prompt_token_ids"]
    back = httpx.post(f"{root}/detokenize", json={"tokens": r["tokens"]}, timeout=TIMEOUT_S)
    assert back.json() == {"prompt": "AB C"}
    for path, body, param in [
        ("detokenize", {"tokens": [10**6]}, "tokens"),
        ("tokenize", {"prompt": "A", "messages": [{"role": "user", "content": "A"}]}, None),
        ("tokenize", {}, None),
    ]:
        bad = httpx.post(f"{root}/{path}", json=body, timeout=TIMEOUT_S)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param


def test_a_server_without_a_model_in_its_process_refuses_echo_by_name(tiny):
    tok, _ = tiny

    def generate(prompts, params, seeds):
        return [Completion([1], [math.log(0.5)], "length") for _ in prompts]

    core = ServerCore(tok, DynamicBatcher(generate), SamplingParams(), model_name="tiny",
                      limits=ServeLimits(max_tokens=4, max_context_tokens=64))  # fmt: skip
    server = ServerThread(build_app(core)).start()
    try:
        client = _client(server)
        assert client.completions.create(model="t", prompt="A", max_tokens=1).choices
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="t", prompt="AB", echo=True, logprobs=0, max_tokens=1)
        assert err.value.param == "echo" and "scoring forward" in err.value.body["message"]
    finally:
        server.stop()
        core.close()
