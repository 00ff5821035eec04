"""The rule-based reward runner from ``reward`` and the reward functions given in Python.

Design decision: the runner gets plain specs and numbers (never the section), so it runs the
same in the trainer and on the asynchronous rollout side. Those specs and numbers are a
``RewardSpec``, a picklable description: a built runner may hold functions that a child process
cannot import (a ``path/to/file.py:fn`` reward is loaded under a synthetic module name), so the
rollout side receives the description and builds its own runner from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from groupflow.config import Config
from groupflow.rewards import build_reward_runner

__all__ = ["RewardSpec", "build_reward"]


@dataclass(frozen=True)
class RewardSpec:
    """What a rule-based reward runner is built from: the configured functions' specs (plain
    dicts), the functions given as Python objects, and the runner's numbers."""

    specs: tuple[dict[str, Any], ...] = ()
    functions: tuple = ()
    failure_value: float = 0.0
    timeout_s: float | None = None
    normalize: str = "none"
    normalize_eps: float = 1e-6

    @classmethod
    def from_config(cls, cfg: Config, functions: tuple = ()) -> RewardSpec:
        r = cfg.reward
        return cls(
            tuple(s.model_dump() for s in r.functions), tuple(functions), r.failure_value,
            r.timeout_s, r.normalize, r.normalize_eps,
        )  # fmt: skip

    def build(self):
        """The reward runner: the specs, then the functions; neither: each sample's
        ``data_source`` picks its reward."""
        return build_reward_runner(
            list(self.specs) or None,
            failure_value=self.failure_value,
            timeout_s=self.timeout_s,
            functions=self.functions,
            normalize=self.normalize,
            normalize_eps=self.normalize_eps,
        )


def build_reward(cfg: Config, functions: tuple = ()):
    """The reward runner: the config's ``reward.functions``, then ``functions`` (Python objects
    from the API); neither: each sample's ``data_source`` picks its reward."""
    return RewardSpec.from_config(cfg, functions).build()
