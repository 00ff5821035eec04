"""The agent workflow on a tiny model: agents written against the ``openai`` client train through
the run's in-process server (127.0.0.1, one torch thread, agent_timeout_s bounds every episode).
For every recorded call the ids trained are the ids the client was sent, and the training
forward's log-probs equal the sampling log-probs; calls merge into one sample when the
conversation continues, split (sharing the episode's advantage) when it was edited; failing
agents get reward.failure_value, counted per kind; config errors name the key."""

import math
import sys
from pathlib import Path

import pytest
import torch

from groupflow.config import ConfigError, config_from_dict
from groupflow.policies.llm import model_inputs

openai = pytest.importorskip("openai", reason="needs the openai package (pip install openai)")

TESTS = str(__import__("pathlib").Path(__file__).resolve().parents[1])
# The Ray tests here reserve 1 logical CPU (one worker, or a half-CPU actor and pool worker):
# shared_ray reuses an instance of 3, what a run here starts on 2 cores (pool_ray's first run)
RAY_CPUS = 3


def _agent_config(tiny_base, out, **overrides):
    base, with_overrides = tiny_base
    d = with_overrides(base(out), {
        "model.tiny.max_positions": 256, "data.task": {"name": "calc", "digits": 2,
                                                       "num_train": 64, "num_val": 4},
        "data.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
        "rollout.max_new_tokens": 8, "rollout.max_response_tokens": 64,
        "rollout.workflow": "agent", "rollout.agent": "serve_agents:two_calls",
        "rollout.agent_timeout_s": 5, "reward.failure_value": -1.0, "serve.describe_tools": False,
        "rollout.tool_parser": "tag", **overrides,
    })  # fmt: skip
    return config_from_dict(d, "<agent test>")


@pytest.fixture(scope="module")
def agents():
    sys.path.insert(0, TESTS)
    import serve_agents

    yield serve_agents
    sys.path.remove(TESTS)


@pytest.fixture(scope="module")
def trainer(agents, tiny_base, tmp_path_factory):
    from groupflow.trainer import Trainer

    torch.set_num_threads(1)
    t = Trainer(_agent_config(tiny_base, tmp_path_factory.mktemp("agent")))
    yield t
    t.workflow.close()
    t.policy.shutdown()


def _collect(trainer, agents, agent: str):
    from groupflow.workflows.agent import resolve_agent

    wf = trainer.workflow
    wf.agent = resolve_agent(f"serve_agents:{agent}")
    agents.SEEN.clear()
    batch, metrics = wf.collect(wf.train_rows[:2], 0, 0, 0)
    return batch, metrics


def _trained(batch, i):
    m = batch["response_mask"][i].bool()
    return batch["responses"][i][m].tolist(), batch["rollout_logprobs"][i][m].tolist()


def _check_training_forward(trainer, batch, atol=1e-5):
    t = trainer.policy.sampling.temperature
    forward = trainer.policy.actor.compute_logprobs(model_inputs(batch), temperature=t)["logprobs"]
    mask = batch["response_mask"].bool()
    assert mask.sum() > 0
    assert torch.allclose(forward[mask], batch["rollout_logprobs"][mask], atol=atol)


def test_a_continued_conversation_is_one_sample_of_exactly_the_sampled_tokens(trainer, agents):
    batch, m = _collect(trainer, agents, "two_calls")
    n_episodes = 4
    assert len(batch) == n_episodes and batch["episode_ids"].tolist() == [0, 1, 2, 3]
    assert m["rollout/agent/samples_per_episode"] == 1 and m["rollout/agent/calls/mean"] == 2
    assert m["rollout/agent/split_episodes"] == 0
    # the first call asked for temperature 1.7; the run's 1.0 was used (what training assumes)
    assert m["rollout/agent/sampling_overrides"] == n_episodes
    _check_trained_equals_seen(batch, agents.SEEN, n_episodes)
    _check_training_forward(trainer, batch)
    assert torch.equal(batch["rewards"], batch["rewards"].clamp(0, 1))  # the agents' 0/1 values
    # each second call prefilled only its new turn: its first call's prompt and sampled ids but
    # the last (never fed) came from the prefix cache (a one-token answer is never decoded on)
    heads = [s["prompt_ids"] + s["ids"] for s in agents.SEEN]
    continued = [h for h in heads if any(s["prompt_ids"][: len(h)] == h for s in agents.SEEN)]
    assert len(continued) == n_episodes
    assert m["rollout/agent/prefix_cached_tokens"] == sum(
        len(h) - 1 for h, s in zip(heads, agents.SEEN) if h in continued and len(s["ids"]) > 1
    )


