"""Seeds derived from (run seed, step, slot): what makes a run replayable sample by sample.

Design decision: every random draw of a step — a sample's generator, a mini-batch shuffle, the
control run's advantage permutation — is seeded from the run seed, the step and a slot number,
never from a stream that advances with the work done. A resumed run, a run with another number
of workers, or a rollout regenerated on resume therefore draws exactly the same numbers.
"""

from __future__ import annotations

__all__ = ["sample_seed"]


def sample_seed(run_seed: int, step: int, index: int) -> int:
    """Seed of one rollout sample (or, with a negative ``index``, of a per-step draw)."""
    return (run_seed * 1_000_003 + step * 100_003 + index) % (2**63 - 1)
