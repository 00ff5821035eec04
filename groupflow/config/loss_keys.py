"""The actor keys that are options of some policy losses only.

Design decision: one tuple, in a module of its own, shared by the config check (an option the
chosen loss does not take is an error), the presets (left out for such a loss) and the workers
(passed only to a loss that declares it), so that none of them imports another for it.
"""

from __future__ import annotations

__all__ = ["LOSS_TYPED_OPTIONS"]

# ActorConfig's typed options of the PPO-style losses; other options go under actor.loss_options
LOSS_TYPED_OPTIONS = ("ratio_level", "clip_eps_low", "clip_eps_high", "clip_ratio_c", "delta")
