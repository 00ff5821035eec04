"""What the asynchronous rollout side is built from: a picklable ``RolloutSpec`` of built parts.

Design decision (the review of 2026-12-01, Debt 3): the side receives the trainer's parts *as
built* — the workflow with its encoded prompts and options (``workflows.detach.PolicyParts``),
the loader's options and state, the sampling plan, the async mode — not the run's config to
build a second run from. It attaches its own policy view to that workflow and reads no config
section. What cannot be pickled travels as a small description and is rebuilt on the side:

- the policy: ``RolloutSpec.policy`` builds the policy's ``RolloutView`` (the frozen copy, its
  tokenizer, its reward-model copy when configured);
- the rule-based reward runner: a ``RewardSpec`` (its functions may come from a file a child
  cannot import, and the reward model it may wrap is the view's);
- the prompt loader: a ``LoaderSpec`` (options and state), built over the attached workflow's
  own rows, which is what the workflow looks prompts up by;
- the multi-turn workflow's tools, environment factory and turn format: rebuilt by its
  ``attach`` from its own ``rollout`` options over the view's tokenizer;
- lookups by row identity (the identities are the process's own): a ``PromptTable`` builds its
  own when unpickled, the diffusion workflow's ``attach`` its prompt texts;
- the agent workflow's agent, server and event loop: its ``attach`` finds the agent again from
  its ``AgentRecipe`` (``rollout.agent``'s import path; an OpenEnv adapter starts its own
  environment server; a verifiers adapter is given the trainer's tasks and does not list its
  taskset again) and starts the server and the loop where collect runs; its rows, the data
  section's or its environment's own, travel as built.

Every built-in workflow travels as built. The old route stays, behind ``RebuiltWorkflow``, for
one case only: a user's workflow class that does not declare it (``workflows.detach.
travels_as_built``: a custom class, or a subclass of a built-in one, which may keep more of the
policy than its parent's ``over_policy`` names) is rebuilt on the side from the run's config and
the trainer's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from groupflow.assembly.rewards import RewardSpec
from groupflow.data import PromptLoader
from groupflow.workflows import build_workflow, close_run, rule_reward_spec, rule_rewards
from groupflow.workflows.collect import Sampling
from groupflow.workflows.detach import PolicyParts, travels_as_built

__all__ = ["RolloutSpec", "LoaderSpec", "BuiltWorkflow", "RebuiltWorkflow", "workflow_part"]


@dataclass(frozen=True)
class LoaderSpec:
    """A prompt loader's options and state: the rollout side's replica of the trainer's."""

    prompts_per_step: int
    seed: int
    shuffle: bool
    drop_last: bool
    state: dict

    @classmethod
    def of(cls, loader: PromptLoader) -> LoaderSpec:
        return cls(loader.prompts_per_step, loader.seed, loader.shuffle, loader.drop_last,
                   loader.state_dict())  # fmt: skip

    def build(self, rows: Sequence) -> PromptLoader:
        """The loader over ``rows`` (the attached workflow's training rows), in this state."""
        loader = PromptLoader(rows, self.prompts_per_step, seed=self.seed, shuffle=self.shuffle,
                              drop_last=self.drop_last)  # fmt: skip
        loader.load_state_dict(self.state)
        return loader


@dataclass
class BuiltWorkflow:
    """The trainer's workflow without its policy (``PolicyParts.without_policy``: its encoded
    prompts and options) and the description of its rule-based rewards (None: a reward model
    alone scores)."""

    workflow: PolicyParts
    rewards: RewardSpec | None

    def with_policy(self, policy) -> Any:  # the workflow's own class (a Workflow)
        rules = None if self.rewards is None else self.rewards.build()
        return self.workflow.with_policy(policy, rules)


@dataclass
class RebuiltWorkflow:
    """The old route, kept only for a user's workflow class that does not declare
    ``travels_as_built`` (every built-in workflow does): built again on the side from the run's
    config (hub ids resolved) and the trainer's training rows, its prompts encoded again; the one
    check that the two agree is the row count. Declaring it (a ``workflows.detach.PolicyParts``
    with its own ``over_policy`` and ``attach``) sends the class as built instead."""

    cfg: Any
    run_dir: Path
    train_rows: list
    functions: tuple = ()  # reward functions given as Python objects (groupflow.Run)

    def with_policy(self, policy):
        rewards = rule_rewards(self.cfg, self.functions)
        workflow = build_workflow(self.cfg, policy, list(self.train_rows), [], rewards,
                                  Path(self.run_dir))  # fmt: skip
        if len(workflow.train_rows) != len(self.train_rows):
            close = getattr(workflow, "close", None)  # its own resources; the side the policy
            if close is not None:
                close()
            raise RuntimeError(
                f"the rollout side's workflow kept {len(workflow.train_rows)} of the "
                f"trainer's {len(self.train_rows)} training rows: its prompts would differ"
            )
        return workflow


def workflow_part(
    cfg, run_dir: Path, workflow, functions: tuple = ()
) -> BuiltWorkflow | RebuiltWorkflow:
    """What the rollout side gets of the trainer's ``workflow``: the built workflow when it
    travels as built (``workflows.detach.travels_as_built``), else the config to rebuild it from
    (``RebuiltWorkflow``). ``cfg``: the config the trainer built its run from; ``functions``:
    the rewards given in Python."""
    if travels_as_built(workflow):
        return BuiltWorkflow(workflow.without_policy(), rule_reward_spec(cfg, functions))
    return RebuiltWorkflow(cfg, run_dir, list(workflow.train_rows), tuple(functions))


@dataclass
class RolloutSpec:
    """Everything the rollout side is built from, built (picklable for a child process or a Ray
    actor; a thread receives it as it is)."""

    policy: Callable[[], Any]  # builds the policy's RolloutView (the frozen copy, tokenizer, ...)
    workflow: BuiltWorkflow | RebuiltWorkflow
    loader: LoaderSpec  # the trainer's prompt loader when the side starts
    sampling: Sampling
    async_mode: str = "deterministic"  # rollout.async_mode
    threads: int = 1  # torch threads of a child process

    def build(self):
        """(the policy view, the workflow attached to it, the loader over its rows); what was
        built closes again when a later part fails."""
        policy = self.policy()
        workflow = None
        try:
            workflow = self.workflow.with_policy(policy)
            return policy, workflow, self.loader.build(workflow.train_rows)
        except BaseException:
            close_run(workflow, policy)
            raise
