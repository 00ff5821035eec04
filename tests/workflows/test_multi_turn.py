"""The multi-turn workflow through the trainer: tools and environments, rewards that see the
whole trajectory, failures contained, the version in every sample, exact resume, config errors."""

from __future__ import annotations

import importlib
import json

import pytest

from groupflow.config import ConfigError
from groupflow.trainer import Trainer
from tests.workflows.calc_tools import CALC_TOOLS


def _steps(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


CALC = dict(
    CALC_TOOLS, rollout__temperature=0.7,
    sft__steps=200, sft__lr=5e-3, sft__batch_samples=32, sft__target_field="demo",
)  # fmt: skip


@pytest.fixture
def helpers(helpers_on_path):
    module = importlib.import_module("agent_helpers")
    module.SEEN.clear()
    return module


def test_tool_run_calls_the_tool_masks_its_result_and_logs(tiny_config, monkeypatch, spy):
    # old log-probs recomputed by the training forward over prompt | turns | observations
    trainer = Trainer(
        tiny_config(run__total_steps=2, actor__recompute_old_logprobs="always", **CALC)
    )
    batches = spy(trainer.workflow, "collect")
    trainer.fit()
    tok = trainer.policy.tokenizer
    calls = 0
    for batch, _ in batches:
        assert batch["version"].tolist() == [batch["version"][0].item()] * len(batch)
        for i in range(len(batch)):
            ids, mask = batch["responses"][i], batch["response_mask"][i]
            observed = tok.decode(ids[(mask == 0)].tolist(), skip_special_tokens=True)
            traj = batch["trajectory"][i]
            if "</calc>" in traj:  # a call: the calculator's exact result follows, masked
                calls += 1
                expr = traj.split("<calc>")[1].split("</calc>")[0]
                from groupflow.tools.calculator import calculator

                try:
                    result = calculator(expr)
                except (ValueError, ZeroDivisionError) as exc:
                    result = f"Error: {type(exc).__name__}: {exc}"
                assert observed.startswith(f"={result}\n")
            else:
                assert observed == ""
    assert calls > 0, "the warm start demonstrates the tool on half of the rows"
    row = _steps(trainer.run_dir)[-1]
    for key in ("rollout/tool_call_rate", "rollout/tool_calls/mean", "rollout/turns/mean",
                "rollout/observation_tokens/mean", "rollout/finish/stop", "rollout/env_failures"):  # fmt: skip
        assert key in row
    assert 0 < row["rollout/tool_call_rate"] <= 1
    # token-in/token-out: the ids trained are the ids sampled, so the log-probs agree
    assert row["rollout/logprob_diff_max"] < 1e-5


def test_rewards_receive_the_whole_trajectory(tiny_config, helpers):
    cfg = tiny_config(
        run__total_steps=1, rollout__max_turns=3, rollout__max_new_tokens=4,
        rollout__max_response_tokens=40, rollout__observation_template=" {content};",
        rollout__environment={"class": "agent_helpers:CountdownEnv", "kwargs": {"turns": 2}},
        reward__functions=[{"function": "agent_helpers:record_trajectory"}],
    )  # fmt: skip
    trainer = Trainer(cfg)
    trainer.fit()
    seen = helpers.SEEN[0]
    for msgs, turns, rewards, traj, last in zip(
        seen["messages"],
        seen["turns"],
        seen["env_rewards"],
        seen["trajectory"],
        seen["completions"],
    ):
        assert turns == sum(m["role"] == "assistant" for m in msgs) >= 1
        assert len(rewards) <= turns
        assert msgs[-1]["content"] == last or msgs[-1]["role"] == "user"
        assert traj.endswith(last)
    assert seen["tool_calls"] == [0] * len(seen["turns"])  # an environment, not tools


def test_failing_environment_gets_the_failure_value_and_the_run_goes_on(
    tiny_config, helpers, caplog
):
    cfg = tiny_config(
        run__total_steps=2, rollout__max_turns=2, rollout__max_new_tokens=4,
        rollout__environment={"class": "agent_helpers:RaisingEnv"}, reward__failure_value=-1.0,
        rollout__observation_template="{content}",
    )  # fmt: skip
    trainer = Trainer(cfg)
    trainer.fit()
    rows = _steps(trainer.run_dir)[1:]
    assert len(rows) == 2
    for row in rows:
        stepped = row["rollout/finish/env_failure"]
        assert row["rollout/env_failures"] == pytest.approx(stepped * 16)
    assert any("environment failure (error)" in r.message for r in caplog.records)


def test_a_reward_needing_trajectory_fields_is_refused_for_single_turn(tiny_config, helpers):
    from groupflow.rewards import MissingRewardFieldError

    cfg = tiny_config(reward__functions=[{"function": "agent_helpers:needs_env_rewards"}])
    with pytest.raises(MissingRewardFieldError, match="env_rewards"):
        Trainer(cfg)


def test_exact_resume(tiny_config, tmp_path):
    full = Trainer(tiny_config(run__total_steps=4, run__name="full", **{**CALC, "sft__steps": 20}))
    full.fit()
    first = Trainer(tiny_config(run__total_steps=2, run__name="cut", run__save_every=2,
                                **{**CALC, "sft__steps": 20}))  # fmt: skip
    first.fit()
    rest = Trainer(tiny_config(run__total_steps=4, run__name="cut", **{**CALC, "sft__steps": 20}))
    rest.fit()
    a, b = _steps(full.run_dir), _steps(rest.run_dir)
    keys = ("reward/mean", "actor/grad_norm", "rollout/tool_call_rate", "rollout/turns/mean")
    for step in (3, 4):
        ra = next(r for r in a if r["step"] == step)
        rb = next(r for r in b if r["step"] == step)
        assert [ra[k] for k in keys] == [rb[k] for k in keys]


def test_sft_demonstrations_mask_the_observation(tiny_config):
    trainer = Trainer(tiny_config(**CALC))
    wf, tok = trainer.workflow, trainer.policy.tokenizer
    examples = wf.sft_examples(wf.train.encoded)
    for row, (prompt, ids, mask) in zip(wf.train.rows[:20], examples[:20]):
        assert prompt == wf.train.lookup([row])[1][0]
        demo = row.fields["demo"]
        trained = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
        assert trained == "".join(demo)
        observed = tok.decode([t for t, m in zip(ids, mask) if not m])
        assert observed == (f"={row.fields['answer']}\n" if len(demo) == 2 else "")
        assert ids[-1] == tok.eos_token_id


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"rollout__tools": [{"name": "calculator"}],
          "rollout__environment": {"class": "a:B"}}, "exclusive"),
        ({"rollout__workflow": "single_turn", "rollout__max_turns": 2,
          "rollout__tools": [{"name": "calculator"}]}, "use multi_turn"),
        ({"rollout__workflow": "mutli_turn"}, "rollout.workflow='mutli_turn'"),
        ({"rollout__tools": [{"name": "calculator", "function": "a:b"}]}, "exactly one of"),
        ({"rollout__tool_parser": "json"}, "tool_parser"),
        ({"rollout__max_turns": 2, "rollout__tools": [{"name": "calculator"}],
          "rollout__max_response_tokens": 4}, "below"),
        ({"rollout__max_turns": 2, "rollout__tools": [{"name": "calculator"}],
          "data__use_chat_template": False}, "observation_template"),
        ({"rollout__max_turns": 2}, "nothing answers the model"),
        ({"rollout__max_observation_tokens": 8}, "rollout.max_observation_tokens=8: only a multi"),
        ({"rollout__max_observation_chars": 80}, "max_observation_chars=80: .* do nothing"),
        ({"rollout__tools": [{"name": "calculator"}], "rollout__max_observation_chars": 0},
         "rollout.max_observation_chars"),
    ],
)  # fmt: skip
def test_config_errors(tiny_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(**overrides)


def test_chat_prompts_without_a_chat_format_name_the_row(tiny_config, tmp_path):
    from groupflow.data import DataError

    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": "1",
                                "data_source": "groupflow/reverse"}) + "\n")  # fmt: skip
    cfg = tiny_config(data__task=None, data__train_files=[str(data)], data__prompts_per_step=1,
                      rollout__max_turns=2, rollout__observation_template="{content}",
                      rollout__tools=[{"name": "calculator"}])  # fmt: skip
    with pytest.raises(DataError, match="chat.jsonl.*row 0.*chat template"):
        Trainer(cfg)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"rollout__tools": [{"name": "calculater"}]}, "did you mean 'calculator'"),
        ({"rollout__environment": {"class": "agent_helpers:Nope"}}, "has no attribute 'Nope'"),
        ({"rollout__environment": {"class": "missing_file.py:Env"}}, "does not exist"),
    ],
)  # fmt: skip
def test_bad_tools_and_environments_fail_at_start(tiny_config, helpers, overrides, message):
    with pytest.raises(ValueError, match=message):
        Trainer(tiny_config(rollout__max_turns=2, **overrides))