def _check_trained_equals_seen(batch, seen, n_episodes):
    assert len(seen) == 2 * n_episodes and len(batch) == n_episodes
    _check_samples_are_the_calls(batch, seen)


def _check_samples_are_the_calls(batch, seen):
    """Each episode (two calls, the second continuing the first) is one sample whose ids are
    exactly the two completions the client was sent, with the tokens in between masked."""
    for i in range(len(batch)):
        ids, lps = _trained(batch, i)
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        # the call this sample starts with, then the call that continued it (2 episodes per row
        # share a prompt: told apart by their sampled ids)
        first = next(
            s for s in seen if s["prompt_ids"] == prompt and ids[: len(s["ids"])] == s["ids"]
        )
        head = prompt + first["ids"]
        second = next(s for s in seen if s["prompt_ids"][: len(head)] == head)
        # trained ids = the first completion, the tokens in between (masked), the second completion
        assert ids == first["ids"] + second["ids"]
        assert lps == pytest.approx(first["logprobs"] + second["logprobs"], abs=1e-6)
        between = second["prompt_ids"][len(prompt) + len(first["ids"]) :]
        row = batch["responses"][i][: len(first["ids"]) + len(between)].tolist()
        assert row == first["ids"] + between


def test_token_in_completions_merge_too(trainer, agents):
    batch, m = _collect(trainer, agents, "completions_api")
    assert m["rollout/agent/samples_per_episode"] == 1
    for i in range(4):
        ids, _ = _trained(batch, i)
        seen = next(s for s in agents.SEEN if ids == s["first"] + s["second"])
        first = seen["first"]  # then the prompt's extra token [5], masked out
        assert batch["response_mask"][i][: len(first) + 1].tolist() == [1] * len(first) + [0]
        assert batch["responses"][i][len(first)] == 5
    _check_training_forward(trainer, batch)
    assert batch["rewards"].tolist() == [0.5] * 4


def test_an_edited_history_splits_the_episode_and_shares_its_advantage(trainer, agents):
    from groupflow.credit import CreditAssignment

    batch, m = _collect(trainer, agents, "edits_history")
    assert len(batch) == 8 and m["rollout/agent/split_episodes"] == 4
    assert m["rollout/agent/samples_per_episode"] == 2 and m["rollout/agent/edits"] == 1
    assert batch["episode_ids"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    for i in range(8):  # each sample is one call, exactly as sampled
        ids, lps = _trained(batch, i)
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        assert any(s["prompt_ids"] == prompt and s["ids"] == ids for s in agents.SEEN)
    _check_training_forward(trainer, batch)
    adv, _ = CreditAssignment(trainer.cfg.algorithm, 0)(batch, 0)
    a = adv["advantages"].view(4, 2)
    assert torch.equal(a[:, 0], a[:, 1])


@pytest.mark.parametrize("agent, kind", [("raises", "raised"), ("sleeps", "timeout"),
                                         ("no_call", "no_call"), ("bad_return", "invalid")])  # fmt: skip
def test_failing_agents_get_the_failure_value_and_are_counted(trainer, agents, agent, kind, caplog):
    batch, m = _collect(trainer, agents, agent)
    assert batch["rewards"].tolist() == [-1.0] * 4
    assert m["rollout/agent/failures"] == 4 and m[f"rollout/agent/failures/{kind}"] == 4
    assert len(batch) == 4  # every episode still counts in its group


def _collect_within(trainer, agents, agent: str, seconds: float):
    """``_collect`` in a thread given ``seconds``: a hang fails the test instead of the suite."""
    import threading

    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(r=_collect(trainer, agents, agent)),
                              daemon=True)  # fmt: skip
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"collect with agent {agent!r} still running after {seconds} s"
    return out["r"]


