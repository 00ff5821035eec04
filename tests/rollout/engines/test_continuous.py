"""The continuous decoder: rows that join a running decode at different steps, with different
sampling settings, sample exactly what ``generate`` samples for each of them alone; finished rows
leave; joins write into the preallocated row slots (the buffer is not reallocated or copied);
a prompt that continues a finished row prefills only what is new (the prefix cache), never with
keys/values of other weights; unsupported models and malformed calls are refused."""

import copy
import string

import pytest
import torch

from groupflow.data.tokenizer import train_char_tokenizer
from groupflow.models.causal_lm import build_tiny_llama
from groupflow.rollout.engines.continuous import ContinuousDecoder
from groupflow.rollout.engines.hf import SamplingParams, generate


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    tok = train_char_tokenizer(string.ascii_letters + " ")
    model = build_tiny_llama(
        len(tok), hidden_size=32, num_layers=2, num_heads=4, max_positions=256,
        seed=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    ).eval()  # fmt: skip
    return model, tok


def _alone(model, tok, prompt, params, seed, eos):
    out = generate(model, [prompt], params, seeds=[seed], pad_id=tok.pad_token_id, eos_ids=eos,
                   tokenizer=tok)  # fmt: skip
    m = out.response_mask[0].bool()
    return out.responses[0][m].tolist(), out.logprobs[0][m].tolist(), out.finish_reasons[0]


def test_rows_joining_at_different_steps_sample_what_they_sample_alone(tiny):
    model, tok = tiny
    eos = [tok.eos_token_id]
    texts = ["hello there", "ab", "a much longer prompt than the others", "xyz", "xyz"]
    prompts = [tok(t)["input_ids"] for t in texts]
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=20),
        SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12),
        SamplingParams(temperature=1.3, top_k=6, max_new_tokens=30),
        SamplingParams(temperature=0.0, max_new_tokens=15),
        SamplingParams(temperature=1.0, max_new_tokens=1),  # done at its first token
    ]  # fmt: skip
    seeds = [3, 4, 5, 6, 7]
    d = ContinuousDecoder(model, tok, eos_ids=eos, pad_id=tok.pad_token_id)
    got, seen = {}, {i: [] for i in range(5)}

    def take(result):
        progress, finished = result
        for tag, t in progress:
            seen[tag].append(t)
        for f in finished:
            got[f.tag] = (f.ids, f.logprobs, f.finish)

    take(d.add([prompts[0]], [params[0]], [seeds[0]], [0]))
    for _ in range(3):
        take(d.step())
    assert d.active == 1
    take(d.add(prompts[1:3], params[1:3], seeds[1:3], [1, 2]))  # a longer prompt: the cache widens
    for _ in range(5):
        take(d.step())
    take(d.add(prompts[3:], params[3:], seeds[3:], [3, 4]))
    assert 4 in got and d.active == 4  # the one-token row never joined
    while d.active:
        take(d.step())
    lengths = set()
    for i in range(5):
        ids, lps, finish = _alone(model, tok, prompts[i], params[i], seeds[i], eos)
        assert got[i][0] == ids and got[i][2] == finish, i
        assert got[i][1] == pytest.approx(lps, abs=1e-5)
        assert seen[i] == ids  # every token was reported as it was decoded
        lengths.add(len(ids))
    assert len(lengths) > 2  # rows left at different steps


def test_joins_and_leaves_reuse_the_preallocated_slots(tiny):
    model, tok = tiny
    prompts = [tok(t)["input_ids"] for t in ["a long first prompt", "b", "cd", "efg", "hi", "j"]]
    new = [40, 6, 25, 9, 12, 30]  # rows 1 and 3 end early, freeing slots below live rows
    params = [SamplingParams(temperature=1.0, max_new_tokens=m) for m in new]
    d = ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id, max_rows=4)
    got = {}

    def take(result):
        got.update({f.tag: f for f in result[1]})

    def buffers():
        return [t.data_ptr() for t in (*d.keys, *d.values, d.key_pad)]

    take(d.add(prompts[:1], params[:1], [0], [0]))
    before, slots = buffers(), d.slots
    assert slots == 4
    take(d.step())
    take(d.add(prompts[1:4], params[1:4], [1, 2, 3], [1, 2, 3]))  # into slots 1..3
    assert d.active == 4 and buffers() == before  # written in place: no new buffer, no copy
    for _ in range(10):  # rows 1 and 3 leave; row 2 moves down into slot 1
        take(d.step())
    assert sorted(got) == [1, 3] and d.active == 2 and buffers() == before
    take(d.add(prompts[4:], params[4:], [4, 5], [4, 5]))  # the freed slots again
    assert d.active == 4 and buffers() == before
    take(d.add(prompts[:1], params[:1], [6], [6]))  # a fifth row: the buffer grows
    assert d.slots == 5 and d.active == 5
    while d.active:
        take(d.step())
    for tag in range(7):
        ids, lps, finish = _alone(model, tok, prompts[tag % 6], params[tag % 6], tag, [])
        assert got[tag].ids == ids and got[tag].finish == finish, tag
        assert got[tag].logprobs == pytest.approx(lps, abs=1e-5)
    d.release()
    assert d.slots == 0 and d.keys == []


