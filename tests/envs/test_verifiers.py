"""verifiers environments through the agent workflow (groupflow.envs.verifiers), with a real
taskset built with verifiers' own classes (``examples/envs/calc_verifiers``: its Taskset, Task,
TaskData and ``@vf.reward`` functions), run by verifiers itself — its Env, its interception
server and its ``null`` chat harness in its local subprocess runtime — against the run's server
on 127.0.0.1. The taskset logs every reply it scored (``CALC_VERIFIERS_LOG``), so the tests
compare what groupflow trained with what verifiers scored."""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from groupflow.config import ConfigError, config_from_dict

pytest.importorskip("verifiers.v1", reason="needs verifiers (pip install 'groupflow[verifiers]')")

ENVS = str(Path(__file__).resolve().parents[2] / "examples" / "envs")


def _config(tiny_base, out, **overrides):
    base, with_overrides = tiny_base
    d = with_overrides(base(out), {
        "model.tiny.max_positions": 256, "data.task": {"name": "calc", "digits": 2,
                                                       "num_train": 8, "num_val": 2},
        "data.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
        "rollout.max_new_tokens": 8, "rollout.max_response_tokens": 64,
        "rollout.workflow": "agent",
        "rollout.verifiers": {"taskset": "calc_verifiers", "taskset_dir": ENVS,
                              "taskset_args": {"num_tasks": 8},
                              "val_taskset_args": {"seed": 1, "num_tasks": 2}},
        "rollout.agent_timeout_s": 60, "reward.failure_value": -1.0, **overrides,
    })  # fmt: skip
    return config_from_dict(d, "<verifiers test>")


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def vf_log(tmp_path_factory):
    path = tmp_path_factory.mktemp("vf-log") / "scored.jsonl"
    mp = pytest.MonkeyPatch()
    mp.setenv("CALC_VERIFIERS_LOG", str(path))
    yield path
    mp.undo()


@pytest.mark.slow
def test_two_grpo_steps_train_the_replies_verifiers_scored(vf_log, tiny_base, tmp_path):
    from groupflow.trainer import Trainer

    torch.set_num_threads(1)
    t = Trainer(_config(tiny_base, tmp_path, **{"run.total_steps": 2}))
    try:
        # the taskset is the prompt source: its 8 tasks, and its seed-1 view for validation
        assert len(t.workflow.train_rows) == 8 and len(t.workflow.val_rows) == 2
        assert t.workflow.train_rows[0].prompt == t.workflow.agent.tasks["train"][0].data.prompt
        vf_log.write_text("")
        batch, m = t.workflow.collect(t.workflow.train_rows[:2], 0, 0, 0)
        scored = _log(vf_log)
        assert m["rollout/agent/failures"] == 0 and len(scored) == 4
        tok = t.policy.tokenizer
        trained = [tok.decode(batch["responses"][i][batch["response_mask"][i].bool()].tolist(),
                              skip_special_tokens=True) for i in range(len(batch))]  # fmt: skip
        # each trained sample is exactly the reply verifiers' harness got and its rubric scored
        assert Counter(trained) == Counter(s["reply"] for s in scored)
        assert sorted(batch["rewards"].tolist()) == sorted(s["correct"] for s in scored)
        # the named rewards are logged: `correct` (weight 1) and `short` (weight 0)
        assert m["rollout/agent/rewards/correct"] == sum(s["correct"] for s in scored) / 4
        assert 0.0 <= m["rollout/agent/rewards/short"] <= 1.0
        final = t.fit()
    finally:
        t.workflow.close()
    assert final["rollout/agent/failures"] == 0 and "val/greedy/acc" in final


@pytest.mark.slow
def test_the_warm_start_plays_the_tasks_answers_through_verifiers(tiny_base, tmp_path):
    """A verifiers row carries its task data's plain fields, so ``sft.target_field`` can name the
    task's ``answer``; the warm start plays ``sft.demonstrations`` of them through verifiers' own
    harness, and each example trains exactly that answer (+ EOS) after the prompt the harness
    sent."""
    from types import SimpleNamespace

    from groupflow.trainer import Trainer

    torch.set_num_threads(1)
    t = Trainer(_config(tiny_base, tmp_path, **{
        "sft.steps": 2, "sft.batch_samples": 4, "sft.demonstrations": 3}))  # fmt: skip
    try:
        wf, tok = t.workflow, t.policy.tokenizer
        tasks = wf.agent.tasks["train"]
        assert [r.fields["answer"] for r in wf.train_rows] == [x.data.answer for x in tasks]
        assert [r.fields["vf_task"] for r in wf.train_rows] == list(range(8))
        examples = wf.sft_examples(SimpleNamespace(rows=wf.train_rows))
        assert len(examples) == 3
        for (prompt_ids, ids, _), row in zip(examples, wf.train_rows):
            answer = tok(row.fields["answer"], add_special_tokens=False)["input_ids"]
            assert ids == answer + [tok.eos_token_id]
            assert row.prompt in tok.decode(prompt_ids)
        assert wf.warm_start()["sft/steps"] == 2
    finally:
        t.workflow.close()


