"""Tests for groupflow.data.loader.PromptLoader: determinism, epochs, resume, refills."""

import random

import numpy as np
import pytest
import torch

from groupflow.data.loader import PromptLoader

ROWS = list(range(10))


def draw(loader, n_batches):
    return [loader.next_batch() for _ in range(n_batches)]


def test_same_seed_same_stream_regardless_of_global_rng():
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    a = draw(PromptLoader(ROWS, 4, seed=7), 6)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    b = draw(PromptLoader(ROWS, 4, seed=7), 6)
    assert a == b
    assert a != draw(PromptLoader(ROWS, 4, seed=8), 6)


def test_drop_last_epochs_are_whole_batches_of_distinct_rows():
    loader = PromptLoader(ROWS, 4, seed=0)
    assert loader.rows_per_epoch == 8 and loader.steps_per_epoch == 2
    batches = draw(loader, 6)  # 3 epochs
    for e in range(3):
        epoch_rows = batches[2 * e] + batches[2 * e + 1]
        assert len(set(epoch_rows)) == 8  # no repeats within an epoch
    # Each epoch is the first 8 entries of its own permutation, seeded by (seed, epoch).
    expected = list(np.random.default_rng((0, 1)).permutation(10)[:8])
    assert batches[2] + batches[3] == expected
    assert batches[0] + batches[1] != batches[2] + batches[3]
    assert loader.epoch == 2 and loader.position == 8


def test_no_shuffle_no_drop_last_crosses_epochs():
    loader = PromptLoader(ROWS, 4, seed=0, shuffle=False, drop_last=False)
    assert draw(loader, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    assert (loader.epoch, loader.position) == (1, 2)
    assert PromptLoader(ROWS, 4, seed=0, shuffle=False).take(10) == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]


def test_fewer_rows_than_batch():
    with pytest.raises(
        ValueError, match="3 prompts, fewer than prompts_per_step=4.*drop_last=False"
    ):
        PromptLoader([1, 2, 3], 4, seed=0)
    loader = PromptLoader([1, 2, 3], 4, seed=0, shuffle=False, drop_last=False)
    assert draw(loader, 2) == [[1, 2, 3, 1], [2, 3, 1, 2]]


def test_take_continues_the_same_stream():
    reference = PromptLoader(ROWS, 4, seed=3).take(20)
    loader = PromptLoader(ROWS, 4, seed=3)
    got = (
        loader.next_batch() + loader.take(3) + loader.take(0) + loader.next_batch() + loader.take(9)
    )
    assert got == reference


@pytest.mark.parametrize("drop_last", [True, False])
def test_resume_yields_identical_batches(drop_last):
    original = PromptLoader(ROWS, 4, seed=5, drop_last=drop_last)
    draw(original, 3)
    original.take(2)
    state = original.state_dict()
    assert state["epoch"] == 1 and state["num_rows"] == 10
    expected = draw(original, 7)

    resumed = PromptLoader(ROWS, 4, seed=5, drop_last=drop_last)
    resumed.load_state_dict(dict(state))
    assert draw(resumed, 7) == expected


def test_load_state_dict_rejects_mismatch():
    state = PromptLoader(ROWS, 4, seed=5).state_dict()
    with pytest.raises(ValueError, match="saved with seed=5 but this loader has seed=6"):
        PromptLoader(ROWS, 4, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="num_rows=10 but this loader has num_rows=11"):
        PromptLoader(list(range(11)), 4, seed=5).load_state_dict(state)
    with pytest.raises(KeyError, match="missing keys \\['epoch'\\]"):
        PromptLoader(ROWS, 4, seed=5).load_state_dict(
            {k: v for k, v in state.items() if k != "epoch"}
        )
    with pytest.raises(ValueError, match="position=9 exceeds rows_per_epoch=8"):
        PromptLoader(ROWS, 4, seed=5).load_state_dict(dict(state, position=9))


def test_bad_arguments():
    with pytest.raises(ValueError, match="prompts_per_step must be >= 1"):
        PromptLoader(ROWS, 0, seed=0)
    with pytest.raises(TypeError, match="seed must be an int"):
        PromptLoader(ROWS, 2, seed=1.5)
    with pytest.raises(ValueError, match="at least one row"):
        PromptLoader([], 1, seed=0, drop_last=False)
    with pytest.raises(ValueError, match="n must be >= 0"):
        PromptLoader(ROWS, 2, seed=0).take(-1)