@pytest.mark.parametrize("agent", ["exits", "interrupts_in_a_task"])
def test_an_agent_raising_systemexit_or_keyboardinterrupt_is_a_counted_failure(
    trainer, agents, agent
):
    """Any BaseException of an agent (asyncio lets SystemExit/KeyboardInterrupt out of the loop)
    is that episode's `raised` failure; the other episodes and the next collect go on."""
    batch, m = _collect_within(trainer, agents, agent, 60)
    assert m["rollout/agent/failures/raised"] == 2 and m["rollout/agent/failures"] == 2
    assert sorted(batch["rewards"].tolist()) == [-1.0, -1.0, 1.0, 1.0]
    _, m = _collect_within(trainer, agents, "two_calls", 60)  # the loop still runs
    assert m["rollout/agent/failures"] == 0


def test_calls_beyond_agent_max_calls_are_refused_and_the_episode_fails(
    trainer, agents, monkeypatch
):
    monkeypatch.setattr(trainer.workflow.cfg.rollout, "agent_max_calls", 3)
    batch, m = _collect(trainer, agents, "calls_on")
    assert m["rollout/agent/failures/max_calls"] == 4 and m["rollout/agent/failures"] == 4
    assert m["rollout/agent/calls/mean"] == 3  # the refused calls were never sampled
    assert len(batch) == 4 * 3 and batch["rewards"].tolist() == [-1.0] * 12  # each call a sample


def test_an_agent_blocking_the_event_loop_fails_alone_at_its_timeout(trainer, agents):
    """Sync code in an async agent (it would hold the loop 30 s): that episode alone fails at
    rollout.agent_timeout_s (5 s), the others are not charged for it and succeed."""
    import time

    agents.RELEASE.clear()
    try:
        start = time.monotonic()
        batch, m = _collect_within(trainer, agents, "blocks_every_other", 25)
        assert time.monotonic() - start < 20
        assert m["rollout/agent/failures/blocked"] == 2 and m["rollout/agent/failures"] == 2
        assert sorted(batch["rewards"].tolist()) == [-1.0, -1.0, 1.0, 1.0]
        _, m = _collect_within(trainer, agents, "two_calls", 30)  # a fresh loop serves on
        assert m["rollout/agent/failures"] == 0
    finally:
        agents.RELEASE.set()


def test_a_loop_that_stays_blocked_stops_the_run_with_a_named_error(trainer, agents, monkeypatch):
    from groupflow.workflows import agent as agent_module

    wf = trainer.workflow
    monkeypatch.setattr(wf.cfg.rollout, "agent_timeout_s", 1.0)
    monkeypatch.setattr(agent_module, "MAX_BLOCKED_LOOPS", 2)
    monkeypatch.setattr(wf, "_blocked", agent_module.Abandoned())
    agents.RELEASE.clear()
    try:
        with pytest.raises(agent_module.AgentBlockedError, match="serve_agents.py:.* in helper"):
            _collect(trainer, agents, "blocks_in_a_task")  # helper tasks name their episode
    finally:
        agents.RELEASE.set()
    _, m = _collect_within(trainer, agents, "two_calls", 30)
    assert m["rollout/agent/failures"] == 0


def test_reward_functions_score_the_final_conversation(agents, tiny_base, tmp_path):
    from groupflow.trainer import Trainer

    cfg = _agent_config(
        tiny_base, tmp_path, **{"rollout.agent": "serve_agents:no_reward",
                                "rollout.agent_reward": "functions",
                                "reward.functions": [{"function": "serve_agents:messages_reward"}]},
    )  # fmt: skip
    t = Trainer(cfg)
    try:
        batch, _ = t.workflow.collect(t.workflow.train_rows[:2], 0, 0, 0)
    finally:
        t.workflow.close()
        t.policy.shutdown()
    # user, assistant, tool/user, assistant = 4 messages; 2 calls
    assert batch["rewards"].tolist() == [24.0] * 4
    assert [len(m) for m in batch["messages"]] == [4] * 4


