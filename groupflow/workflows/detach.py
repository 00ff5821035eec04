"""A built workflow without its policy, and the same workflow attached to another policy.

Design decision (the review of 2026-12-01, Debt 3): the asynchronous rollout side receives the
trainer's workflow *as built* — its encoded prompts, its options — instead of the config to
build a second one from (which re-encoded every prompt and re-read every section). What is
built over the policy cannot travel and is not the workflow's own: the policy itself (worker
groups), its contracts, the reward runner (it may wrap the policy's reward model, and its
functions may come from a file a child process cannot import) and, for a workflow that has
them, objects over the policy's tokenizer or live resources (tools, an environment factory;
the agent workflow's agent, server and event loop).
``without_policy`` drops exactly those (``over_policy``); ``with_policy`` copies the detached
workflow and lets it ``attach`` them again over the given policy, from the workflow's own state
and a freshly built reward runner. Copies are shallow: what both share (encoded prompts, rows)
is read only.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["PolicyParts", "travels_as_built"]


def travels_as_built(workflow) -> bool:
    """Whether ``workflow`` can go to the rollout side as built: a ``PolicyParts`` whose own
    class body sets ``travels_as_built = True``. A subclass of a built-in workflow that does not
    (a user's, which may keep the policy's groups in attributes of its own) is rebuilt there
    from the config instead."""
    return isinstance(workflow, PolicyParts) and vars(type(workflow)).get("travels_as_built", False)


class PolicyParts:
    """Mixin of the workflows that can travel to the rollout side as built."""

    policy: Any
    # the attributes built over the policy: dropped by without_policy, rebuilt by attach
    over_policy: tuple[str, ...] = ("reward_fn", "contracts")
    # set in the body of each class that travels as built (not inherited: a subclass may hold
    # more over the policy than its parent's over_policy names): see ``travels_as_built``
    travels_as_built: bool = False

    def without_policy(self):
        """A copy without the policy and what is built over it (picklable when its prompts and
        options are)."""
        part = copy.copy(self)
        part.policy = None
        for name in self.over_policy:
            vars(part).pop(name, None)
        return part

    def with_policy(self, policy, rewards):
        """A copy over ``policy`` (e.g. the rollout side's ``RolloutView``) with ``rewards``, the
        rule-based reward runner (None: a reward model alone scores)."""
        workflow = copy.copy(self)
        workflow.policy = policy
        workflow.attach(policy, rewards)
        return workflow

    def attach(self, policy, rewards) -> None:
        """Rebuild ``over_policy`` over ``policy`` (``self.policy`` is ``policy`` already)."""
        raise NotImplementedError