@pytest.mark.slow
def test_a_task_that_fails_in_scoring_is_a_counted_failure(tiny_base, tmp_path):
    from groupflow.trainer import Trainer

    torch.set_num_threads(1)
    cfg = _config(tiny_base, tmp_path, **{
        "rollout.verifiers.taskset_args": {"num_tasks": 8, "fail_every": 2}})  # fmt: skip
    t = Trainer(cfg)
    try:
        batch, m = t.workflow.collect(t.workflow.train_rows[:2], 0, 0, 0)
    finally:
        t.workflow.close()
        t.policy.shutdown()
    # task 0 fails (fail_every 2), task 1 does not: its two episodes score normally
    assert m["rollout/agent/failures/raised"] == 2
    assert batch["rewards"].tolist()[:2] == [-1.0, -1.0]
    assert min(batch["rewards"].tolist()[2:]) >= 0.0


def test_a_taskset_that_is_not_installed_names_how_to_install_it(tiny_base, tmp_path):
    from groupflow.envs import MissingEnvPackageError
    from groupflow.trainer import Trainer

    cfg = _config(tiny_base, tmp_path, **{"rollout.verifiers": {"taskset": "no_such_taskset"}})
    with pytest.raises(MissingEnvPackageError, match="no_such_taskset.*pip install"):
        Trainer(cfg)


def test_verifiers_not_installed_names_the_pip_command(monkeypatch):
    import importlib.util

    from groupflow.config import VerifiersConfig
    from groupflow.envs import MissingEnvPackageError, VerifiersAgent

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "verifiers" else real(name, *a))  # fmt: skip
    with pytest.raises(MissingEnvPackageError, match=r"pip install 'groupflow\[verifiers\]'"):
        VerifiersAgent(VerifiersConfig(taskset="calc_verifiers"))


