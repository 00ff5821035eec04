import functools

import numpy as np
import pytest
import torch

from groupflow.rewards import (
    MissingRewardFieldError,
    RewardConfigError,
    RewardFunction,
    RewardOutputError,
)
from groupflow.rewards.scoring import validate_output

FIELDS = {
    "prompts": ["p"],
    "completions": ["c"],
    "ground_truth": ["g"],
    "data_source": ["d"],
}


def test_passes_only_declared_fields():
    def reward(completions, ground_truth):
        return [len(completions[0]) + len(ground_truth[0])]

    spec = RewardFunction("r", reward)
    assert spec.select(FIELDS) == {"completions": ["c"], "ground_truth": ["g"]}
    assert spec.start(FIELDS) == [2]


def test_var_keyword_gets_everything():
    spec = RewardFunction("r", lambda completions, **kw: [sorted(kw)])
    assert spec.start(FIELDS) == [["data_source", "ground_truth", "prompts"]]


def test_options_are_fixed_and_never_filled_from_fields():
    def reward(completions, scale, **kw):
        return [scale]

    spec = RewardFunction("r", reward, options={"scale": 3.0})
    assert spec.start({**FIELDS, "scale": ["from-data"]}) == [3.0]
    with pytest.raises(RewardConfigError, match="does not accept option\\(s\\) \\['scal'\\]"):
        RewardFunction("r", lambda completions: [1.0], options={"scal": 2})


def test_callable_object_and_partial():
    class Scorer:
        def __call__(self, completions, bonus):
            return [bonus[0]]

    assert RewardFunction("obj", Scorer()).start({**FIELDS, "bonus": [5]}) == [5]

    def base(completions, ground_truth, offset):
        return [offset]

    spec = RewardFunction("partial", functools.partial(base, offset=2))
    assert spec.start(FIELDS) == [2]


def test_missing_field_error_names_function_field_and_available():
    def needs_answer(completions, answer):
        return [1.0]

    spec = RewardFunction("acc", needs_answer)
    with pytest.raises(MissingRewardFieldError) as info:
        spec.check_fields(FIELDS)
    message = str(info.value)
    assert "'acc'" in message and "needs_answer" in message
    assert "requires field 'answer'" in message
    assert "['completions', 'data_source', 'ground_truth', 'prompts']" in message
    spec_with_default = RewardFunction("ok", lambda completions, answer=None: [1.0])
    spec_with_default.check_fields(FIELDS)  # optional parameters are not required


def test_bad_wrap_arguments():
    with pytest.raises(RewardConfigError, match="positional-only parameter 'completions'"):
        RewardFunction("r", lambda completions, /: [1.0])
    with pytest.raises(RewardConfigError, match="fn must be callable"):
        RewardFunction("r", 3)
    with pytest.raises(RewardConfigError, match="weight must be a finite number"):
        RewardFunction("r", lambda completions: [1.0], weight=float("nan"))
    with pytest.raises(RewardConfigError, match="non-empty string"):
        RewardFunction("", lambda completions: [1.0])


def test_validate_output_accepts_sequences_tensors_arrays():
    def fn():
        return None

    assert validate_output("r", fn, [1, None, True], 3) == [1.0, None, 1.0]
    assert validate_output("r", fn, (0.5,), 1) == [0.5]
    assert validate_output("r", fn, torch.tensor([1.0, 2.0]), 2) == [1.0, 2.0]
    assert validate_output("r", fn, np.array([1, 2]), 2) == [1.0, 2.0]
    assert validate_output("r", fn, [np.float32(0.25)], 1) == [0.25]


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ([1.0], "returned 1 values for 2 completions"),
        (1.0, "returned float 1.0; expected a list of 2"),
        (["1", 2.0], "non-numeric value at position 0: '1'"),
        ([1.0, [2.0]], "non-numeric value at position 1"),
        (torch.ones(2, 1), "of shape \\(2, 1\\)"),
    ],
)
def test_validate_output_rejects(output, message):
    def my_reward():
        return None

    with pytest.raises(RewardOutputError, match=message) as info:
        validate_output("acc", my_reward, output, 2)
    assert "'acc'" in str(info.value) and "my_reward" in str(info.value)
