"""Seeds derived from (run seed, step, slot): what makes a run replayable sample by sample.

Design decision: every random draw of a step — a sample's generator, a mini-batch shuffle, the
control run's advantage permutation — is seeded from the run seed, the step and a slot number,
never from a stream that advances with the work done. A resumed run, a run with another number
of workers, or a rollout regenerated on resume therefore draws exactly the same numbers.
"""

from __future__ import annotations

__all__ = ["ROUND_STRIDE", "sample_seed", "step_seeds"]

# Refill rounds of one step (dynamic sampling) number their slots from round × this, so their
# seeds and group ids never meet the first round's.
ROUND_STRIDE = 1_000_000


def sample_seed(run_seed: int, step: int, index: int) -> int:
    """Seed of one rollout sample (or, with a negative ``index``, of a per-step draw)."""
    return (run_seed * 1_000_003 + step * 100_003 + index) % (2**63 - 1)


def step_seeds(run_seed: int, step: int, round_: int, prompts: int,
               n: int) -> tuple[list[list[int]], list[int]]:  # fmt: skip
    """The ``n`` sample seeds of each of ``prompts`` prompts in one collect round, and the
    prompts' group ids: what every workflow draws a step's samples with."""
    base = round_ * ROUND_STRIDE
    seeds = [sample_seed(run_seed, step, base + i) for i in range(prompts * n)]
    return [seeds[i * n : (i + 1) * n] for i in range(prompts)], [base + i for i in range(prompts)]
