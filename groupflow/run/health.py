"""Training-health checks on each step's metrics: say so, once, when the policy has collapsed.

Design decision: a learning rate far too high (``actor.lr=1e6``) does not always produce NaNs — the
non-finite guard in the actor catches those — it can also drive the network into saturation, where
it outputs the same distribution whatever the input and every gradient is exactly 0. Training then
"runs" for hours at chance reward with nothing in the log. The signature is unambiguous: a gradient
norm of exactly 0 although some advantage is non-zero (a loss that depends on the weights cannot
have a zero gradient then), several steps in a row; when the policy's entropy is also at its
maximum, log |V|, the output is uniform. This module only watches and warns; it never stops a run,
because the check cannot know whether the user wants to look at the wreck.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import torch

log = logging.getLogger("groupflow")

__all__ = ["CollapseMonitor"]

# A gradient norm at or below this is "zero" (a live float32 network never gets this small).
_ZERO_GRAD = 1e-12


class CollapseMonitor:
    """Counts consecutive steps with a zero gradient despite non-zero advantages; warns once.

    ``lr`` is named in the warning; ``max_entropy`` (log of the vocabulary size, LLM policies)
    lets the warning say whether the output distribution has become uniform.
    """

    def __init__(self, lr: float, max_entropy: float | None = None, steps: int = 3) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.lr, self.max_entropy, self.steps = lr, max_entropy, steps
        self.in_a_row = 0
        self.warned = False

    def observe(self, metrics: Mapping[str, float], advantages: torch.Tensor) -> str | None:
        """Record one step; returns (and logs) the warning the first time the collapse has lasted
        ``steps`` steps, else None."""
        grad_norm = metrics.get("actor/grad_norm")
        dead = (
            grad_norm is not None
            and math.isfinite(grad_norm)
            and grad_norm <= _ZERO_GRAD
            and bool(advantages.abs().max() > 0)
        )
        self.in_a_row = self.in_a_row + 1 if dead else 0
        if self.warned or self.in_a_row < self.steps:
            return None
        self.warned = True
        message = (
            f"the policy has stopped learning: for {self.in_a_row} steps in a row the gradient "
            "norm was 0 although the advantages were not"
            + self._entropy_note(metrics.get("actor/entropy"))
            + f". Its weights were most likely wrecked by too large a learning rate "
            f"(actor.lr={self.lr:g}): lower actor.lr and start again (or resume from a "
            "checkpoint saved before the collapse)"
        )
        log.warning(message)
        return message

    def _entropy_note(self, entropy: float | None) -> str:
        if entropy is None or self.max_entropy is None or not math.isfinite(entropy):
            return ""
        if entropy >= 0.99 * self.max_entropy:
            return (
                f" and the entropy is {entropy:.3f} nats, the maximum log |V| = "
                f"{self.max_entropy:.3f}: the model outputs a uniform distribution"
            )
        return f" (entropy {entropy:.3f} nats)"
