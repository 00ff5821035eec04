"""The rule-based reward runner from ``reward`` and the reward functions given in Python.

Design decision: the runner gets plain specs and numbers (never the section), so it runs the
same in the trainer and on the asynchronous rollout side.
"""

from __future__ import annotations

from groupflow.config import Config
from groupflow.rewards import build_reward_runner

__all__ = ["build_reward"]


def build_reward(cfg: Config, functions: tuple = ()):
    """The reward runner: the config's ``reward.functions``, then ``functions`` (Python objects
    from the API); neither: each sample's ``data_source`` picks its reward."""
    specs = [s.model_dump() for s in cfg.reward.functions] or None
    return build_reward_runner(
        specs,
        failure_value=cfg.reward.failure_value,
        timeout_s=cfg.reward.timeout_s,
        functions=functions,
        normalize=cfg.reward.normalize,
        normalize_eps=cfg.reward.normalize_eps,
    )
