"""KL coefficient controllers for the KL penalty in the reward: fixed β, or adaptive (Ziegler et al.).

Design decision: a controller is a tiny object with ``value``, ``update(current_kl, n_steps)`` and
``state_dict``/``load_state_dict`` — the one piece of algorithm state that lives across steps, so
it must be checkpointed with the run (resume continues with the same β). The adaptive rule is
verl's ``AdaptiveKLController`` exactly: e = clip(KL / target − 1, −0.2, 0.2),
β ← β · (1 + e · n_steps / horizon), where n_steps is the number of samples in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["FixedKLController", "AdaptiveKLController", "build_kl_controller", "adaptive_kl_update"]

_MAX_PROPORTIONAL_ERROR = 0.2


def adaptive_kl_update(
    value: float, current_kl: float, target_kl: float, horizon: int, n_steps: int
) -> float:
    """One adaptive step: β · (1 + clip(KL/target − 1, ±0.2) · n_steps / horizon)."""
    error = min(
        max(current_kl / target_kl - 1.0, -_MAX_PROPORTIONAL_ERROR), _MAX_PROPORTIONAL_ERROR
    )
    return value * (1.0 + error * n_steps / horizon)


@dataclass
class FixedKLController:
    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """A fixed β ignores the observed KL."""

    def state_dict(self) -> dict:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


@dataclass
class AdaptiveKLController:
    value: float
    target_kl: float
    horizon: int

    def __post_init__(self):
        if not self.target_kl > 0:
            raise ValueError(
                f"adaptive KL controller: target_kl must be > 0, got {self.target_kl!r}"
            )
        if not self.horizon > 0:
            raise ValueError(f"adaptive KL controller: horizon must be > 0, got {self.horizon!r}")

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):
            raise ValueError(f"adaptive KL controller: observed KL is not finite ({current_kl!r})")
        self.value = adaptive_kl_update(
            self.value, current_kl, self.target_kl, self.horizon, n_steps
        )

    def state_dict(self) -> dict:
        return {"type": "adaptive", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def build_kl_controller(
    kind: str, coef: float, target_kl: float | None = None, horizon: int | None = None
):
    """``"fixed"`` or ``"adaptive"`` (which needs target_kl and horizon)."""
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("the adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller '{kind}'; valid: fixed, adaptive")