@pytest.mark.slow
def test_multi_turn_on_a_ray_rollout_pool_matches_local(tiny_config, shared_ray):
    """Asynchronous (k = 1) multi-turn with tools: on Ray the rollout loop — model turns, tool
    calls, observations — runs in the rollout pool's actor, generation on its worker; locally in
    the child process. Same numbers."""
    calc = {**CALC, "rollout__max_staleness": 1, "run__total_steps": 2}  # 200 SFT steps: tool calls
    local = Trainer(tiny_config(run__name="local", **calc))
    local.fit()
    local.shutdown()
    ray_run = Trainer(
        tiny_config(run__name="ray", run__backend="ray", run__num_workers=1,
                    placement__actor={"nodes": 1, "workers_per_node": 1, "cpus_per_worker": 0.5},
                    placement__rollout={"workers_per_node": 1, "cpus_per_worker": 0.5}, **calc)
    )  # fmt: skip
    try:
        ray_run.fit()
    finally:
        ray_run.shutdown()
    a, b = _steps(local.run_dir), _steps(ray_run.run_dir)
    assert b[-1]["rollout/tool_call_rate"] > 0  # the pool's loop called the tool
    for key in ("reward/mean", "rollout/tool_call_rate", "actor/grad_norm"):
        assert a[-1][key] == pytest.approx(b[-1][key], abs=1e-5)


