"""Multi-turn episodes, token-in/token-out: the ids trained are the ids sampled plus the
observation ids, observations are masked out, recomputed log-probs equal the sampling ones, and
every limit and failure ends a sample the documented way."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch

from groupflow.agents.environments import ToolEnvironment
from groupflow.agents.formats import PlainFormat
from groupflow.agents.parsers import build_parser
from groupflow.agents.tools import build_tools
from groupflow.config import ActorConfig
from groupflow.data.datasets import load_prompt_rows
from groupflow.data.tokenizer import train_char_tokenizer
from groupflow.models.causal_lm import build_tiny_llama
from groupflow.rollout.engines.base import HFEngine
from groupflow.rollout.engines.batching import generate_batch
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.workers.update import batch_logprobs
from groupflow.workflows.episodes import EpisodeLimits, episodes_batch, run_episodes

TEXT = "mul 123*45 = <calc>1234567890</calc>=\n abcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    tok = train_char_tokenizer(TEXT)
    model = build_tiny_llama(
        len(tok), hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
        max_positions=128, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, seed=0,
    )  # fmt: skip
    # A random model rarely ends a turn; a head bias toward EOS (applied wherever the head runs:
    # sampling and the training forward alike) gives multi-turn episodes of a few tokens a turn.
    bias = torch.zeros(len(tok))
    bias[tok.eos_token_id] = 2.5
    model.get_output_embeddings().register_forward_hook(lambda m, i, out: out + bias)
    return model.eval(), tok


@pytest.fixture
def helpers(helpers_on_path):
    return importlib.import_module("agent_helpers")


class Recorder:
    """The rollout group's ``generate``, recording every turn's sampled ids per sample."""

    def __init__(self, model, tok):
        self.model, self.tok, self.calls = model, tok, []

    def __call__(self, batch, params, width):
        engine = HFEngine(self.model, self.tok, eos_ids=[self.tok.eos_token_id],
                          pad_id=self.tok.pad_token_id)  # fmt: skip
        out = generate_batch(engine, self.tok.pad_token_id, batch, params, width)
        self.calls.append((batch, params, out))
        return out


def _rows(n=2):
    data = [{"prompt": f"mul {100 + i}*45 =", "target": "1"} for i in range(n)]
    return list(load_prompt_rows(data))


def _run(lm, make_env, limits, n=3, rows=None, seeds=None, params=None):
    model, tok = lm
    rows = rows or _rows()
    ids = [tok(r.prompt)["input_ids"] for r in rows]
    seeds = seeds or list(range(100, 100 + len(rows) * n))
    gen = Recorder(model, tok)
    episodes = run_episodes(
        rows, ids, seeds, list(range(len(rows))), n=n, generate=gen,
        params=params or SamplingParams(max_new_tokens=limits.max_new_tokens, temperature=1.0),
        make_env=make_env, fmt=PlainFormat(tok, "={content}\n"), tokenizer=tok, limits=limits,
    )  # fmt: skip
    return episodes, gen


def test_trained_ids_are_the_sampled_ids_and_logprobs_recompute(lm, helpers):
    model, tok = lm
    limits = EpisodeLimits(max_turns=3, max_new_tokens=5, max_response_tokens=40)
    episodes, gen = _run(lm, lambda: helpers.CountdownEnv(turns=5), limits)
    # every sample's model tokens, turn by turn, are exactly what generate returned for it
    for e in episodes:
        assert len(e.turn_texts) >= 1
    assert any(len(e.turn_texts) > 1 for e in episodes)
    batch = episodes_batch(episodes, tok.pad_token_id, limits.max_response_tokens)
    for i, e in enumerate(episodes):
        width = len(e.ids)
        row = batch["responses"][i, :width].tolist()
        assert row == e.ids
        mask = batch["response_mask"][i, :width].tolist()
        assert mask == e.mask and sum(mask) == width - e.observation_tokens
        # observation tokens are the environment's answers, tokenized alone
        obs = [t for t, m in zip(row, mask) if m == 0]
        expected = "".join(f"=left {k}\n" for k in range(4, 4 - (len(e.turn_texts) - 1), -1))
        assert tok.decode(obs) == expected
    # the log-probs of the training forward over the whole sequence equal the sampling ones
    recomputed = batch_logprobs(model, batch, 1.0, ActorConfig(), torch.device("cpu"))["logprobs"]
    m = batch["response_mask"].bool()
    assert (recomputed[m] - batch["rollout_logprobs"][m]).abs().max() < 1e-5
    assert batch["rollout_logprobs"][~m].abs().sum() == 0


def test_in_flight_token_versions_follow_each_model_token_through_turns(lm, helpers):
    """rollout.async_mode=in_flight: an engine whose version rises at every decode step (no
    weights change: only the bookkeeping is under test). In the batch, every model token has
    its version, observations and padding -1, and along an episode the versions only rise —
    the turns' tokens in sampling order, each observation in between."""
    model, tok = lm
    limits = EpisodeLimits(max_turns=3, max_new_tokens=5, max_response_tokens=40)
    clock = iter(range(10**6))

    class Rising(Recorder):
        def __call__(self, batch, params, width):
            engine = HFEngine(self.model, self.tok, eos_ids=[self.tok.eos_token_id],
                              pad_id=self.tok.pad_token_id)  # fmt: skip
            engine.updates = lambda: (next(clock), None)
            out = generate_batch(engine, self.tok.pad_token_id, batch, params, width)
            self.calls.append((batch, params, out))
            return out

    rows = _rows()
    gen = Rising(model, tok)
    episodes = run_episodes(
        rows, [tok(r.prompt)["input_ids"] for r in rows], list(range(100, 106)), [0, 1], n=3,
        generate=gen, params=SamplingParams(max_new_tokens=5, temperature=1.0),
        make_env=lambda: helpers.CountdownEnv(turns=5), fmt=PlainFormat(tok, "={content}\n"),
        tokenizer=tok, limits=limits,
    )  # fmt: skip
    assert any(e.observation_tokens for e in episodes)
    batch = episodes_batch(episodes, tok.pad_token_id, limits.max_response_tokens)
    versions, mask = batch["token_versions"], batch["response_mask"].bool()
    assert (versions[~mask] == -1).all() and (versions[mask] >= 0).all()
    for i, e in enumerate(episodes):
        row = versions[i, : len(e.ids)][mask[i, : len(e.ids)]].tolist()
        assert len(row) == len(e.ids) - e.observation_tokens
        assert row == sorted(set(row)), row  # one decode step per token, in order
    # each call's versions are those its generate recorded for the rows it decoded
    recorded = {v for _, _, out in gen.calls for v in out["token_versions"].flatten().tolist()}
    assert set(versions[mask].tolist()) <= recorded