def test_two_training_steps_through_the_server(agents, tiny_base, tmp_path):
    from groupflow.trainer import Trainer

    t = Trainer(_agent_config(tiny_base, tmp_path, **{"run.total_steps": 2}))
    try:
        final = t.fit()
    finally:
        t.workflow.close()
    assert final["rollout/agent/calls/mean"] == 2 and "val/greedy/acc" in final
    assert final["weights/bytes_via_driver"] == 0


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"rollout.agent": None}, "rollout.workflow=agent and rollout.agent go together"),
        ({"rollout.workflow": "auto"}, "set rollout.workflow=agent"),
        ({"rollout.tools": [{"name": "calculator"}]}, "the agent brings its own tools"),
        ({"rollout.agent_concurrency": 0}, "agent_concurrency"),
        ({"serve.prefix_cache_tokens": -1}, "serve.prefix_cache_tokens"),
    ],
)
def test_config_errors_name_the_key(tiny_base, tmp_path, overrides, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        _agent_config(tiny_base, tmp_path, **overrides)


def test_the_agent_must_be_an_async_function_of_client_and_row(agents):
    from groupflow.workflows.agent import resolve_agent

    with pytest.raises(
        ValueError, match="rollout.agent: 'serve_agents:sync_agent' must be an async"
    ):
        resolve_agent("serve_agents:sync_agent")
    with pytest.raises(ValueError, match="rollout.agent"):
        resolve_agent("serve_agents:missing")


def test_warm_start_plays_demonstrations_through_the_agent(tiny_base, tmp_path):
    """The server answers the agent's calls with the row's demonstrated turns: the calculator's
    result and the chat template's tool turn come from the real agent, masked out of the loss."""
    from types import SimpleNamespace

    from groupflow.trainer import Trainer

    agent = Path(__file__).resolve().parents[2] / "examples/agents/calc_agent.py"
    cfg = _agent_config(tiny_base, tmp_path, **{
        "rollout.agent": f"{agent}:calc_agent", "rollout.stop": ["</calc>"],
        "rollout.max_new_tokens": 16, "sft.target_field": "demo",
    })  # fmt: skip
    t = Trainer(cfg)
    try:
        wf, tok = t.workflow, t.policy.tokenizer
        rows = wf.train_rows[:6]
        examples = wf.sft_examples(SimpleNamespace(rows=rows))
    finally:
        t.workflow.close()
        t.policy.shutdown()
    assert len(examples) == len(rows)
    for row, (prompt, target, mask) in zip(rows, examples):
        assert tok.decode(prompt) == f"user: {row.prompt}\nassistant:"
        answer = row.fields["answer"]
        trained = tok.decode([i for i, m in zip(target, mask) if m])
        if len(row.fields["demo"]) == 2:  # call, then the answer copied from the tool's result
            call = row.fields["demo"][0]
            assert tok.decode(target) == f"{call}\ntool: {answer}\nassistant:{answer}<eos>"
            assert trained == f"{call}{answer}<eos>"
        else:
            assert tok.decode(target) == trained == f"{answer}<eos>"


@pytest.mark.slow
def test_asynchronous_rollout_runs_the_server_on_the_rollout_side(agents, tiny_base, tmp_path):
    """max_staleness 1: the rollout side (a child process) builds its own workflow and server."""
    from groupflow.trainer import Trainer

    cfg = _agent_config(tiny_base, tmp_path, **{"rollout.max_staleness": 1, "run.total_steps": 3})
    t = Trainer(cfg)
    try:
        final = t.fit()
    finally:
        t.workflow.close()
    assert final["rollout/agent/calls/mean"] == 2 and final["rollout/agent/failures"] == 0
    assert final["rollout/agent/samples_per_episode"] == 1


@pytest.mark.slow
def test_in_flight_updates_reach_the_agents_server_between_decode_steps(
    agents, tiny_base, tmp_path, monkeypatch
):
    """rollout.async_mode=in_flight with the agent workflow (the rollout side in a thread, its
    server's continuous decoder taking versions through the engine): version 1 reaches step 1's
    episodes at the decoder's 4th step, pinned as in tests/rollout/test_hosts.py. Every sampled
    token records the version that sampled it (0, then 1), what lies between the calls -1; an
    episode's versions never go back; a sample is as old as its oldest token; the metrics count
    the switch."""
    from tests.rollout.test_hosts import _fit, _PinnedSwitch

    pin = _PinnedSwitch(monkeypatch)
    rows = _fit(_agent_config(tiny_base, tmp_path, **{
        "rollout.max_staleness": 1, "rollout.async_mode": "in_flight",
        "rollout.async_worker": "thread", "run.total_steps": 2, "rollout.max_new_tokens": 12,
    }))  # fmt: skip
    batch = pin.trained[1]
    mask, versions = batch["response_mask"].bool(), batch["token_versions"]
    assert (versions[~mask] == -1).all()
    assert set(versions[mask].tolist()) == {0, 1}
    for row, m, v in zip(versions, mask, batch["version"].tolist()):
        assert row[m].tolist() == sorted(row[m].tolist()) and row[m].min() == v
    assert (pin.trained[0]["token_versions"][pin.trained[0]["response_mask"].bool()] == 0).all()
    switched = [bool(set(r[m].tolist()) == {0, 1}) for r, m in zip(versions, mask)]
    assert rows[2]["async/samples_switched_frac"] == pytest.approx(sum(switched) / len(switched))


@pytest.mark.slow
def test_one_step_on_ray_trains_exactly_the_sampled_ids(agents, tiny_base, tmp_path, shared_ray):
    """run.backend ray: the policy's worker (and its rollout engine) is a Ray actor; the server
    runs on the driver, beside the agents, and batches per engine call through the worker group
    (continuous batching needs the engine in the server's process)."""
    from groupflow.serve.batcher import DynamicBatcher
    from groupflow.trainer import Trainer

    overrides = {"run.backend": "ray", "run.num_workers": 1, "run.total_steps": 1,
                 "validation.before_training": False}  # fmt: skip
    t = Trainer(_agent_config(tiny_base, tmp_path, **overrides))
    try:
        assert isinstance(t.workflow.server.core.batcher, DynamicBatcher)
        batch, m = _collect(t, agents, "two_calls")
        assert m["rollout/agent/samples_per_episode"] == 1 and m["rollout/agent/failures"] == 0
        _check_trained_equals_seen(batch, agents.SEEN, 4)
        _check_training_forward(t, batch)
        final = t.fit()  # one GRPO step through the server, the update on the Ray worker
        assert final["rollout/agent/calls/mean"] == 2 and final["rollout/agent/failures"] == 0
        assert "actor/pg_loss" in final and final["weights/bytes_via_driver"] == 0
    finally:
        t.workflow.close()
        t.shutdown()


@pytest.fixture(scope="module")
def pool_ray(tmp_path_factory):
    """A fresh local Ray instance whose processes append every agent call to one file
    (``serve_agents.LOG_ENV``: Ray's processes inherit the environment Ray starts with)."""
    ray = pytest.importorskip("ray")
    calls = tmp_path_factory.mktemp("pool") / "calls.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SERVE_AGENTS_LOG", str(calls))
        ray.shutdown()  # the first run below starts one with this environment
        yield calls
    ray.shutdown()


