import pytest

from groupflow.rewards import RewardConfigError
from groupflow.rewards.length import make_length_penalty, make_overlong_penalty


def test_overlong_penalty_boundaries():
    # L_max = 100, L_buf = 20: free up to 80, linear to -1 at 100, -1 beyond.
    reward = make_overlong_penalty(max_tokens=100, buffer_tokens=20)
    lengths = [0, 79, 80, 81, 85, 90, 99, 100, 101, 500]
    expected = [0.0, 0.0, 0.0, -0.05, -0.25, -0.5, -0.95, -1.0, -1.0, -1.0]
    assert reward(completion_lengths=lengths) == pytest.approx(expected)


def test_overlong_penalty_factor_and_full_buffer():
    reward = make_overlong_penalty(max_tokens=100, buffer_tokens=20, penalty_factor=2.0)
    assert reward(completion_lengths=[90, 120]) == pytest.approx([-1.0, -2.0])
    whole = make_overlong_penalty(max_tokens=10, buffer_tokens=10)
    assert whole(completion_lengths=[0, 5, 10]) == pytest.approx([0.0, -0.5, -1.0])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_tokens": 0, "buffer_tokens": 1}, "max_tokens must be a positive integer"),
        ({"max_tokens": 10, "buffer_tokens": 0}, "buffer_tokens must be a positive integer"),
        ({"max_tokens": 10, "buffer_tokens": 11}, "buffer_tokens \\(11\\) must be <= max_tokens"),
        ({"max_tokens": 10.5, "buffer_tokens": 1}, "max_tokens must be a positive integer"),
        ({"max_tokens": 10, "buffer_tokens": 2, "penalty_factor": -1}, "penalty_factor"),
    ],
)
def test_overlong_penalty_bad_options(options, message):
    with pytest.raises(RewardConfigError, match=message):
        make_overlong_penalty(**options)


def test_bad_lengths_raise_per_sample():
    reward = make_overlong_penalty(max_tokens=10, buffer_tokens=2)
    with pytest.raises(ValueError, match=">= 0"):
        reward(completion_lengths=[-1])
    with pytest.raises(TypeError, match="must be a number"):
        reward(completion_lengths=["10"])


def test_length_penalty():
    reward = make_length_penalty(penalty_per_token=0.01, free_tokens=10)
    assert reward(completion_lengths=[5, 10, 30]) == pytest.approx([0.0, 0.0, -0.2])
    capped = make_length_penalty(penalty_per_token=0.01, free_tokens=10, max_penalty=0.1)
    assert capped(completion_lengths=[30, 15]) == pytest.approx([-0.1, -0.05])
    with pytest.raises(RewardConfigError, match="free_tokens must be an integer"):
        make_length_penalty(free_tokens=1.5)
    with pytest.raises(RewardConfigError, match="penalty_per_token"):
        make_length_penalty(penalty_per_token=True)
