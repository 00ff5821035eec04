"""The server's token bookkeeping without HTTP: continuing a conversation on the ids it sampled,
tool calls parsed into OpenAI ``tool_calls``, episodes' calls merged into samples, the dynamic
batcher sharing engine calls, and the credit stage's per-episode advantages."""

import asyncio
import string

import pytest
import torch

from groupflow.algorithms import compute_advantages
from groupflow.batch import Batch
from groupflow.config import AlgorithmConfig
from groupflow.credit import CreditAssignment
from groupflow.data.tokenizer import train_char_tokenizer
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.serve.access import CallRecord
from groupflow.serve.answers import TextStream
from groupflow.serve.batcher import Completion, DynamicBatcher
from groupflow.serve.chat import ChatPrompts
from groupflow.serve.protocol import ChatMessage, ToolSpec
from groupflow.serve.recording import EpisodeRecorder, call_seed, merge_calls

TOOLS = [
    ToolSpec.model_validate(
        {
            "type": "function",
            "function": {
                "name": "calc",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string"}},
                    "required": ["expression"],
                },
            },
        }  # fmt: skip
    )
]


@pytest.fixture(scope="module")
def tok():
    return train_char_tokenizer(string.ascii_uppercase)


def _msgs(*items):
    return [ChatMessage.model_validate(m) for m in items]


def test_continuation_reuses_the_sampled_ids_and_appends_only_new_messages(tok):
    chat = ChatPrompts(tok, "tag", describe_tools=False)
    user = {"role": "user", "content": "mul 12*34 ="}
    first = chat.prompt("ep", _msgs(user), TOOLS, "auto")
    assert tok.decode(first.ids) == "user: mul 12*34 =\nassistant:" and not first.reused
    # the model sampled "<calc>12*34</calc>" (the template writes "assistant: " with a space)
    sampled = tok("<calc>12*34</calc>", add_special_tokens=False)["input_ids"]
    turn = chat.assistant(tok.decode(sampled), TOOLS, "auto")
    assert turn.content is None
    assert [c["function"]["name"] for c in turn.tool_calls] == ["calc"]
    assert turn.tool_calls[0]["function"]["arguments"] == '{"expression": "12*34"}'
    chat.remember(first.key, turn, first.ids + sampled)
    # the client sends the conversation back, reformatted as clients do ("" content, new spacing)
    back = dict(turn.message(), content="")
    back["tool_calls"] = [dict(back["tool_calls"][0], function={
        "name": "calc", "arguments": '{ "expression":"12*34" }'})]  # fmt: skip
    tool = {"role": "tool", "tool_call_id": "x", "content": "408"}
    second = chat.prompt("ep", _msgs(user, back, tool), TOOLS, "auto")
    assert second.reused
    assert second.ids[: len(first.ids) + len(sampled)] == first.ids + sampled  # ids as sampled
    assert tok.decode(second.ids[len(first.ids) + len(sampled) :]) == "\ntool: 408\nassistant:"
    # rendered from scratch, the text differs (a space after 'assistant:'): not what was sampled
    fresh = chat.prompt("other-episode", _msgs(user, back, tool), TOOLS, "auto")
    assert not fresh.reused and fresh.ids != second.ids


def test_edited_history_is_rendered_again(tok):
    chat = ChatPrompts(tok, "tag", describe_tools=False)
    user = {"role": "user", "content": "hi"}
    first = chat.prompt("ep", _msgs(user), None, None)
    sampled = tok("yo", add_special_tokens=False)["input_ids"]
    chat.remember(first.key, chat.assistant("yo", None, None), first.ids + sampled)
    edited = _msgs(
        user, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}
    )
    out = chat.prompt("ep", edited, None, None)
    assert not out.reused
    assert tok.decode(out.ids) == "user: hi\nassistant: hello\nuser: x\nassistant:"


def test_required_tool_choice_forces_the_call_opening_into_the_prompt(tok):
    chat = ChatPrompts(tok, "hermes", describe_tools=False)
    out = chat.prompt("ep", _msgs({"role": "user", "content": "q"}), TOOLS, "required")
    assert out.forced_text == "<tool_call>\n"
    assert tok.decode(out.ids).endswith("assistant:<tool_call>\n")
    text = out.forced_text + '{"name": "calc", "arguments": {"expression": "1+1"}}\n</tool_call>'
    turn = chat.assistant(text, TOOLS, "required")
    assert turn.tool_calls[0]["function"]["name"] == "calc" and turn.content is None
    bad = chat.assistant("<tool_call>\n{oops", TOOLS, "auto")
    assert not bad.tool_calls and bad.parse_errors and bad.content == "<tool_call>\n{oops"
    assert chat.assistant("plain answer", TOOLS, "none").content == "plain answer"