def test_a_dropped_row_frees_its_slot_for_the_rows_above(tiny):
    model, tok = tiny
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    prompts = [tok(t)["input_ids"] for t in ["abc", "de", "fghij"]]
    d = ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id)
    d.add(prompts, [params] * 3, [0, 1, 2], [0, 1, 2])
    d.step()
    assert d.drop(lambda tag: tag == 0) == 1  # an abandoned request (outside inference mode)
    assert [r.tag for r in d.rows] == [2, 1]  # the last row moved into the freed slot 0
    finished = []
    while d.active:
        finished += d.step()[1]
    for f in finished:
        assert f.ids == _alone(model, tok, prompts[f.tag], params, f.tag, [])[0]
    assert sorted(f.tag for f in finished) == [1, 2]


def test_keys_a_finished_row_left_in_the_buffer_do_not_reach_later_rows(tiny):
    model, tok = tiny
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    long_p, short_p = tok("a much longer prompt")["input_ids"], tok("ab")["input_ids"]
    d = ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id)
    d.add([long_p], [params], [0], [0])
    while d.active:
        d.step()
    with torch.inference_mode():  # what a row that overflowed (inf/NaN keys) would leave behind
        for buf in (*d.keys, *d.values):
            buf[:, :, : d.written] = float("nan")
    finished = d.add([long_p], [params], [1], [1])[1]  # slot 0
    finished += d.add([short_p], [params], [2], [2])[1]  # slot 1: its columns past "ab" are masked
    while d.active:
        finished += d.step()[1]
    short = next(f for f in finished if f.tag == 2)
    ids, lps, _ = _alone(model, tok, short_p, params, 2, [])
    assert short.ids == ids and short.logprobs == pytest.approx(lps, abs=1e-5)


def test_stop_strings_and_repeated_prompts(tiny):
    model, tok = tiny
    prompt = tok("abc")["input_ids"]
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop=("a", "e"))
    d = ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id)
    finished = d.add([prompt] * 3, [params] * 3, [11, 12, 13], ["x", "y", "z"])[1]
    while d.active:
        finished += d.step()[1]
    by_tag = {f.tag: f for f in finished}
    stops = 0
    for tag, seed in zip("xyz", [11, 12, 13]):
        ids, _, finish = _alone(model, tok, prompt, params, seed, [])
        assert by_tag[tag].ids == ids and by_tag[tag].finish == finish
        stops += finish == "stop"
    assert stops >= 1  # the stop strings did end a row


def test_unsupported_models_and_bad_calls_are_refused(tiny):
    import transformers

    model, tok = tiny
    config = transformers.GPT2Config(vocab_size=20, n_embd=32, n_layer=1, n_head=4, n_positions=64)
    with pytest.raises(ValueError, match="gpt2"):
        ContinuousDecoder(transformers.GPT2LMHeadModel(config), tok, eos_ids=[], pad_id=0)
    d = ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id)
    with pytest.raises(ValueError, match="one params, seed and tag per prompt"):
        d.add([[5, 6]], [SamplingParams()], [1, 2], ["a"])
    with pytest.raises(ValueError, match="max_rows"):
        ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id, max_rows=0)
    with pytest.raises(ValueError, match="prefix_tokens"):
        ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id, prefix_tokens=-1)
    assert d.step() == ([], [])  # nothing to decode


def _finish(d, joins) -> dict:
    """Each join ``(prompts, params, seeds, tags)`` two steps after the previous one; every row
    decoded to its end."""
    got = {}
    for k, (prompts, params, seeds, tags) in enumerate(joins):
        got.update({f.tag: f for f in d.add(prompts, params, seeds, tags)[1]})
        for _ in range(2 if k + 1 < len(joins) else 0):
            got.update({f.tag: f for f in d.step()[1]})
    while d.active:
        got.update({f.tag: f for f in d.step()[1]})
    return got