def test_version_of_every_sample_is_checked(tiny_config, monkeypatch):
    from groupflow.contracts import ContractError

    trainer = Trainer(tiny_config(run__total_steps=1))
    original = trainer.workflow.collect

    def stale(rows, step, round_, version):
        batch, metrics = original(rows, step, round_, version)
        batch["version"] = batch["version"] - 1
        return batch, metrics

    monkeypatch.setattr(trainer.workflow, "collect", stale)
    with pytest.raises(ContractError, match="key 'version'.*max staleness 0"):
        trainer.fit()
    assert trainer.step == 0  # refused before the update


# ----- user code that hangs or exits, in a real `groupflow train` process ---------------------


def _train(tmp_path, helpers_on_path, data, timeout=240):
    """``groupflow train`` on ``data`` in a subprocess that must exit within ``timeout`` s."""
    import os
    import subprocess
    import sys

    import yaml

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(data))
    repo = helpers_on_path.parent
    env = {**os.environ, "PYTHONPATH": f"{helpers_on_path}{os.pathsep}{repo}"}
    return subprocess.run(
        [sys.executable, "-m", "groupflow.cli", "train", str(config), "--no-plot"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1])
def test_an_environment_that_hangs_forever_stops_the_run_by_name_and_the_process_exits(
    tmp_path, tiny_config_data, helpers_on_path, staleness
):
    # 16 samples a step, each abandons its reset: the run stops at step 3, naming the method
    data = tiny_config_data(
        run__total_steps=6, rollout__max_turns=2, rollout__max_new_tokens=4,
        rollout__environment={"class": "agent_helpers:SleepingEnv"}, rollout__env_timeout_s=0.05,
        rollout__observation_template="{content}", rollout__max_staleness=staleness,
    )  # fmt: skip
    out = _train(tmp_path, helpers_on_path, data)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert "32 timed-out calls are still running in background threads: SleepingEnv.reset (32)" in (
        out.stderr
    )


@pytest.mark.slow
def test_a_tool_that_hangs_in_the_warm_starts_demonstrations_is_named(
    tmp_path, tiny_config_data, helpers_on_path
):
    # the demonstrations run their tool calls through a real environment before any step: a hung
    # tool stops there by name (it used to starve the shared pool and be reported as a reset
    # that timed out)
    tools = [{"function": "agent_helpers:hang_tool", "label": "calc", "timeout_s": 0.05}]
    data = tiny_config_data(**{**CALC, "sft__steps": 1, "rollout__tools": tools})
    out = _train(tmp_path, helpers_on_path, data)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "timed-out calls are still running in background threads: tool 'calc' (32)" in (
        out.stderr
    )
    assert "reset" not in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1])
def test_an_environment_calling_sys_exit_fails_its_samples_and_the_run_goes_on(
    tmp_path, tiny_config_data, helpers_on_path, staleness
):
    data = tiny_config_data(
        run__total_steps=2, rollout__max_turns=2, rollout__max_new_tokens=4,
        rollout__environment={"class": "agent_helpers:ExitingEnv"}, reward__failure_value=-1.0,
        rollout__observation_template="{content}", rollout__max_staleness=staleness,
    )  # fmt: skip
    out = _train(tmp_path, helpers_on_path, data)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "never retrieved" not in out.stderr
    assert "runs in a thread" not in out.stderr  # k=1: in the rollout child process
    assert "ExitingEnv.reset: SystemExit: 0" in out.stderr  # logged once
    rows = _steps(tmp_path / "tiny")[1:]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # every sample failed at its reset, and was counted
        assert (row["rollout/env_failures"], row["rollout/finish/env_failure"]) == (16, 1)
        assert row["reward/mean"] == -1.0