def test_each_turn_samples_from_the_whole_context(lm, helpers):
    """Turn k's prompt is the prompt + everything so far (model and observation tokens)."""
    limits = EpisodeLimits(max_turns=3, max_new_tokens=4, max_response_tokens=40)
    episodes, gen = _run(lm, lambda: helpers.CountdownEnv(turns=5), limits, n=2)
    last_batch, _, _ = gen.calls[-1]
    contexts = [list(c) for c in last_batch["prompt_token_ids"]]
    assert len(gen.calls) >= 2, "the fixture's EOS bias should give episodes a second turn"
    live = [e for e in episodes if len(e.turn_texts) == len(gen.calls)]
    assert len(live) == len(contexts) > 0
    for e, ctx in zip(live, contexts):
        last_turn = e.ids[len(ctx) - len(e.prompt_ids) :]
        assert ctx == e.prompt_ids + e.ids[: len(ctx) - len(e.prompt_ids)]
        assert e.mask[len(ctx) - len(e.prompt_ids) :] == [1] * len(last_turn)
        assert 0 < len(last_turn) <= limits.max_new_tokens


def test_a_sample_does_not_depend_on_its_batch(lm, helpers):
    limits = EpisodeLimits(max_turns=3, max_new_tokens=4, max_response_tokens=30)
    rows = _rows(3)
    together, _ = _run(lm, lambda: helpers.CountdownEnv(turns=5), limits, n=2, rows=rows,
                       seeds=[7, 8, 9, 10, 11, 12])  # fmt: skip
    alone, _ = _run(lm, lambda: helpers.CountdownEnv(turns=5), limits, n=2, rows=rows[1:2],
                    seeds=[9, 10])  # fmt: skip
    assert [e.ids for e in together[2:4]] == [e.ids for e in alone]
    again, _ = _run(lm, lambda: helpers.CountdownEnv(turns=5), limits, n=2, rows=rows,
                    seeds=[7, 8, 9, 10, 11, 12])  # fmt: skip
    assert [e.ids for e in together] == [e.ids for e in again]


def test_limits_end_episodes(lm, helpers):
    # the environment never ends: the turn limit does
    episodes, _ = _run(lm, lambda: helpers.CountdownEnv(turns=99), EpisodeLimits(2, 8, 80), n=4)
    assert all(len(e.turn_texts) <= 2 for e in episodes)
    assert {e.finish for e in episodes} <= {"max_turns", "length"}  # a turn cut at 8 tokens: length
    assert any(e.finish == "max_turns" for e in episodes)
    assert all(len(e.turn_texts) == 2 for e in episodes if e.finish == "max_turns")
    # the response budget: model + observation tokens never exceed it
    episodes, _ = _run(lm, lambda: helpers.CountdownEnv(turns=99), EpisodeLimits(9, 6, 14), n=2)
    assert all(len(e.ids) <= 14 for e in episodes)
    assert any(e.finish == "length" for e in episodes)


def test_long_observations_are_cut_and_marked(lm):
    class Verbose:
        def reset(self, row):
            return None

        def step(self, text):
            return ("x" * 200, 0.0, False)

    limits = EpisodeLimits(max_turns=2, max_new_tokens=10, max_response_tokens=60,
                           max_observation_tokens=20)  # fmt: skip
    episodes, _ = _run(lm, Verbose, limits, n=4)
    cut = [e for e in episodes if e.observation_tokens]
    assert cut and all(e.observation_tokens <= 20 for e in cut)
    assert all(
        m["content"].endswith("…[cut]") for e in cut for m in e.messages if m["role"] == "user"
    )


