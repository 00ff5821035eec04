"""Rewards: plain callables on (prompts, completions, dataset fields) -> one float per sample.

Design decision: user rewards are ordinary functions (sync or async) that never import
groupflow; :class:`RewardRunner` wraps them, isolates per-sample failures (counted and logged,
never silent) and combines components with weights. Built-ins are registered by name so configs
say ``rewards: [{name: gsm8k, weight: 1.0}]``; with no rewards configured, each sample's
``data_source`` picks its reward. The trainer calls :func:`build_reward_runner`.
"""

from groupflow.rewards.base import RewardFn, RewardFunction, RewardResult, RewardRunner
from groupflow.rewards.code import make_code_tests_reward
from groupflow.rewards.errors import (
    FailedScore,
    MissingRewardFieldError,
    RewardConfigError,
    RewardError,
    RewardOutputError,
)
from groupflow.rewards.format import make_format_tags_reward
from groupflow.rewards.judge import make_judge_reward
from groupflow.rewards.length import make_length_penalty, make_overlong_penalty
from groupflow.rewards.math import make_gsm8k_reward, make_math_boxed_reward
from groupflow.rewards.registry import (
    UnknownDataSourceError,
    UnknownRewardError,
    build_reward_runner,
    data_source_rewards,
    get_reward,
    make_reward_function,
    register_data_source,
    register_reward,
    registered_data_sources,
    resolve_import_path,
    reward_names,
)

__all__ = [
    "FailedScore",
    "MissingRewardFieldError",
    "RewardConfigError",
    "RewardError",
    "RewardFn",
    "RewardFunction",
    "RewardOutputError",
    "RewardResult",
    "RewardRunner",
    "UnknownDataSourceError",
    "UnknownRewardError",
    "build_reward_runner",
    "data_source_rewards",
    "get_reward",
    "make_code_tests_reward",
    "make_format_tags_reward",
    "make_gsm8k_reward",
    "make_judge_reward",
    "make_length_penalty",
    "make_math_boxed_reward",
    "make_overlong_penalty",
    "make_reward_function",
    "register_data_source",
    "register_reward",
    "registered_data_sources",
    "resolve_import_path",
    "reward_names",
]

# The image/video rewards are built-ins too: registering them here (not when the diffusion policy
# happens to be imported) keeps the set of reward names the same in every process.
import groupflow.diffusion.ocr  # noqa: E402,F401  (RapidOCR is imported when the reward is built)
import groupflow.diffusion.rewards  # noqa: E402,F401  (torch only; registers by name)
