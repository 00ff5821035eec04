"""The rollout side is built from a picklable ``RolloutSpec`` of the trainer's built parts.

What is checked: the spec survives a pickle round trip (a child process's route), the side built
from it draws the trainer's prompts in the trainer's order with the token ids the trainer encoded
(no prompt is encoded again, no config section is read), and its first batch equals the one the
trainer's own workflow collects with the same weights — for the single-turn workflow, the
multi-turn one with tools, a run with a reward model (its runner rebuilt over the side's copy),
a vision-language model on image prompts, and the agent workflow with a Python agent and with an
OpenEnv environment (its agent found again from its recipe, its server, event loop and the
environment's server started on the side). A user's workflow class that does not declare
``travels_as_built`` takes the old route (``RebuiltWorkflow``); the verifiers adapter's tasks
travel as built too (tests/envs/test_verifiers.py, in its own environment).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pickle
from pathlib import Path

import pytest
import torch

from groupflow.config import Config
from groupflow.rollout import side as side_module
from groupflow.rollout import spec as spec_module
from groupflow.rollout.side import RolloutSide
from groupflow.rollout.spec import (
    BuiltWorkflow,
    LoaderSpec,
    RebuiltWorkflow,
    RolloutSpec,
    workflow_part,
)
from groupflow.trainer import Trainer
from groupflow.workflows import collect, multi_turn, single_turn
from groupflow.workflows.agent import AgentRecipe, AgentWorkflow
from groupflow.workflows.collect import collect_step
from groupflow.workflows.detach import travels_as_built
from groupflow.workflows.llm import PromptTable
from tests.workflows.calc_tools import CALC_TOOLS

# a tiny vision-language model on image prompts (tests/test_vlm_trainer.py's)
VLM = {
    "model": {"tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "max_positions": 32,
                       "vision": {"image_size": 32, "patch_size": 8, "scale_factor": 2,
                                  "hidden_size": 16, "num_layers": 1}}},
    "data": {"task": {"name": "shapes", "num_train": 64, "num_val": 8}, "min_pixels": 1024,
             "prompts_per_step": 4},
    "rollout": {"samples_per_prompt": 4, "max_new_tokens": 2, "max_staleness": 1},
}  # fmt: skip


TESTS = Path(__file__).resolve().parents[1]
ENVS = TESTS.parent / "examples" / "envs"

# the agent workflow on the calculator task (tests/workflows/test_agent.py's): a Python agent
# making two calls per episode through the run's server
AGENT = dict(
    model__tiny={"hidden_size": 32, "num_layers": 2, "num_heads": 2, "max_positions": 256},
    data__task={"name": "calc", "digits": 2, "num_train": 64, "num_val": 4},
    data__prompts_per_step=2, rollout__samples_per_prompt=2, rollout__max_new_tokens=8,
    rollout__max_response_tokens=64, rollout__workflow="agent",
    rollout__agent="serve_agents:two_calls", rollout__agent_timeout_s=30,
    reward__failure_value=-1.0, serve__describe_tools=False, rollout__tool_parser="tag",
)  # fmt: skip

# an OpenEnv environment as the agent (tests/envs/test_openenv.py's), its server started by the run
OPENENV = {
    **AGENT, "rollout__agent": None, "rollout__max_new_tokens": 12,
    "rollout__max_response_tokens": 96, "rollout__stop": ["</calc>"],
    "rollout__openenv": {"app": "calc_openenv.server.app:app", "app_dir": str(ENVS),
                         "reset_fields": ["prompt", "answer"], "max_turns": 3,
                         "startup_timeout_s": 60, "step_timeout_s": 10},
}  # fmt: skip


def _reward_model(tmp_path: Path) -> dict:
    path = Path(__file__).parents[1] / "workers" / "test_reward_model.py"
    found = importlib.util.spec_from_file_location("rmt", path)
    assert found is not None and found.loader is not None
    rmt = importlib.util.module_from_spec(found)
    found.loader.exec_module(rmt)
    return {"reward_model": {"path": str(rmt.save_tiny_reward_model(tmp_path / "rm")),
                             "weight": 0.5}}  # fmt: skip


def _no_config_reads(monkeypatch) -> None:
    """What rebuilt the side from the config before: building it now must call none of it."""

    def refused(*args, **kwargs):
        raise AssertionError("the rollout side rebuilt a part from the config")

    for module, name in [(spec_module, "build_workflow"), (spec_module, "rule_rewards"),
                         (single_turn, "encode_prompts"), (multi_turn, "encode_prompts")]:  # fmt: skip
        monkeypatch.setattr(module, name, refused)
    monkeypatch.setattr(collect, "prompt_loader", refused)
    monkeypatch.setattr(collect.Sampling, "from_config", refused)
    # the agent workflow is not constructed again: its rows (the data section's, or its
    # environment's own) travel as built
    monkeypatch.setattr(AgentWorkflow, "__init__", refused)


@pytest.mark.parametrize(
    "what", ["single_turn", "multi_turn", "reward_model", "vlm", "agent", "openenv"]
)
def test_the_side_built_from_the_pickled_spec_collects_as_the_trainers_workflow(
    tiny_config, tmp_path, monkeypatch, what
):
    overrides = {"multi_turn": CALC_TOOLS, "vlm": VLM, "agent": AGENT, "openenv": OPENENV}.get(
        what, {}
    )
    if what == "reward_model":
        overrides = _reward_model(tmp_path)
    if what == "agent":
        monkeypatch.syspath_prepend(str(TESTS))  # serve_agents
    if what == "openenv":
        pytest.importorskip("openenv", reason="needs openenv (pip install 'groupflow[openenv]')")
    trainer = Trainer(tiny_config(**{"run__total_steps": 2, "rollout__max_staleness": 1,
                                     **overrides}))  # fmt: skip
    side = None
    try:
        source, workflow = trainer.source, trainer.workflow
        loader = LoaderSpec.of(trainer.loader)
        # the batch of step 0 as the synchronous trainer collects it (version 0's weights)
        expected, _ = collect_step(workflow, loader.build(workflow.train_rows), source.sampling,
                                   0, 0)  # fmt: skip
        part = source.workflow
        assert isinstance(part, BuiltWorkflow) and part.workflow.policy is None
        if what in ("agent", "openenv"):  # nothing live travels: the agent is found again
            assert not {"agent", "_server", "_loop", "_blocked"} & set(vars(part.workflow))
            assert part.workflow.recipe == AgentRecipe(None)
        spec = RolloutSpec(trainer.policy.start_async(), part, loader, source.sampling,
                           source.async_mode)  # fmt: skip
        assert not any(isinstance(v, Config) for v in vars(spec).values())
        data = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
        _no_config_reads(monkeypatch)
        side = RolloutSide(pickle.loads(data))
        monkeypatch.undo()
        assert side.workflow.policy is side.policy and side.workflow is not workflow
        assert side.workflow.contracts == workflow.contracts
        if what == "reward_model":  # the side's own reward-model copy scores its batches
            assert side.workflow.reward_fn.scorer is side.policy.reward_model
            assert side.policy.reward_model is not trainer.policy.reward_model
        # the trainer's prompts, in its order, with the token ids it encoded
        theirs = loader.build(workflow.train_rows)
        for _ in range(3):
            mine, rows = side.loader.next_batch(), theirs.next_batch()
            assert [(r.source, r.index) for r in mine] == [(r.source, r.index) for r in rows]
            if what in ("agent", "openenv"):  # the rows themselves
                assert mine == rows
            else:
                assert side.workflow.train.lookup(mine) == workflow.train.lookup(rows)
        if what == "agent":  # found again by its import path (the same function, in one process)
            assert side.workflow.agent is workflow.agent
        if what == "openenv":  # the side's adapter started an environment server of its own
            assert side.workflow.agent.server.url != workflow.agent.server.url
        side.loader = loader.build(side.workflow.train_rows)
        side.load(trainer.policy.snapshot())
        batch, _ = side.collect(0, 0)
        for key in ("prompt", "completion"):
            assert list(batch[key]) == list(expected[key]), key
        for key in ("responses", "response_mask", "rewards", "version"):
            assert torch.equal(batch[key], expected[key]), key
        if what == "vlm":  # the prompts' images, encoded by the trainer, reach the side's model
            assert side.workflow.train.vision(mine) is not None
    finally:
        if side is not None:
            side.close()
        trainer.shutdown()


def test_a_prompt_table_finds_its_rows_again_after_a_pickle_round_trip():
    """The table looks rows up by identity: an unpickled one over its own row objects."""
    from groupflow.assembly.data import EncodedPrompts
    from groupflow.data import PromptRow

    rows = [PromptRow(prompt=f"p{i}", index=i, source="s", fields={}) for i in range(3)]
    encoded = EncodedPrompts(rows=rows, texts=["a", "b", "c"], ids=[[1], [2], [3]])
    table = pickle.loads(pickle.dumps(PromptTable(encoded)))
    assert table.lookup(table.rows[::-1]) == (["c", "b", "a"], [[3], [2], [1]])


def test_a_workflow_that_does_not_travel_as_built_is_rebuilt_from_the_config(tmp_path):
    """A workflow that does not declare ``travels_as_built`` in its own class body (a custom
    class, a user's subclass of a built-in one, the agent workflow's included, which may keep
    more of the policy than its parent) takes the old route: the config and the trainer's rows.
    Every built-in workflow travels as built."""

    class Custom:
        train_rows = [1, 2, 3]

    class Subclass(single_turn.SingleTurnWorkflow):
        def __init__(self):  # only what workflow_part reads
            self.train = type("T", (), {"rows": [4, 5]})()

    class AgentSubclass(AgentWorkflow):
        train_rows = [6]  # type: ignore[assignment]  # only what workflow_part reads

    for workflow, rows in ((Custom(), [1, 2, 3]), (Subclass(), [4, 5]),
                           (AgentSubclass.__new__(AgentSubclass), [6])):  # fmt: skip
        part = workflow_part("cfg", tmp_path, workflow, ("reward",))
        assert part == RebuiltWorkflow("cfg", tmp_path, rows, ("reward",))
    for cls in (single_turn.SingleTurnWorkflow, multi_turn.MultiTurnWorkflow, AgentWorkflow):
        assert travels_as_built(cls.__new__(cls))
    assert [f.name for f in dataclasses.fields(RolloutSpec)] == [
        "policy", "workflow", "loader", "sampling", "async_mode", "threads"
    ]  # fmt: skip
    assert side_module.RolloutSpec is RolloutSpec


def test_an_agent_attach_that_fails_closes_the_agent_it_built(monkeypatch):
    """The side gets no workflow to close when ``attach`` fails: the agent it built (an OpenEnv
    adapter's server) is closed there."""
    closed = []

    class Adapter:
        def close(self):
            closed.append("agent")

    def fails(self, policy, rewards):
        raise RuntimeError("no reward runner")

    monkeypatch.setattr(AgentRecipe, "build", lambda self, rollout_cfg: Adapter())
    monkeypatch.setattr(AgentWorkflow, "_over_policy", fails)
    part = AgentWorkflow.__new__(AgentWorkflow)
    part.cfg, part.recipe = type("C", (), {"rollout": None})(), AgentRecipe()
    with pytest.raises(RuntimeError, match="no reward runner"):
        part.with_policy("policy", None)
    assert closed == ["agent"]