def test_a_huge_observation_is_cut_before_it_is_tokenized(lm, monkeypatch):
    class Flood:
        def reset(self, row):
            return None

        def step(self, text):
            return ("y" * 1_000_000, 0.0, False)

    seen = []  # the longest text each tokenization of an observation got
    real = PlainFormat.observation_ids

    def observation_ids(self, messages, last):
        seen.append(max(len(m["content"]) for m in messages))
        return real(self, messages, last)

    monkeypatch.setattr(PlainFormat, "observation_ids", observation_ids)
    default = EpisodeLimits(max_turns=2, max_new_tokens=10, max_response_tokens=60)
    episodes, _ = _run(lm, Flood, default, n=2)
    assert seen and max(seen) == 16 * 60 + len(" …[cut]")  # 16 characters per token of budget
    seen.clear()
    capped = replace(default, max_observation_tokens=20, max_observation_chars=100)
    episodes, _ = _run(lm, Flood, capped, n=2)
    assert seen[0] == 100 + len(" …[cut]") and max(seen) <= seen[0]
    stepped = [e for e in episodes if e.observation_tokens]
    assert stepped and all(e.observation_tokens <= 20 for e in stepped)


def test_cap_chars_shares_the_cap_between_messages():
    from groupflow.workflows.episodes import cap_chars

    msgs = [{"role": "tool", "content": "abcdef"}, {"role": "tool", "content": "ghij"}]
    assert cap_chars(msgs, 10) == msgs
    assert [m["content"] for m in cap_chars(msgs, 8)] == ["abcdef", "gh …[cut]"]
    assert [m["content"] for m in cap_chars(msgs, 4)] == ["abcd …[cut]", " …[cut]"]
    assert cap_chars(msgs, 4)[1]["role"] == "tool"


@pytest.mark.parametrize("env, kind", [("RaisingEnv", "error"), ("HangingEnv", "timeout"),
                                       ("GarbageEnv", "invalid")])  # fmt: skip
def test_environment_failures_end_the_sample_only(lm, helpers, env, kind):
    limits = EpisodeLimits(
        max_turns=3, max_new_tokens=10, max_response_tokens=30, env_timeout_s=0.3
    )
    episodes, _ = _run(lm, getattr(helpers, env), limits, n=4)
    stepped = [e for e in episodes if e.finish != "length"]  # a turn cut by its limit never steps
    assert stepped and all(e.finish == "env_failure" and e.failure_kind == kind for e in stepped)
    assert all(len(e.turn_texts) == 1 for e in episodes)  # the model's turn is kept


def test_reset_must_agree_within_a_group(lm, helpers):
    with pytest.raises(ValueError, match="reset returned different first observations.*row 0"):
        _run(lm, helpers.RandomResetEnv, EpisodeLimits(2, 3, 20), n=2)


def test_first_observation_extends_the_prompt(lm, helpers):
    _, tok = lm
    episodes, _ = _run(lm, helpers.AsyncEchoEnv, EpisodeLimits(2, 3, 30), n=2)
    for e in episodes:
        assert tok.decode(e.prompt_ids).endswith(f"={'start ' + e.row.prompt}\n")
        assert e.messages[0] == {"role": "user", "content": f"start {e.row.prompt}"}


def test_tool_episode_end_to_end(lm):
    """A scripted policy that calls the calculator, then answers: the tool's result lands between."""
    _, tok = lm
    script = ["<calc>123*45</calc>", "5535"]

    def scripted(batch, params, width):
        rows = len(batch["prompt_token_ids"]) * params.n
        turn = 0 if params.n > 1 or len(batch["prompt_token_ids"][0]) < 20 else 1
        ids = tok(script[turn], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        t = max(params.max_new_tokens, len(ids))
        responses = torch.full((rows, t), tok.pad_token_id)
        responses[:, : len(ids)] = torch.tensor(ids)
        mask = torch.zeros((rows, t), dtype=torch.long)
        mask[:, : len(ids)] = 1
        from groupflow.batch import Batch

        return Batch({"responses": responses, "response_mask": mask,
                      "rollout_logprobs": -mask.float()}, {"finish_reason": ["stop"] * rows})  # fmt: skip

    tools = build_tools([{"name": "calculator", "label": "calc"}])
    rows = _rows(1)
    episodes = run_episodes(
        rows, [tok(rows[0].prompt)["input_ids"]], [1, 2], [0], n=2, generate=scripted,
        params=SamplingParams(max_new_tokens=24), make_env=lambda: ToolEnvironment(tools, build_parser("tag")),
        fmt=PlainFormat(tok, "={content}\n"), tokenizer=tok, limits=EpisodeLimits(3, 24, 80),
    )  # fmt: skip
    for e in episodes:
        assert e.turn_texts == script and e.finish == "stop"
        assert tok.decode([t for t, m in zip(e.ids, e.mask) if m == 0]) == "=5535\n"
        assert e.env.stats["tool_calls"] == 1
        assert [m["role"] for m in e.messages] == ["assistant", "tool", "assistant"]