VLLM = {"rollout.engine": "vllm", "rollout.vllm.dtype": "float32",
        "rollout.vllm.cpu_kv_cache_gib": 1, "model.tiny.hidden_size": 128,
        "model.tiny.num_heads": 2, "model.tiny.num_layers": 2, "rollout.agent_timeout_s": 60}  # fmt: skip
"""The vLLM engine on the tiny model: fp32 on both sides, head dim 64 (vLLM's CPU attention)."""
needs_vllm = pytest.mark.skipif(
    not __import__("groupflow.rollout.engines.vllm_engine", fromlist=["x"]).vllm_available(),
    reason="vLLM is not installed here; runs in .venv-vllm (bash scripts/setup_vllm.sh, then "
    ".venv-vllm/bin/python -m pytest tests/workflows/test_agent.py -k vllm)",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine, staleness",
    [("hf", 0), ("hf", 1), pytest.param("vllm", 0, marks=needs_vllm),
     pytest.param("vllm", 1, marks=needs_vllm)],
)  # fmt: skip
def test_on_a_ray_rollout_pool_the_pool_generates_and_the_sampled_ids_train(
    pool_ray, tiny_base, tmp_path, engine, staleness
):
    """placement.rollout on Ray, 2 steps. Synchronous: episodes and server on the driver, every
    engine call (baseline and final validation too) on the pool's worker. max_staleness 1: the
    training episodes and their server run in the pool's loop actor, not in the driver; the
    driver's final validation goes to the actor (current weights) although its server was built
    for the baseline validation, while the pool was still the driver's. Versions never pass through the driver; each
    trained sample is exactly the two calls the agent was sent, and the training forward's
    log-probs equal the sampling ones on every batch sampled with the current weights. Both
    with the HF engine and with vLLM on the pool's worker (.venv-vllm; the actor keeps HF's and
    matches vLLM's fp32 log-probs within 1e-3)."""
    import json
    import os

    from groupflow.trainer import Trainer

    pool_ray.write_text("")
    overrides = {
        "rollout.agent": f"{TESTS}/serve_agents.py:two_calls", "run.backend": "ray",
        "run.num_workers": 1, "run.total_steps": 2, "rollout.max_staleness": staleness,
        "validation.before_training": True,
        "placement.actor": {"nodes": 1, "workers_per_node": 1, "cpus_per_worker": 0.5},
        "placement.rollout": {"workers_per_node": 1, "cpus_per_worker": 0.5},
        **(VLLM if engine == "vllm" else {}),
    }  # fmt: skip
    t = Trainer(_agent_config(tiny_base, tmp_path, **overrides))
    trained = []  # (batch, its training forward's log-probs where its version is the current one)
    prepare, temperature = t.policy.prepare, t.policy.sampling.temperature

    def spy(batch, timer=None):
        forward = None
        if bool((batch["version"] == t.step).all()):  # the actor holds the sampling weights
            inputs = model_inputs(batch)
            forward = t.policy.actor.compute_logprobs(inputs, temperature=temperature)["logprobs"]
        trained.append((batch, forward))
        return prepare(batch, timer)

    t.policy.prepare = spy
    try:
        t.fit()
        pool, actor = t.policy.rollout_pool.generated(), t.policy.actor.generated()
        engines = [name for name, _ in t.policy.rollout_pool.engine_state()]
    finally:
        t.workflow.close()
        t.shutdown()
    rows = [json.loads(r) for r in (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0 and "weights/bytes_via_driver" in r]
    assert engines == [engine]  # the pool's one worker generated with the configured engine
    assert [r["weights/bytes_via_driver"] for r in steps] == [0.0, 0.0]
    assert all(r["rollout/agent/failures"] == 0 for r in steps)
    atol = 1e-3 if engine == "vllm" else 1e-5  # vLLM's fp32 kernels against torch's
    if engine == "vllm":  # step 1 samples and trains version 0 (asynchronously too); the run
        # recomputes old log-probs against vLLM's and logs the gap (HF's rollout ones serve)
        assert steps[0]["rollout/logprob_diff_max"] < atol, steps[0]
    train, validation = 2 * 4 * 2, 2 * (4 + 4) * 2  # steps × episodes × calls; 2 validations
    calls = [json.loads(line) for line in pool_ray.read_text().splitlines()]
    driver = [c for c in calls if c["pid"] == os.getpid()]
    elsewhere = [c for c in calls if c["pid"] != os.getpid()]
    if staleness:  # training on the pool, from the loop actor; once the side holds the pool,
        # the final validation on the actor (the baseline one ran before, on the pool)
        assert pool == [train + validation // 2] and actor == [validation // 2]
        assert len(elsewhere) == train and len(driver) == validation
        assert len({c["pid"] for c in elsewhere}) == 1
    else:  # everything generated on the pool, every episode on the driver
        assert pool == [train + validation] and actor == [0]
        assert len(driver) == train + validation and not elsewhere
    assert len(trained) == 2
    for batch, forward in trained:
        assert len(batch) == 4
        _check_samples_are_the_calls(batch, elsewhere if staleness else driver)
        if forward is not None:
            mask = batch["response_mask"].bool()
            assert torch.allclose(forward[mask], batch["rollout_logprobs"][mask], atol=atol)
    # synchronous: both batches are the current version's; asynchronous: the first one
    assert sum(f is not None for _, f in trained) == (1 if staleness else 2)


_TIME = ("time/", "perf/", "wall_time")  # how fast, not what was computed (as the other
# resume tests: tests/test_trainer.py, tests/rollout/test_hosts.py)
# How the server happened to group concurrent calls into engine calls: arrival times, not what
# was computed (a loaded machine delays a call past the batcher's wait and splits a batch)
_SCHEDULING = ("rollout/agent/engine_calls", "rollout/agent/samples_per_engine_call")
# The gap between the server's recorded log-probs and the training forward's: the recorded ones
# were summed in the order that grouping gave (float rounding), so the gap is compared to 1e-5
# (bit for bit, it differed once in a full run here); everything trained stays bit for bit
_GROUPING_GAP = ("rollout/logprob_diff_max", "rollout/logprob_diff_mean")


def _differing(a: dict, b: dict) -> list[str]:
    """Keys (timings and scheduling aside) whose values differ between two metric rows (NaN
    equals NaN)."""
    for k in _GROUPING_GAP:
        assert (k in a) == (k in b) and a.get(k, 0.0) == pytest.approx(b.get(k, 0.0), abs=1e-5), k
    skip = (*_SCHEDULING, *_GROUPING_GAP)
    keys = {k for k in a.keys() | b.keys() if not k.startswith(_TIME) and k not in skip}
    return sorted(k for k in keys if not (a.get(k) == b.get(k) or (
        isinstance(a.get(k), float) and math.isnan(a[k]) and math.isnan(b.get(k, 0.0)))))  # fmt: skip


@pytest.mark.slow
def test_the_calc_agent_on_a_ray_rollout_pool_warm_starts_and_resumes_exactly(
    tiny_base, tmp_path, shared_ray
):
    """The example calc agent on Ray with a rollout pool, a 2-step SFT warm start and
    max_staleness 1 (the server and the episodes in the pool's loop actor): 2 steps straight
    equal 1 step, a stop, and a resume from its checkpoint (a fresh trainer and fresh actors) to
    2 steps — every metric but timings, the final validation and the final weights included.
    Versions never pass through the driver. (max_staleness 0 resumes through the driver's
    synchronous source; one case keeps the test's cost down.) The sampled ids are the same
    however the server grouped the episodes' concurrent calls into engine calls, but the
    log-probs it recorded can differ in the last bits when the grouping differs (another batch
    shape, another float summation order; a loaded machine regroups them): the update anchors
    its ratio on recomputed old log-probs (recompute_old_logprobs always), whose forward does
    not depend on that grouping, as a user wanting a bit-identical resume of a concurrent agent
    run sets it (docs/guides/agents-serve.md)."""
    from groupflow.run.checkpoint import load_checkpoint
    from groupflow.run.files import read_metrics
    from groupflow.trainer import Trainer

    agent = Path(__file__).resolve().parents[2] / "examples/agents/calc_agent.py"

    def run(name: str, steps: int, resume: str = "never") -> dict[int, dict]:
        cfg = _agent_config(tiny_base, tmp_path, **{
            "run.name": name, "run.total_steps": steps, "run.save_every": 1,
            "run.resume": resume, "rollout.agent": f"{agent}:calc_agent",
            "rollout.stop": ["</calc>"], "rollout.max_new_tokens": 16,
            "sft.target_field": "demo", "sft.steps": 2, "rollout.agent_timeout_s": 30,
            "actor.recompute_old_logprobs": "always",
            "rollout.agent_reward": "both",  # the agent's 0/1 answer check, plus a value that
            # differs between answers: an untrained model is never right, and zero-signal
            # steps, which skip the update, would hide a resume that trained wrong
            "reward.functions": [{"function": f"{TESTS}/serve_agents.py:varying_reward"}],
            "run.backend": "ray", "run.num_workers": 1, "rollout.max_staleness": 1,
            "placement.actor": {"nodes": 1, "workers_per_node": 1, "cpus_per_worker": 0.5},
            "placement.rollout": {"workers_per_node": 1, "cpus_per_worker": 0.5},
        })  # fmt: skip
        t = Trainer(cfg)
        try:
            t.fit()
        finally:
            t.shutdown()
        return {int(r["step"]): r for r in read_metrics(tmp_path / name)}

    full = run("full", 2)
    part = run("part", 1)
    assert sorted(part) == [0, 1]
    resumed = run("part", 2, resume="auto")
    assert sorted(full) == sorted(resumed) == [0, 1, 2]
    for rows in (full, resumed):
        assert rows[0]["sft/steps"] == 2 and math.isfinite(rows[0]["sft/loss"])  # warm start ran
        assert [rows[s]["weights/bytes_via_driver"] for s in (1, 2)] == [0.0, 0.0]
        assert [rows[s]["rollout/agent/failures"] for s in (1, 2)] == [0.0, 0.0]
    assert resumed[2]["async/staleness"] == 1.0  # step 2 trained on version 1's batch
    assert all(rows[s]["actor/grad_norm"] > 0 for rows in (full, resumed) for s in (1, 2))
    assert "val/greedy/acc" in resumed[2] and "actor/pg_loss" in resumed[2]
    assert {s: _differing(full[s], resumed[s]) for s in (0, 2)} == {0: [], 2: []}
    # step 1 of the stopped run also validated, as the last step of a run does
    assert [k for k in _differing(full[1], resumed[1]) if not k.startswith("val/")] == []
    # and what step 2's update made (its logged metrics are measured before it)
    a, b = (
        load_checkpoint(tmp_path / n / "checkpoints" / "step_2")["model"] for n in ("full", "part")
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@needs_vllm
def test_one_step_with_the_vllm_engine_trains_exactly_the_sampled_ids(agents, tiny_base, tmp_path):
    """rollout.engine vllm: the server batches per engine call through the policy's vLLM engine;
    the trained ids are the ones vLLM sampled and the training forward's log-probs match vLLM's
    (fp32 on both sides; head dim 64, as vLLM's CPU attention needs)."""
    from groupflow.serve.batcher import DynamicBatcher
    from groupflow.trainer import Trainer

    overrides = {**VLLM, "run.total_steps": 1, "validation.before_training": False}
    t = Trainer(_agent_config(tiny_base, tmp_path, **overrides))
    try:
        assert isinstance(t.workflow.server.core.batcher, DynamicBatcher)
        batch, m = _collect(t, agents, "two_calls")
        assert m["rollout/agent/failures"] == 0, {k: v for k, v in m.items() if "fail" in k}
        assert m["rollout/agent/samples_per_episode"] == 1
        _check_trained_equals_seen(batch, agents.SEEN, 4)
        _check_training_forward(t, batch, atol=1e-3)
        final = t.fit()
        assert final["rollout/agent/calls/mean"] == 2 and final["rollout/agent/failures"] == 0
    finally:
        t.workflow.close()
        t.shutdown()


def test_the_agent_loop_closes_its_event_loop_and_a_stuck_agent_cannot_hang_the_close():
    """Closing the episodes' loop stops and closes it (no unclosed-loop warning), twice is
    harmless; an agent blocking the loop with sync code leaves the close after its timeout."""
    import threading
    import time

    from groupflow.workflows.agent_runtime import AgentLoop

    loop = AgentLoop()
    assert loop.run(_answer(), timeout_s=5) == 42
    loop.close(timeout_s=5)
    assert loop._loop.is_closed() and not loop._thread.is_alive()
    loop.close(timeout_s=5)  # already closed
    stuck, started, release = AgentLoop(), threading.Event(), threading.Event()

    async def blocks():
        started.set()
        release.wait(10)  # sync code inside an async agent: the loop cannot stop meanwhile

    stuck._loop.call_soon_threadsafe(lambda: stuck._loop.create_task(blocks()))
    assert started.wait(5)  # the agent is running before the close begins
    start = time.perf_counter()
    stuck.close(timeout_s=0.3)
    assert time.perf_counter() - start < 5 and not stuck._loop.is_closed()
    release.set()
    stuck._thread.join(5)
    stuck._loop.close()


async def _answer():
    return 42


def test_the_agents_share_an_aiohttp_client_and_fall_back_to_httpx(monkeypatch):
    """aiohttp's transport where installed (less CPU per call); without it, openai's httpx one."""
    from groupflow.workflows.agent_runtime import shared_http_client

    pytest.importorskip("aiohttp", reason="needs aiohttp (the serve extra)")
    aio = shared_http_client(5)
    assert type(aio._transport).__name__ == "AiohttpTransport"

    def missing(**_):
        raise RuntimeError("To use the aiohttp client you must have installed the package")

    monkeypatch.setattr(openai, "DefaultAioHttpClient", missing)
    plain = shared_http_client(5)
    assert isinstance(plain, openai.DefaultAsyncHttpxClient)
    assert type(plain._transport).__name__ != "AiohttpTransport"
    assert plain.timeout.read == 5