@pytest.mark.parametrize(
    "section, match",
    [({}, "taskset"), ({"taskset": "x", "max_train_tasks": 0}, "max_train_tasks"),
     ({"taskset": "x", "harnes": "null"}, "harnes")],
)  # fmt: skip
def test_config_errors_name_the_key(tiny_base, tmp_path, section, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        _config(tiny_base, tmp_path, **{"rollout.verifiers": section})


def test_verifiers_and_openenv_are_exclusive(tiny_base, tmp_path):
    with pytest.raises((ConfigError, ValueError), match="are exclusive"):
        _config(tiny_base, tmp_path, **{"rollout.openenv": {"url": "http://127.0.0.1:1"}})


def _tools_config(tiny_base, out, **overrides):
    return _config(tiny_base, out, **{
        "rollout.verifiers": {"taskset": "calc_tools_verifiers", "taskset_dir": ENVS,
                              "taskset_args": {"num_tasks": 4}},
        "rollout.tool_parser": "tag", "rollout.stop": ["</calc>"], "serve.describe_tools": False,
        "rollout.max_new_tokens": 12, "rollout.max_response_tokens": 96, **overrides,
    })  # fmt: skip


@pytest.mark.slow
def test_a_multi_turn_tool_environment_trains_its_calls_as_one_sample(tiny_base, tmp_path):
    """verifiers' harness hands the model's tool call to the task's MCP toolset and sends the
    result back: the server answers the harness's two calls with scripted turns (as the warm
    start does), so the call, the tool's result and the answer are known; the episode is one
    sample whose trained ids are exactly the two model turns (the tool turn masked out), and
    the rubric's rewards (correct 1, used_tool 1) reach the batch. Then 2 GRPO steps."""
    from groupflow.trainer import Trainer
    from groupflow.workflows.agent_episodes import AgentEpisode

    torch.set_num_threads(1)
    t = Trainer(_tools_config(tiny_base, tmp_path, **{"run.total_steps": 2}))
    try:
        wf, tok = t.workflow, t.policy.tokenizer
        rows = wf.train_rows[:2]
        scripts, turns = [], []
        for r in rows:
            data = wf.agent.tasks["train"][r.fields["vf_task"]].data
            turn_ids = [tok(x, add_special_tokens=False)["input_ids"]
                        for x in (f"<calc>{data.prompt[:-1]}</calc>", data.answer)]  # fmt: skip
            turn_ids[-1] = turn_ids[-1] + [tok.eos_token_id]
            scripts.append(turn_ids)
            turns.append(turn_ids)
        episodes = [AgentEpisode(r, i, i) for i, r in enumerate(rows)]
        left = wf._run_episodes(episodes, t.policy.sampling, scripts)
        assert left == [0, 0] and [e.failure for e in episodes] == [None, None]
        assert [e.reward for e in episodes] == [1.0, 1.0]
        assert all(e.extras == {"rewards/correct": 1.0, "rewards/used_tool": 1.0}
                   for e in episodes)  # fmt: skip
        assert [m["role"] for m in episodes[0].messages] == ["user", "assistant", "tool",
                                                             "assistant"]  # fmt: skip
        rewards, _ = wf.rewards(episodes)
        batch, counts = wf.samples_batch(episodes, rewards, "0-0", 0)
        assert counts["split_episodes"] == 0 and len(batch) == 2
        for i, turn_ids in enumerate(turns):
            ids = batch["responses"][i][batch["response_mask"][i].bool()].tolist()
            assert ids == turn_ids[0] + turn_ids[1]  # the tool's result between them: masked
            tool = tok.decode(batch["responses"][i][~batch["response_mask"][i].bool()].tolist())
            answer = wf.agent.tasks["train"][rows[i].fields["vf_task"]].data.answer
            assert answer in tool  # the calculator's result, from verifiers' MCP toolset
        final = t.fit()
    finally:
        t.workflow.close()
    assert "val/greedy/acc" not in final or final["val/greedy/failures"] == 0
    assert final["rollout/agent/episodes"] == 4


@pytest.mark.slow
def test_the_rollout_side_runs_the_trainers_tasks_without_listing_the_taskset_again(
    vf_log, tiny_base, tmp_path, monkeypatch
):
    """max_staleness 1: the agent workflow travels to the rollout side as built (its rows, the
    taskset's tasks), the side's adapter loads its environment over the trainer's tasks (pickled)
    with the taskset's listing refused, and the side's first batch equals the trainer's."""
    import pickle

    from groupflow.rollout.side import RolloutSide
    from groupflow.rollout.spec import BuiltWorkflow, LoaderSpec, RolloutSpec
    from groupflow.trainer import Trainer
    from groupflow.workflows.collect import collect_step

    torch.set_num_threads(1)
    t = Trainer(_config(tiny_base, tmp_path, **{"rollout.max_staleness": 1}))
    side = None
    try:
        source, workflow = t.source, t.workflow
        loader = LoaderSpec.of(t.loader)
        expected, _ = collect_step(workflow, loader.build(workflow.train_rows), source.sampling,
                                   0, 0)  # fmt: skip
        part = source.workflow
        assert isinstance(part, BuiltWorkflow) and part.workflow.recipe.tasks is not None
        spec = RolloutSpec(t.policy.start_async(), part, loader, source.sampling)
        data = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
        import calc_verifiers  # on sys.path: the trainer's adapter put its taskset_dir there

        def refused(self):
            raise AssertionError("the rollout side listed the taskset again")

        monkeypatch.setattr(calc_verifiers.CalcTaskset, "load", refused)
        side = RolloutSide(pickle.loads(data))
        monkeypatch.undo()
        mine, theirs = side.workflow.agent, workflow.agent
        assert mine is not theirs and side.workflow.train_rows == workflow.train_rows
        assert [x.data for x in mine.tasks["train"]] == [x.data for x in theirs.tasks["train"]]
        assert [x.data for x in mine.tasks["val"]] == [x.data for x in theirs.tasks["val"]]
        side.load(t.policy.snapshot())
        batch, metrics = side.collect(0, 0)
        assert metrics["rollout/agent/failures"] == 0
        for key in ("prompt", "completion"):
            assert list(batch[key]) == list(expected[key]), key
        for key in ("responses", "response_mask", "rewards", "version"):
            assert torch.equal(batch[key], expected[key]), key
    finally:
        if side is not None:
            side.close()
        t.shutdown()


def test_tasks_that_cannot_be_pickled_name_the_taskset_and_the_way_out():
    """The asynchronous rollout side runs the trainer's tasks: ones that cannot travel are a
    named error when the workflow is detached, not a side that lists the taskset again."""
    from groupflow.config import VerifiersConfig
    from groupflow.envs import VerifiersAgent

    agent = VerifiersAgent.__new__(VerifiersAgent)
    agent.cfg = VerifiersConfig(taskset="calc_verifiers")
    agent.tasks = {"train": [lambda: None], "val": []}
    with pytest.raises(ValueError, match=r"calc_verifiers.*cannot be pickled.*max_staleness: 0"):
        agent.built_tasks()
