import pytest
import torch

from groupflow.diffusion.schedule import shift_sigmas, sigma_schedule


def test_schedule_runs_from_one_to_zero_and_is_shifted():
    s = sigma_schedule(4, shift=3.0)
    assert s.shape == (5,)
    assert s[0] == 1.0 and s[-1] == 0.0
    # σ = 0.5 -> 3·0.5 / (1 + 2·0.5) = 0.75 (hand-computed)
    assert s[2].item() == pytest.approx(0.75)
    assert bool((s[1:] < s[:-1]).all())


def test_shift_one_is_the_uniform_grid():
    assert torch.allclose(sigma_schedule(4, shift=1.0), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))


def test_bad_schedule_arguments():
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        sigma_schedule(0)
    with pytest.raises(ValueError, match="shift must be > 0"):
        shift_sigmas(torch.tensor([0.5]), 0.0)