def test_hermes_tools_are_described_in_a_system_prompt(tok):
    chat = ChatPrompts(tok, "hermes")
    out = chat.prompt("ep", _msgs({"role": "user", "content": "q"}), TOOLS, "auto")
    text = tok.decode(out.ids)
    assert text.startswith("system: You are a function calling AI model") and '"calc"' in text
    assert "calc" not in tok.decode(chat.prompt("e", _msgs({"role": "user", "content": "q"}),
                                                TOOLS, "none").ids)  # fmt: skip


def _call(prompt, *completions):
    return CallRecord(list(prompt), [Completion(list(c), [-0.5] * len(c), "stop")
                                     for c in completions], None)  # fmt: skip


def test_merge_calls_one_sample_when_each_prompt_extends_the_last():
    calls = [_call([1, 2], [3, 4]), _call([1, 2, 3, 4, 9, 9], [5])]
    (chain,) = merge_calls(calls)
    assert chain.prompt_ids == [1, 2]
    assert chain.ids == [3, 4, 9, 9, 5]
    assert chain.mask == [1, 1, 0, 0, 1]
    assert chain.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert chain.calls == 2


def test_merge_calls_keeps_each_sampled_token_s_version_and_gives_the_rest_minus_one():
    """In-flight weight updates: each completion's token versions follow its ids (a switch inside
    the second completion included); the tokens between completions get -1; a chain whose
    completions carry none has none."""
    first = Completion([3, 4], [-0.5, -0.5], "stop", [6, 6])
    second = Completion([5, 6], [-0.5, -0.5], "stop", [6, 7])
    calls = [CallRecord([1, 2], [first], None), CallRecord([1, 2, 3, 4, 9], [second], None)]
    (chain,) = merge_calls(calls)
    assert chain.ids == [3, 4, 9, 5, 6] and chain.mask == [1, 1, 0, 1, 1]
    assert chain.versions == [6, 6, -1, 6, 7]
    assert merge_calls([_call([1], [2])])[0].versions is None


def test_merge_calls_splits_when_a_prompt_does_not_extend_and_branches_choices():
    calls = [_call([1, 2], [3]), _call([1, 7, 3], [4])]  # history edited: own sample
    assert [c.prompt_ids for c in merge_calls(calls)] == [[1, 2], [1, 7, 3]]
    # n = 2 choices of one request, then a call continuing the second choice
    calls = [_call([1], [2], [3]), _call([1, 3, 8], [4])]
    chains = merge_calls(calls)
    assert [(c.prompt_ids, c.ids, c.mask) for c in chains] == [
        ([1], [2], [1]), ([1], [3, 8, 4], [1, 0, 1])]  # fmt: skip


def test_episode_recorder_imposes_the_run_sampling_and_seeds():
    rec = EpisodeRecorder()
    run = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=8, stop=("</calc>",))
    key = rec.open(123, run)
    assert rec.authorize(key) and not rec.authorize("other") and not rec.authorize(None)
    asked = SamplingParams(temperature=1.3, max_new_tokens=50, stop=("x",))
    got = rec.params(key, asked)
    assert (got.temperature, got.top_p, got.max_new_tokens) == (0.7, 0.9, 8)
    assert got.stop == ("x", "</calc>") and rec.overrides == 1
    assert rec.seeds(key, 2, seed=999) == [123, call_seed(123, 1)]
    assert rec.seeds(key, 1, None) == [call_seed(123, 2)]
    rec.record(key, _call([1], [2]))
    assert len(rec.close(key)) == 1 and not rec.authorize(key)
    rec.record(key, _call([1], [2]))
    assert rec.late_calls == 1


