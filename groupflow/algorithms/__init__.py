"""GRPO-family math as pure tensor functions, each family behind a name registry.

Design decision: nothing here knows about models, workers or configs -- tensors in, tensors out,
shapes in the docstrings, conventions (verl vs TRL) as documented parameters -- so the trainer
selects variants by name and users add one by registering a function:

    advantages  compute_advantages(rewards, group_ids, estimator="grpo", **opts), compute_gae
    loss        policy_loss(logprobs, old_logprobs, advantages, mask, loss_fn="ppo_clip", agg=...)
    reduction   aggregate(values, mask, mode, num_tokens=, num_seqs=, max_len=), loss_denominators
    KL/entropy  kl_penalty(logprobs, ref_logprobs, kind), importance_weighted_kl,
                entropy_from_logits
    PPO         place_outcome_reward, kl_in_reward, Fixed/AdaptiveKLController, value_loss
    sampling    apply_sampling_filters, sample_from_logits, logprobs_from_logits
    distill     distillation_advantages (on-policy distillation: teacher reverse KL per token)
    mismatch    truncated_is_weights (TIS), decoupled_weights (decoupled PPO), logprob_mismatch
                (rollout engine or stale behaviour policy vs training forward)
    masks       response_span, response_widths, prompt_widths, last_valid_index (gaps in masks)
"""

from groupflow.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    GroupStats,
    compute_advantages,
    compute_gae,
    group_stats,
    register_advantage_estimator,
)
from groupflow.algorithms.aggregation import (
    AGGREGATIONS,
    aggregate,
    loss_denominators,
    register_aggregation,
)
from groupflow.algorithms.correction import (
    decoupled_weights,
    logprob_mismatch,
    truncated_is_weights,
)
from groupflow.algorithms.distillation import distillation_advantages, reverse_kl_per_token
from groupflow.algorithms.kl import (
    KL_ESTIMATORS,
    entropy_from_logits,
    importance_weighted_kl,
    kl_penalty,
    register_kl_estimator,
)
from groupflow.algorithms.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
)
from groupflow.algorithms.masks import (
    last_valid_index,
    prompt_widths,
    response_span,
    response_widths,
)
from groupflow.algorithms.policy_loss import (
    POLICY_LOSSES,
    masked_mean,
    policy_loss,
    register_policy_loss,
    zero_advantage_inert,
)
from groupflow.algorithms.registry import (
    Registry,
    UnknownNameError,
    UnknownOptionError,
)
from groupflow.algorithms.sampling import (
    apply_sampling_filters,
    logprobs_from_logits,
    sample_from_logits,
)
from groupflow.algorithms.token_rewards import (
    kl_in_reward,
    place_outcome_reward,
    sequence_mean_kl,
)
from groupflow.algorithms.value_loss import value_loss

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "build_kl_controller",
    "kl_in_reward",
    "last_valid_index",
    "prompt_widths",
    "response_span",
    "response_widths",
    "place_outcome_reward",
    "sequence_mean_kl",
    "value_loss",
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "GroupStats",
    "Registry",
    "UnknownNameError",
    "UnknownOptionError",
    "aggregate",
    "apply_sampling_filters",
    "compute_advantages",
    "compute_gae",
    "entropy_from_logits",
    "group_stats",
    "importance_weighted_kl",
    "kl_penalty",
    "logprobs_from_logits",
    "logprob_mismatch",
    "decoupled_weights",
    "distillation_advantages",
    "reverse_kl_per_token",
    "loss_denominators",
    "masked_mean",
    "policy_loss",
    "register_advantage_estimator",
    "register_aggregation",
    "register_kl_estimator",
    "register_policy_loss",
    "sample_from_logits",
    "truncated_is_weights",
    "zero_advantage_inert",
]
