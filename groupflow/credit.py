"""Credit assignment: a rewarded batch's advantages (and returns), whatever produced it.

Design decision: this stage reads only the batch's generic keys — ``rewards``, ``group_ids``,
``response_mask``, and when configured ``values`` (a critic), ``old_logprobs``/``ref_logprobs``
(KL in the reward) and ``teacher_logprobs`` (on-policy distillation: per-token advantages) — so
one implementation serves single-turn, multi-turn and diffusion workflows alike. It is the only
stateful piece between rollout and update (the adaptive KL controller's β), which it checkpoints
itself. The math is ``groupflow.algorithms``'.
"""

from __future__ import annotations

from typing import Any

import torch

from groupflow.algorithms import (
    ADVANTAGE_ESTIMATORS,
    build_kl_controller,
    compute_advantages,
    compute_gae,
    distillation_advantages,
    kl_in_reward,
    place_outcome_reward,
    sequence_mean_kl,
)
from groupflow.algorithms.registry import option_names
from groupflow.batch import Batch
from groupflow.config import AlgorithmConfig, TeacherConfig, present
from groupflow.utils.seeds import sample_seed

__all__ = ["CreditAssignment", "estimator_options"]


def estimator_options(al: AlgorithmConfig) -> dict[str, Any]:
    """The typed options (scale, eps) the chosen estimator declares, plus its free-form extras."""
    if al.estimator == "gae":  # token-level: gamma, lam, whiten_advantages are its options
        return {}
    accepted = option_names(ADVANTAGE_ESTIMATORS.get(al.estimator)) or ()
    typed = {k: getattr(al, k) for k in ("scale", "eps") if k in accepted}
    return {**typed, **al.estimator_options}


class CreditAssignment:
    """``batch → (batch, metrics)``: ``advantages`` (and ``returns`` for GAE) added; metrics of
    the KL-in-reward controller when configured."""

    def __init__(self, al: AlgorithmConfig, run_seed: int, teacher: TeacherConfig | None = None):
        self.al, self.run_seed, self.teacher = al, run_seed, teacher
        self.options = estimator_options(al)
        k = al.kl_in_reward
        self.kl_ctrl = (
            build_kl_controller(k.controller, k.coef, k.target_kl, k.horizon)
            if k is not None
            else None
        )

    def __call__(self, batch: Batch, step: int) -> tuple[Batch, dict[str, float]]:
        al = self.al
        rewards = batch["rewards"]
        metrics: dict[str, float] = {}
        if al.kl_in_reward is not None or al.estimator == "gae":
            token_rewards, metrics = self.token_rewards(batch)
            if al.estimator == "gae":
                batch["advantages"], batch["returns"] = compute_gae(
                    token_rewards, batch["values"], batch["response_mask"],
                    al.gamma, al.lam, al.whiten_advantages,
                )  # fmt: skip
                return batch, metrics
            rewards = token_rewards.sum(-1)  # outcome estimators see r - β·ΣKL (as verl does)
        batch["advantages"] = self.outcome_advantages(batch, rewards)
        if self.teacher is not None:
            batch["advantages"], distill_metrics = self.distill(batch)
            metrics.update(distill_metrics)
        if al.shuffle_advantages:  # the control run (see AlgorithmConfig.shuffle_advantages)
            g = torch.Generator().manual_seed(sample_seed(self.run_seed, step, -2))
            batch["advantages"] = batch["advantages"][torch.randperm(len(batch), generator=g)]
        return batch, metrics

    def outcome_advantages(self, batch: Batch, rewards: torch.Tensor) -> torch.Tensor:
        """The estimator over the batch's samples — or, when the batch has ``episode_ids`` (an
        agent episode split into several samples, ``workflows.agent_episodes``), over its
        episodes: each episode counts once in its group's statistics and all its samples share
        its advantage."""
        al = self.al
        groups = batch["group_ids"]
        first = None
        if "episode_ids" in batch:
            episodes, inverse = torch.unique(batch["episode_ids"], return_inverse=True)
            # one representative sample per episode (its first), in episode order
            order = torch.arange(len(inverse))
            first = torch.full((len(episodes),), len(inverse), dtype=torch.long)
            first = first.scatter_reduce(0, inverse, order, reduce="amin")
            rewards, groups = rewards[first], groups[first]
        adv = compute_advantages(
            rewards, groups, al.estimator, adv_clip_max=al.adv_clip_max,
            reward_threshold=al.reward_threshold, **self.options,
        )  # fmt: skip
        return adv if first is None else adv[inverse]

    def distill(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """[B, T] advantages: the teacher's per-token reverse-KL term plus the weighted outcome
        advantage (groupflow.algorithms.distillation); and the mean reverse KL as a metric."""
        t, mask = present(self.teacher, "teacher"), batch["response_mask"]
        student, teacher = batch["old_logprobs"], batch["teacher_logprobs"]
        with torch.no_grad():
            valid = mask != 0
            kl = torch.where(valid, student - teacher, 0.0).sum() / valid.sum().clamp(min=1)
        advantages = distillation_advantages(
            batch["advantages"], student, teacher, mask, coef=t.coef, reward_weight=t.reward_weight
        )
        return advantages, {"distill/reverse_kl": float(kl)}

    def token_rewards(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """The outcome reward on each sample's last valid token, minus β·KL when configured;
        (token rewards [B, T], the KL controller's metrics)."""
        mask = batch["response_mask"]
        token_rewards = place_outcome_reward(batch["rewards"], mask)
        k, ctrl = self.al.kl_in_reward, self.kl_ctrl
        if k is None or ctrl is None:  # the controller exists exactly when kl_in_reward is set
            return token_rewards, {}
        beta = ctrl.value
        token_rewards, kl = kl_in_reward(
            token_rewards, batch["old_logprobs"], batch["ref_logprobs"], mask, beta, k.kind
        )
        current = float(sequence_mean_kl(kl, mask))
        ctrl.update(current, n_steps=len(batch))
        return token_rewards, {"kl_in_reward/kl": current, "kl_in_reward/coef": beta}

    def state_dict(self) -> dict[str, Any]:
        return {"kl_controller": self.kl_ctrl.state_dict()} if self.kl_ctrl is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.kl_ctrl is not None and "kl_controller" in state:
            self.kl_ctrl.load_state_dict(state["kl_controller"])
