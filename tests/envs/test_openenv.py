"""OpenEnv environments through the agent workflow (groupflow.envs.openenv), with a real
environment built with OpenEnv's own classes (``examples/envs/calc_openenv``: its Environment,
Action and Observation served by its ``create_app``), started by the run on 127.0.0.1 with one
torch thread. The environment logs every action it received and every reward it returned
(``CALC_OPENENV_LOG``), so the tests compare what groupflow trained with what the environment
saw: each model turn's trained ids decode to exactly the action the environment got, and each
episode's reward in the batch is the sum of the rewards the environment returned."""

import json
import math
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

from groupflow.config import ConfigError, config_from_dict
from groupflow.policies.llm import model_inputs

pytest.importorskip("openenv", reason="needs openenv (pip install 'groupflow[openenv]')")
pytest.importorskip("openai", reason="needs the openai package")

ROOT = Path(__file__).resolve().parents[2]
ENVS = str(ROOT / "examples" / "envs")
APP = "calc_openenv.server.app:app"


def _config(tiny_base, out, **overrides):
    base, with_overrides = tiny_base
    d = with_overrides(base(out), {
        "model.tiny.max_positions": 256, "data.task": {"name": "calc", "digits": 2,
                                                       "num_train": 64, "num_val": 4},
        "data.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
        "rollout.max_new_tokens": 12, "rollout.max_response_tokens": 96,
        "rollout.stop": ["</calc>"], "rollout.workflow": "agent",
        "rollout.openenv": {"app": APP, "app_dir": ENVS, "reset_fields": ["prompt", "answer"],
                            "max_turns": 3, "startup_timeout_s": 60, "step_timeout_s": 10},
        "rollout.agent_timeout_s": 30, "reward.failure_value": -1.0,
        "serve.describe_tools": False, **overrides,
    })  # fmt: skip
    return config_from_dict(d, "<openenv test>")


