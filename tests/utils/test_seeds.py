"""The step's seeding rule, shared by every workflow: hand-computed values."""

from groupflow.utils.seeds import ROUND_STRIDE, sample_seed, step_seeds


def test_sample_seed_by_hand():
    assert sample_seed(0, 0, 0) == 0
    assert sample_seed(2, 3, 5) == 2 * 1_000_003 + 3 * 100_003 + 5


def test_step_seeds_group_per_prompt_and_rounds_never_meet():
    seeds, groups = step_seeds(7, 4, 0, prompts=2, n=3)
    flat = [sample_seed(7, 4, i) for i in range(6)]
    assert seeds == [flat[0:3], flat[3:6]] and groups == [0, 1]
    refill, refill_groups = step_seeds(7, 4, 1, prompts=2, n=3)
    assert refill[0][0] == sample_seed(7, 4, ROUND_STRIDE)
    assert refill_groups == [ROUND_STRIDE, ROUND_STRIDE + 1]
    assert not set(sum(seeds, [])) & set(sum(refill, []))