def test_batcher_groups_concurrent_requests_into_one_engine_call():
    calls = []

    def generate(prompts, params, seeds):
        calls.append((len(prompts), params.max_new_tokens))
        return [Completion([s] * params.max_new_tokens, [-1.0] * params.max_new_tokens, "length")
                for s in seeds]  # fmt: skip

    batcher = DynamicBatcher(generate, max_batch_samples=64)

    async def main():
        short = SamplingParams(max_new_tokens=2)
        long = SamplingParams(max_new_tokens=5)
        other = SamplingParams(max_new_tokens=5, temperature=0.5)
        return await asyncio.gather(
            batcher.submit([[1]], short, [7]), batcher.submit([[1], [2]], long, [8, 9]),
            batcher.submit([[3]], other, [10]),
        )  # fmt: skip

    a, b, c = asyncio.run(main())
    # equal sampling settings share a call decoded to the longest request, each cut to its own
    assert calls == [(3, 5), (1, 5)]
    assert a == [Completion([7, 7], [-1.0, -1.0], "length")]
    assert [x.ids for x in b] == [[8] * 5, [9] * 5] and c[0].ids == [10] * 5
    batcher.close()


def test_credit_gives_every_sample_of_an_episode_its_episode_advantage():
    # group 0: episode 0 split into 3 samples (reward 1), episode 1 one sample (reward 0)
    batch = Batch({
        "rewards": torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5, 0.5]),
        "group_ids": torch.tensor([0, 0, 0, 0, 1, 1]),
        "episode_ids": torch.tensor([0, 0, 0, 1, 2, 3]),
        "response_mask": torch.ones(6, 2, dtype=torch.long),
    })  # fmt: skip
    out, _ = CreditAssignment(AlgorithmConfig(), 0)(batch, 0)
    per_episode = compute_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1]))
    expected = per_episode[torch.tensor([0, 0, 0, 1, 2, 3])]
    assert torch.allclose(out["advantages"], expected)
    assert out["advantages"][0] > 0 > out["advantages"][3]  # the split counted once: ±0.707
    assert torch.allclose(out["advantages"][:4], torch.tensor([1.0, 1.0, 1.0, -1.0]) * 0.7071,
                          atol=1e-3)  # fmt: skip


def test_the_served_run_stop_strings_hold_for_every_request(tok):
    """A served checkpoint's rollout.stop (a tag call's closing tag) ends a turn whatever stop
    the client sends; the request's own stop strings are added to it."""
    from groupflow.serve.core import ServerCore
    from groupflow.serve.protocol import ChatRequest

    seen = []

    def generate(prompts, params, seeds):
        seen.append(params.stop)
        return [Completion([5], [-1.0], "stop") for _ in prompts]

    core = ServerCore(tok, DynamicBatcher(generate), SamplingParams(stop=("</calc>",)),
                      model_name="m", tool_parser="tag")  # fmt: skip
    for stop in (None, ["x"]):
        req = ChatRequest.model_validate(
            {"messages": [{"role": "user", "content": "q"}], "stop": stop, "max_tokens": 4}
        )
        asyncio.run(core.chat(None, req))
    assert seen == [("</calc>",), ("x", "</calc>")]
    core.batcher.close()


def test_text_stream_holds_back_what_a_stop_string_could_still_cut():
    tok = train_char_tokenizer(string.ascii_lowercase + "</>")
    stream = TextStream(tok, stop=("</x>", "zz"))  # hold = 3 characters
    ids = tok("abcde</x>fg", add_special_tokens=False)["input_ids"]
    pieces = [stream.push([i]) for i in ids]
    # the last 3 characters always wait (they may begin a stop string): d releases a, and so on
    assert pieces[:8] == ["", "", "", "a", "b", "c", "d", "e"]
    assert pieces[8] == "" and stream.stopped  # "</x>" completed: nothing of it, nothing after
    assert pieces[9:] == ["", ""] and stream.sent == "abcde"
    plain = TextStream(tok)  # no stop strings: every character as it comes
    assert [plain.push([i]) for i in tok("ab", add_special_tokens=False)["input_ids"]] == ["a", "b"]


def test_text_stream_waits_for_an_unfinished_character():
    class Bytes:  # decodes like a byte-level tokenizer: an incomplete UTF-8 sequence shows U+FFFD
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    stream = TextStream(Bytes())
    euro = list("€".encode())  # 3 bytes
    assert [stream.push([b]) for b in [ord("a"), *euro]] == ["a", "", "", "€"]
