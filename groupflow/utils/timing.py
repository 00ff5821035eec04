"""Per-stage wall-clock timers and throughput, as context managers kept out of the loop body.

Design decision: the driver writes ``with timer("rollout"): ...`` around each stage and logs
``timer.metrics()`` once per step, instead of scattering ``time.perf_counter()`` pairs through the
loop (style principle 13). A stage entered several times in one step accumulates. Asynchronous
devices (CUDA) would charge queued kernels to whichever stage synchronises next, so the timer takes
an optional ``sync`` callable (e.g. ``torch.cuda.synchronize``) that runs at both edges of a stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["StageTimer", "throughput"]


def throughput(count: float, seconds: float) -> float:
    """Items per second (tokens, samples, images); ``seconds`` must be positive."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0 to compute a throughput, got {seconds}")
    return count / seconds


class StageTimer:
    """Accumulates wall time per named stage; ``metrics()`` gives ``{"time/<stage>": seconds}``."""

    def __init__(
        self,
        prefix: str = "time/",
        clock: Callable[[], float] = time.perf_counter,
        sync: Callable[[], None] | None = None,
    ) -> None:
        self.prefix = prefix
        self._clock = clock
        self._sync = sync
        self._totals: dict[str, float] = {}
        self._active: set[str] = set()

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        if not isinstance(stage, str) or not stage:
            raise ValueError(f"stage name must be a non-empty string, got {stage!r}")
        if stage in self._active:
            # Nesting a stage inside itself would count its time twice.
            raise ValueError(f"stage {stage!r} is already being timed (nested re-entry)")
        self._active.add(stage)
        if self._sync is not None:
            self._sync()
        start = self._clock()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            self._totals[stage] = self._totals.get(stage, 0.0) + (self._clock() - start)
            self._active.discard(stage)

    def seconds(self, stage: str) -> float:
        """Accumulated seconds of ``stage`` since the last reset."""
        if stage not in self._totals:
            raise KeyError(
                f"stage {stage!r} has not been timed; timed stages: {sorted(self._totals)}"
            )
        return self._totals[stage]

    def metrics(self) -> dict[str, float]:
        """``{"time/<stage>": seconds}`` for every stage timed since the last reset."""
        return {f"{self.prefix}{stage}": total for stage, total in self._totals.items()}

    def throughput(self, stage: str, count: float, unit: str) -> dict[str, float]:
        """``{"perf/<stage>_<unit>_per_s": count / seconds(stage)}``, e.g. rollout tokens per second."""
        return {f"perf/{stage}_{unit}_per_s": throughput(count, self.seconds(stage))}

    def reset(self) -> None:
        """Forget accumulated times (call once per step after logging)."""
        if self._active:
            raise RuntimeError(f"cannot reset while stages are running: {sorted(self._active)}")
        self._totals.clear()
