"""Prompt loader: an endless, deterministic stream of prompts cut into per-step batches.

Design decision: the loader is a stream, not an epoch iterator. Epoch `e` is a permutation of the
rows drawn from a private `numpy.random.Generator` seeded with `(seed, e)` — never the global RNG,
and a tuple rather than `seed + e` so that (seed=1, epoch=0) and (seed=0, epoch=1) do not share a
permutation. The whole state is therefore `(epoch, position)`: `state_dict()` is two integers plus
the settings they are only meaningful under, and a resumed loader yields exactly the same batches.

`next_batch()` always returns `prompts_per_step` rows and crosses epoch boundaries seamlessly;
`take(n)` draws n more rows from the same stream (dynamic-sampling refills). With
`drop_last=True` the last `len(rows) % prompts_per_step` rows of each epoch's permutation are
left out, so every epoch is a whole number of steps and no batch mixes two epochs (as long as
only `next_batch` is used); with `drop_last=False` every row is seen once per epoch and a batch
may straddle two epochs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import numpy as np

T = TypeVar("T")

# Settings a state dict is only valid under: resuming with a different value would silently
# produce a different stream, so they are stored and checked.
_SETTINGS = ("seed", "num_rows", "prompts_per_step", "shuffle", "drop_last")


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class PromptLoader(Generic[T]):
    """Deterministic stream of prompt rows; see the module docstring for the semantics."""

    def __init__(
        self,
        rows: Sequence[T],
        prompts_per_step: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        self.rows = rows
        self.prompts_per_step = _check_int("prompts_per_step", prompts_per_step, 1)
        self.seed = _check_int("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        if len(rows) == 0:
            raise ValueError("PromptLoader needs at least one row, got an empty dataset")
        if drop_last and len(rows) < self.prompts_per_step:
            raise ValueError(
                f"dataset has {len(rows)} prompts, fewer than prompts_per_step="
                f"{self.prompts_per_step}, so drop_last=True would drop every prompt; lower "
                "prompts_per_step, add prompts, or set drop_last=False (in a run config: "
                "data.prompts_per_step, data.drop_last=false)"
            )
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)

    # ---- stream geometry ------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the next drawn row comes from (0-based)."""
        return self._epoch

    @property
    def position(self) -> int:
        """How many rows of the current epoch have been drawn."""
        return self._position

    @property
    def rows_per_epoch(self) -> int:
        n = len(self.rows)
        return n - n % self.prompts_per_step if self.drop_last else n

    @property
    def steps_per_epoch(self) -> float:
        """`next_batch` calls per epoch (a whole number when drop_last=True)."""
        return self.rows_per_epoch / self.prompts_per_step

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.rows)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng((self.seed, epoch)).permutation(n)

    # ---- drawing --------------------------------------------------------------------------

    def take(self, n: int) -> list[T]:
        """Draw the next `n` rows of the stream (crossing epochs as needed)."""
        n = _check_int("n", n, 0)
        out: list[T] = []
        while len(out) < n:
            if self._position >= self.rows_per_epoch:
                self._epoch += 1
                self._position = 0
                self._order = self._epoch_order(self._epoch)
            stop = min(self.rows_per_epoch, self._position + n - len(out))
            out.extend(self.rows[int(i)] for i in self._order[self._position : stop])
            self._position = stop
        return out

    def next_batch(self) -> list[T]:
        """The next `prompts_per_step` rows."""
        return self.take(self.prompts_per_step)

    # ---- checkpointing --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = {key: getattr(self, key) for key in _SETTINGS if key != "num_rows"}
        state["num_rows"] = len(self.rows)
        state["epoch"] = self._epoch
        state["position"] = self._position
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [k for k in (*_SETTINGS, "epoch", "position") if k not in state]
        if missing:
            raise KeyError(f"loader state dict is missing keys {missing}; got {sorted(state)}")
        current = self.state_dict()
        for key in _SETTINGS:
            if state[key] != current[key]:
                raise ValueError(
                    f"loader state was saved with {key}={state[key]!r} but this loader has "
                    f"{key}={current[key]!r}; resuming would yield a different prompt stream"
                )
        epoch = _check_int("epoch", state["epoch"], 0)
        position = _check_int("position", state["position"], 0)
        if position > self.rows_per_epoch:
            raise ValueError(
                f"loader state position={position} exceeds rows_per_epoch={self.rows_per_epoch}"
            )
        self._epoch, self._position = epoch, position
        self._order = self._epoch_order(epoch)