def _log_entries(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def env_log(tmp_path_factory):
    path = tmp_path_factory.mktemp("openenv-log") / "actions.jsonl"
    mp = pytest.MonkeyPatch()
    mp.setenv("CALC_OPENENV_LOG", str(path))  # the server's child process inherits it
    yield path
    mp.undo()


@pytest.fixture(scope="module")
def trainer(env_log, tiny_base, tmp_path_factory):
    from groupflow.trainer import Trainer

    torch.set_num_threads(1)
    t = Trainer(_config(tiny_base, tmp_path_factory.mktemp("openenv")))
    yield t
    t.workflow.close()
    t.policy.shutdown()


def _model_turns(batch, i) -> list[list[int]]:
    """The sample's runs of trained (mask 1) ids: one per model turn."""
    ids, mask = batch["responses"][i].tolist(), batch["response_mask"][i].tolist()
    runs, run = [], []
    for t, m in zip(ids, mask):
        if m:
            run.append(t)
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


def test_each_trained_turn_is_the_action_the_environment_got_and_its_rewards_reach_the_batch(
    trainer, env_log
):
    env_log.write_text("")
    wf = trainer.workflow
    batch, m = wf.collect(wf.train_rows[:2], 0, 0, 0)
    entries = _log_entries(env_log)
    assert m["rollout/agent/failures"] == 0 and m["rollout/agent/episodes"] == 4
    assert m["rollout/agent/split_episodes"] == 0  # observations continue the conversation
    tok = trainer.policy.tokenizer
    actions = Counter(e["action"] for e in entries)
    turns = []
    for i in range(len(batch)):
        for run in _model_turns(batch, i):
            text = tok.decode(run, skip_special_tokens=True).removesuffix("</calc>")
            turns.append(text)
    # every trained model turn is one action the environment received, and nothing else
    assert Counter(turns) == actions and len(turns) == len(entries) > 0
    assert m["rollout/agent/env_steps"] == len(entries) / 4
    # the episodes' rewards are the environment's (sums per session)
    per_episode = defaultdict(float)
    for e in entries:
        per_episode[e["episode"]] += e["reward"]
    assert sorted(batch["rewards"].tolist()) == sorted(per_episode.values())
    # the training forward's log-probs are the sampling ones: ids trained = ids sampled
    t = trainer.policy.sampling.temperature
    forward = trainer.policy.actor.compute_logprobs(model_inputs(batch), temperature=t)["logprobs"]
    mask = batch["response_mask"].bool()
    assert torch.allclose(forward[mask], batch["rollout_logprobs"][mask], atol=1e-5)


@pytest.mark.parametrize("fail, kind", [("raise", "raised"), ("nan", "raised")])
def test_an_environment_that_raises_or_gives_no_reward_fails_that_episode_only(trainer, fail, kind):
    """``reset(fail=...)`` (a row field passed through reset_fields) makes the environment raise
    in ``step``, or answer with a NaN reward (OpenEnv sends it as no reward): that episode gets
    reward.failure_value, counted; the others and the step go on."""
    from dataclasses import replace

    wf = trainer.workflow
    rows = [replace(r, fields={**r.fields, "fail": fail if k == 0 else None})
            for k, r in enumerate(wf.train_rows[:2])]  # fmt: skip
    cfg = wf.agent.cfg
    wf.agent.cfg = cfg.model_copy(update={"reset_fields": [*cfg.reset_fields, "fail"]})
    try:
        batch, m = wf.collect(rows, 0, 0, 0)
    finally:
        wf.agent.cfg = cfg
    assert m["rollout/agent/failures"] == 2 and m[f"rollout/agent/failures/{kind}"] == 2
    assert batch["rewards"].tolist()[:2] == [-1.0, -1.0]
    assert min(batch["rewards"].tolist()[2:]) >= 0.0


@pytest.mark.slow
def test_two_grpo_steps_on_the_environment(env_log, tiny_base, tmp_path):
    from groupflow.trainer import Trainer

    env_log.write_text("")
    t = Trainer(_config(tiny_base, tmp_path, **{"run.total_steps": 2}))
    try:
        final = t.fit()
        process = t.workflow.agent.server.process
    finally:
        t.workflow.close()
    assert process.poll() is not None  # closed with the workflow
    assert final["rollout/agent/failures"] == 0 and "val/greedy/acc" in final
    assert math.isfinite(final["actor/loss"] if "actor/loss" in final else final["loss"])
    rewards = [e["reward"] for e in _log_entries(env_log)]
    assert rewards and set(rewards) <= {0.0, 1.0}


def test_a_server_that_dies_mid_run_stops_the_step_with_a_named_error(tiny_base, tmp_path):
    from groupflow.envs import OpenEnvServerError
    from groupflow.trainer import Trainer

    t = Trainer(_config(tiny_base, tmp_path))
    try:
        t.workflow.agent.server.process.kill()
        start = time.monotonic()
        with pytest.raises(OpenEnvServerError, match="died during the run"):
            t.workflow.collect(t.workflow.train_rows[:2], 0, 0, 0)
        assert time.monotonic() - start < 30
    finally:
        t.workflow.close()
        t.policy.shutdown()


def test_a_server_that_never_becomes_healthy_is_a_named_error_in_bounded_time(tmp_path):
    from groupflow.config import OpenEnvConfig
    from groupflow.envs import OpenEnvAgent, OpenEnvServerError

    hang = tmp_path / "hang_app.py"  # imports, then never serves
    hang.write_text("import time\ntime.sleep(60)\napp = None\n")
    start = time.monotonic()
    with pytest.raises(OpenEnvServerError, match="did not answer .*/health within .*=3 s"):
        OpenEnvAgent(OpenEnvConfig(app="hang_app:app", app_dir=str(tmp_path),
                                   startup_timeout_s=3))  # fmt: skip
    assert time.monotonic() - start < 15
    crash = tmp_path / "crash_app.py"
    crash.write_text("raise SystemExit('no such environment')\n")
    with pytest.raises(OpenEnvServerError, match="(?s)exited with code 1 .*no such environment"):
        OpenEnvAgent(OpenEnvConfig(app="crash_app:app", app_dir=str(tmp_path)))
    with pytest.raises(OpenEnvServerError, match="at http://127.0.0.1:9 did not answer"):
        OpenEnvAgent(OpenEnvConfig(url="http://127.0.0.1:9", startup_timeout_s=1))


def test_openenv_not_installed_names_the_pip_command(monkeypatch):
    from groupflow.config import OpenEnvConfig
    from groupflow.envs import MissingEnvPackageError, OpenEnvAgent

    monkeypatch.setitem(sys.modules, "openenv", None)  # what a missing package imports as
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "openenv" else real(name, *a))  # fmt: skip
    with pytest.raises(MissingEnvPackageError, match=r"pip install 'groupflow\[openenv\]'"):
        OpenEnvAgent(OpenEnvConfig(url="http://127.0.0.1:9"))


@pytest.mark.parametrize(
    "section, match",
    [
        ({}, "exactly one of app .* and url"),
        ({"app": APP, "url": "http://127.0.0.1:1"}, "exactly one of app"),
        ({"app": "calc_openenv.server.app"}, "expected 'package.module:app'"),
        ({"url": "127.0.0.1:8000"}, "expected http://host:port"),
        ({"app": APP, "max_turns": 0}, "max_turns"),
        ({"app": APP, "reset_feilds": ["prompt"]}, "reset_feilds"),
    ],
)
def test_config_errors_name_the_key(tiny_base, tmp_path, section, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        _config(tiny_base, tmp_path, **{"rollout.openenv": section})


def test_openenv_and_an_agent_are_exclusive_and_need_the_agent_workflow(tiny_base, tmp_path):
    with pytest.raises((ConfigError, ValueError), match="are exclusive"):
        _config(tiny_base, tmp_path, **{"rollout.agent": "x:y"})
    with pytest.raises((ConfigError, ValueError), match="set rollout.workflow=agent"):
        _config(tiny_base, tmp_path, **{"rollout.workflow": "auto"})


def test_the_cli_shows_a_server_error_with_the_fix_and_exit_2():
    from groupflow.cli.errors import explain
    from groupflow.envs import MissingEnvPackageError, OpenEnvServerError

    e = explain(OpenEnvServerError("the OpenEnv server 'x:app' exited with code 1"))
    assert e.exit_code == 2 and "exited with code 1" in e.message
    assert "rollout.openenv.startup_timeout_s" in e.message
    assert explain(MissingEnvPackageError("pip install 'groupflow[openenv]'")).exit_code == 2