@pytest.fixture(scope="module")
def gqa(tiny):
    """A Llama with grouped-query attention (2 key/value heads for 4 query heads: SmolLM2's 3
    for 9), the cache layout the prefix cache must keep as the model wrote it."""
    import transformers

    tok = tiny[1]
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval(), tok


@pytest.mark.parametrize("which", ["tiny", "gqa"])
def test_a_continued_conversation_prefills_only_its_new_turn(which, request):
    model, tok = request.getfixturevalue(which)
    prompts = [tok(t)["input_ids"] for t in ["first question", "ab", "a third one"]]
    params = [SamplingParams(temperature=1.0, max_new_tokens=m) for m in (9, 14, 6, 11)]
    d = ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id)
    got = _finish(
        d, [(prompts[:1], params[:1], [0], [0]), (prompts[1:], params[1:3], [1, 2], [1, 2])]
    )
    assert d.reused_tokens == 0 and len(d.kept) == 3
    turn = tok(" and then")["input_ids"]
    more = [prompts[i] + got[i].ids + turn for i in range(3)] + [tok("fresh")["input_ids"]]
    # joins that mix a continued row with a fresh one, and prefixes of different lengths
    again = _finish(d, [([more[0], more[3]], [params[0], params[3]], [10, 13], [0, 3]),
                        (more[1:3], params[1:3], [11, 12], [1, 2])])  # fmt: skip
    # every continued row skipped its fed tokens: the prompt and all its sampled ids but the last
    assert d.reused_tokens == sum(len(prompts[i]) + len(got[i].ids) - 1 for i in range(3))
    for i, seed in enumerate([10, 11, 12, 13]):
        ids, lps, finish = _alone(model, tok, more[i], params[i], seed, [])
        assert again[i].ids == ids and again[i].finish == finish, i
        assert again[i].logprobs == pytest.approx(lps, abs=1e-5)


def test_kept_keys_of_other_weights_are_never_used(tiny):
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    prompt = tok("hello")["input_ids"]
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    d = ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id)
    first = _finish(d, [([prompt], [params], [0], [0])])[0]
    assert len(d.kept) == 1
    with torch.no_grad():  # an optimizer step writes the weights in place
        model.lm_head.weight.mul_(1.5)
    more = prompt + first.ids + tok(" more")["input_ids"]
    got = _finish(d, [([more], [params], [1], [1])])[1]
    assert d.reused_tokens == 0  # the kept keys were computed by the old weights
    ids, lps, _ = _alone(model, tok, more, params, 1, [])
    assert got.ids == ids and got.logprobs == pytest.approx(lps, abs=1e-5)
    # nor after a cast (module.to swaps each parameter's storage without a version bump)
    again = _finish(d, [([more], [params], [1], [1])])[1]
    assert d.reused_tokens == 0 and len(d.kept) == 2
    model.double()
    more2 = more + again.ids + tok(" and")["input_ids"]
    got = _finish(d, [([more2], [params], [3], [3])])[3]
    assert d.reused_tokens == 0
    ids, lps, _ = _alone(model, tok, more2, params, 3, [])
    assert got.ids == ids and got.logprobs == pytest.approx(lps, abs=1e-9)
    model.float()
    # a row whose weights change while it decodes is not kept either
    d.release()
    d.add([prompt], [params], [2], [2])
    d.step()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(0.01)
    while d.active:
        d.step()
    assert len(d.kept) == 0


def test_the_prefix_cache_keeps_the_most_recently_used_within_its_budget(tiny):
    model, tok = tiny
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    prompts = [tok(t)["input_ids"] for t in ["abcdef", "ghijkl", "mnopqr"]]  # 6 + 4 fed each
    d = ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id, prefix_tokens=25)
    got = {}
    for i in range(3):  # one after another: the first is the least recently used
        got.update(_finish(d, [([prompts[i]], [params], [i], [i])]))
    assert [k.ids for k in d.kept.values()] == [prompts[i] + got[i].ids[:-1] for i in (1, 2)]
    assert d.kept_tokens == 20
    one = SamplingParams(temperature=1.0, max_new_tokens=1)  # done at its first token: not kept
    _finish(d, [([prompts[0] + got[0].ids + [5]], [one], [7], [7])])
    assert d.reused_tokens == 0  # evicted
    _finish(d, [([prompts[1] + got[1].ids + [5]], [one], [8], [8])])
    assert d.reused_tokens == 10
    assert [k.ids[0] for k in d.kept.values()] == [prompts[2][0], prompts[1][0]]  # used: last
    off = ContinuousDecoder(model, tok, eos_ids=[], pad_id=tok.pad_token_id, prefix_tokens=0)
    _finish(off, [([prompts[0]], [params], [0], [0])])
    assert len(off.kept) == 0
