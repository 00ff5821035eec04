"""The sections of what scores the samples: ``reward`` (rule-based reward functions and how they
combine), ``reward_model`` (a sequence-classification model) and ``teacher`` (on-policy
distillation).

Design decision: every signal a sample is trained on is configured here, each with its weight in
the combination, so the trained reward is read off one place; a reward that is only reported
(``monitor``) is declared beside the trained ones, and a config where nothing is trained on is
an error.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    model_validator,
)

from groupflow.config.base import _Section


class RewardFunctionConfig(_Section):
    name: str | None = None  # a built-in reward
    function: str | None = None  # "package.module:function"
    label: str | None = None  # component name, to use one built-in twice
    weight: float = 1.0  # its weight in the weighted sum of rewards
    failure_value: float | None = None  # None: reward.failure_value
    # keyword arguments passed to the reward on every call
    kwargs: dict[str, Any] = Field(default_factory=dict)
    # true: scored and logged as reward/<label>/mean (val/ too) but not trained on: a held-out
    # reward beside the trained ones, to see the model hack them
    monitor: bool = False

    @model_validator(mode="after")
    def _one(self):
        if (self.name is None) == (self.function is None):
            raise ValueError(
                "each reward needs exactly one of 'name' (built-in) or 'function' (import path)"
            )
        if self.monitor and self.weight != 1.0:
            raise ValueError(
                f"weight: a monitor reward is not trained on, so weight={self.weight:g} has no "
                "effect; drop weight or set monitor: false"
            )
        return self


class RewardConfig(_Section):
    functions: list[RewardFunctionConfig] = Field(default_factory=list)  # empty: by data_source
    # the reward of a sample whose reward call raised, timed out or returned no number
    failure_value: float = 0.0
    # Seconds each reward call may take (the batched call; then the per-sample retries share as
    # much again). A sample with no value by then gets failure_value and counts in
    # reward/<name>/timeouts. Calls run in a background thread: async ones are cancelled at the
    # deadline, sync ones abandoned (groupflow.rewards.calls). null: no limit, called in the
    # driver's own thread (for rewards that need the main thread, e.g. signal-based timeouts).
    timeout_s: float | None = Field(default=300.0, gt=0)
    # How the trained rewards combine into a training batch's reward: "none", their weighted
    # sum; "group", the weighted sum of each reward's z-score inside its prompt's group (GDPO),
    # so that a reward with a narrow spread is not drowned by a wide one. Validation and eval
    # report the plain weighted sum either way (groupflow.rewards.combine).
    normalize: Literal["none", "group"] = "none"
    # added to each group's std under normalize: group
    normalize_eps: float = Field(default=1e-6, ge=0)

    @model_validator(mode="after")
    def _trained(self):
        if self.functions and all(f.monitor for f in self.functions):
            raise ValueError(
                "functions: every reward is a monitor (monitor: true); at least one must be "
                "trained on"
            )
        return self


class RewardModelConfig(_Section):
    """A sequence-classification reward model (a local HF directory or a Hub id), scoring
    prompt + response."""

    path: str  # a local HF directory or a Hub id of a sequence-classification model
    revision: str | None = None  # of a Hub id in path / tokenizer_path
    tokenizer_path: str | None = None  # defaults to path
    weight: float = 1.0  # its weight in the sum with the rule-based rewards
    label: str = "reward_model"  # component name in the reward metrics
    only: bool = False  # true: the model is the whole reward (reward.functions are ignored)
    use_chat_template: bool | None = None  # None: when the prompt is chat messages and it has one
    max_length: int = Field(default=2048, ge=8)  # tokens of prompt + response kept (from the left)
    micro_batch_samples: int = Field(default=16, ge=1)  # samples scored per forward
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # parameter dtype
    trust_remote_code: bool = False  # allow the model directory's own modelling code


class TeacherConfig(_Section):
    """On-policy distillation: a frozen teacher (a local HF directory or a Hub id, any size, the
    student's tokenizer) scores every token the student samples; each token's advantage gets
    ``-coef * (log pi_student - log pi_teacher)`` (the per-token reverse KL, undiscounted) on top
    of ``reward_weight`` times the outcome advantage of the rewards (0: distillation alone).
    The teacher runs in its own worker group: placed like the actor (the same processes and
    devices) unless ``placement.teacher`` gives it a pool.

    With a ``diffusion`` policy the teacher is a flow model of the student's kind, latent and
    conditioning (checked at load), held frozen inside each actor worker; it predicts the
    velocity on the student's SDE states, and the exact per-step KL between the two transition
    Gaussians is a loss term: ``reward_weight * L_pg + coef * L_kl``
    (``groupflow.diffusion.distillation``)."""

    path: str  # a local HF directory or a Hub id (the student's tokenizer)
    revision: str | None = None  # of a Hub id in path
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # parameter dtype
    trust_remote_code: bool = False  # allow the model directory's own modelling code
    coef: float = Field(default=1.0, ge=0)  # weight of the per-token reverse KL to the teacher
    # weight of the rewards' outcome advantage (0: distillation alone)
    reward_weight: float = Field(default=1.0, ge=0)
