import pytest
import torch

from groupflow.batch import Batch
from groupflow.distributed import PAD_KEY, collect, register, split_args


def batch(n):
    return Batch({"x": torch.arange(n)}, {"s": [f"s{i}" for i in range(n)]})


def test_dp_split_pads_and_marks_padding():
    parts, pad = split_args("dp", 3, (batch(7), "arg"), {"k": 1})
    assert pad == 2
    assert [len(a[0]) for a, _ in parts] == [3, 3, 3]
    assert all(a[1] == "arg" and kw == {"k": 1} for a, kw in parts)
    flags = torch.cat([a[0][PAD_KEY] for a, _ in parts]).tolist()
    assert flags == [False] * 7 + [True] * 2
    xs = torch.cat([a[0]["x"] for a, _ in parts]).tolist()
    assert xs == [0, 1, 2, 3, 4, 5, 6, 0, 1]  # padding repeats leading samples


def test_dp_collect_unpads_one_and_k_outputs_per_input():
    parts, pad = split_args("dp", 3, (batch(7),), {})
    same = collect("dp", [a[0] for a, _ in parts], inputs=7, pad=pad)
    assert same["x"].tolist() == list(range(7)) and PAD_KEY not in same
    expanded = collect("dp", [a[0].repeat(4) for a, _ in parts], inputs=7, pad=pad)
    assert len(expanded) == 28 and expanded["x"].tolist() == [i for i in range(7) for _ in range(4)]


def test_dp_collect_rejects_ragged_outputs():
    parts, pad = split_args("dp", 2, (batch(4),), {})
    bad = [parts[0][0][0], parts[1][0][0].index([0])]
    with pytest.raises(ValueError, match="whole number of outputs per input"):
        collect("dp", bad, inputs=4, pad=pad)


def test_other_modes():
    per_rank, pad = split_args("all", 3, (1,), {"a": 2})
    assert per_rank == [((1,), {"a": 2})] * 3 and pad == 0
    assert collect("all", [1, 2, 3]) == [1, 2, 3]
    assert collect("rank0", [1, 2, 3]) == 1
    assert collect("dp", [5, 6], inputs=1) == 5  # non-Batch results: rank 0's


def test_bad_usage():
    with pytest.raises(
        ValueError, match="unknown dispatch mode 'scatter'; valid: all, rank0, dp, one"
    ):
        register("scatter")
    with pytest.raises(TypeError, match="needs a Batch as its first positional argument"):
        split_args("dp", 2, ([1, 2],), {})
    with pytest.raises(ValueError, match="empty Batch"):
        split_args("dp", 2, (Batch({"x": torch.zeros(0)}),), {})
