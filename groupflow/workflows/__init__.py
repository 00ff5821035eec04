"""Workflows: how a batch of experience is produced. The trainer knows only this interface.

Design decision (the seed's §11 roadmap; AReaL's ``RolloutWorkflow``, verl's agent loop, TRL's
``environment_factory``): producing experience is an object, chosen by config, and the driver
loop is blind to what it produces — one completion per prompt, a conversation with tools, or the
denoising trajectory of an image generator:

    class Workflow(Protocol):
        contracts: dict[str, Contract]     # the stage contracts of its batches
        train_rows: list[PromptRow]        # what the prompt loader draws from (after filtering)
        data_stats: dict[str, float]       # logged before training
        def collect(rows, step, round_, version) -> (Batch, metrics)  # rollout + rewards
        def step_metrics(batch, seconds) -> dict[str, float]
        def validate(step) -> dict[str, float]
        def warm_start() -> dict[str, float]               # before RL (SFT); {} when none

A workflow's ``collect`` returns its batch ('rewarded' contract) and that stage's metrics (reward
and episode statistics) as values; ``step_metrics`` computes what the trained batch itself shows.
A workflow works with a *policy* through its ``PolicyView`` (``groupflow.policies.base``): it
generates through the policy's ``rollout`` group, and the trainer hands its batches to the policy's
``prepare``/``update``. Every sample carries the ``version`` of the policy that generated it
(the number of updates applied so far), contract-checked, for asynchronous rollout. There a
copy of the workflow runs on the rollout side (``groupflow.rollout.side``, a child process by
default) over the policy's ``RolloutView`` — ``rollout``, ``tokenizer``, ``sampling``,
``contracts``, ``reward_model``, no ``actor`` — and only its ``collect`` is called there: a
custom workflow's ``collect`` must use no more of the policy than that (its
``validate``/``warm_start`` run in the trainer as always). Every built-in workflow travels
there as built (``workflows.detach.PolicyParts``: the trainer's encoded prompts or rows, the
policy and what is built over it — for the agent workflow its agent, server and event loop —
left behind and attached again); a custom class is built a second time there from the config
and the trainer's rows (``rollout.spec.RebuiltWorkflow``), unless it is a ``PolicyParts`` that
declares ``travels_as_built`` in its own body.

Built-in workflows (``rollout.workflow``): ``single_turn``, ``multi_turn`` (tools or an
environment; chosen automatically when ``rollout.max_turns > 1``, ``rollout.tools`` or
``rollout.environment`` is set), ``diffusion`` (with a ``diffusion:`` section), ``agent`` (your
own agent code through the run's OpenAI-compatible server, ``rollout.agent``). A custom one is
an import path (``package.module:Class`` or ``path/to/file.py:Class``) whose constructor takes
``(cfg, policy, train_rows, val_rows, rewards)`` — ``rewards`` is the configured reward runner,
or None when a reward model alone scores — and may declare ``provided_fields`` (per-sample fields
it hands the reward functions besides the dataset's) and a ``tokenizer_texts(cfg)`` static method
(text a tiny model's character tokenizer must cover); one that writes files of its own sets
``takes_run_dir = True`` and gets the run directory as a sixth argument. See
``examples/workflows/``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol

from groupflow.assembly.rewards import RewardSpec
from groupflow.batch import Batch
from groupflow.config import Config
from groupflow.data import PromptRow
from groupflow.utils.imports import resolve_import_path

__all__ = [
    "Workflow",
    "workflow_name",
    "workflow_class",
    "BUILTIN_WORKFLOWS",
    "build_workflow",
    "rule_rewards",
    "rule_reward_spec",
    "close_run",
]


class Workflow(Protocol):
    contracts: dict[str, Any]
    data_stats: dict[str, float]  # logged before training (e.g. prompts kept after filtering)

    @property
    def train_rows(self) -> list[PromptRow]: ...

    def collect(self, rows: list[PromptRow], step: int, round_: int,
                version: int) -> tuple[Batch, dict[str, float]]: ...  # fmt: skip

    def step_metrics(self, batch: Batch, seconds: float) -> dict[str, float]: ...

    def validate(self, step: int) -> dict[str, float]: ...

    def warm_start(self) -> dict[str, float]: ...


def workflow_name(cfg: Config) -> str:
    """The configured workflow, ``auto`` resolved."""
    name = cfg.rollout.workflow
    return cfg.kind.auto_workflow(cfg) if name == "auto" else name


# The built-in workflows by import path, like a custom one: importing this package (the rollout
# side, the benchmarks through ``workflows.llm``) loads only the configured workflow's module and
# its dependencies (the agent workflow's web server, the diffusion workflow's image code).
BUILTIN_WORKFLOWS = {
    "single_turn": "groupflow.workflows.single_turn:SingleTurnWorkflow",
    "multi_turn": "groupflow.workflows.multi_turn:MultiTurnWorkflow",
    "diffusion": "groupflow.workflows.diffusion:DiffusionWorkflow",
    "agent": "groupflow.workflows.agent:AgentWorkflow",
}


def workflow_class(cfg: Config) -> type:
    name = workflow_name(cfg)
    if name in BUILTIN_WORKFLOWS:  # ours: an import failure (a missing extra) is raised as it is
        module, _, attr = BUILTIN_WORKFLOWS[name].partition(":")
        return getattr(importlib.import_module(module), attr)
    return resolve_import_path(name, "rollout.workflow")


def rule_reward_spec(cfg: Config, functions: tuple = ()) -> RewardSpec | None:
    """What the rule-based reward runner is built from (config functions, then ``functions``
    given as Python objects; picklable), or None when a reward model alone scores."""
    rm_only = cfg.reward_model is not None and cfg.reward_model.only
    if rm_only and functions:
        raise ValueError(
            "reward_model.only=true: the reward model is the whole reward, so the rewards "
            "given to groupflow.Run would be ignored; drop them or set reward_model.only=false"
        )
    return None if rm_only else RewardSpec.from_config(cfg, functions)


def rule_rewards(cfg: Config, functions: tuple = ()):
    """The rule-based reward runner (config functions, then ``functions`` given as Python
    objects), or None when a reward model alone scores."""
    spec = rule_reward_spec(cfg, functions)
    return None if spec is None else spec.build()


def build_workflow(cfg: Config, policy, train_rows: list[PromptRow], val_rows: list[PromptRow],
                   rewards, run_dir: Path):  # fmt: skip
    """The configured workflow over ``policy`` (the trainer's, or the asynchronous rollout side's
    ``RolloutView``)."""
    cls = workflow_class(cfg)
    # a workflow that writes files of its own (the diffusion workflow's image grids) asks for them
    if getattr(cls, "takes_run_dir", False):
        return cls(cfg, policy, train_rows, val_rows, rewards, run_dir)
    return cls(cfg, policy, train_rows, val_rows, rewards)


def close_run(workflow, policy) -> None:
    """Close what ``groupflow.workflows.build.build_run`` built: the workflow's own resources first (the agent workflow's
    server and event loop, which would outlive a Ray actor or a thread), then the policy's worker
    groups, even when the workflow's close fails or the workflow was never built (None)."""
    close = getattr(workflow, "close", None)
    try:
        if close is not None:
            close()
    finally:
        policy.shutdown()
