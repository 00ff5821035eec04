import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from groupflow.batch import Batch, BatchError


def make(n=5, t=3):
    return Batch(
        {
            "x": torch.arange(n * t, dtype=torch.float32).reshape(n, t),
            "ids": torch.arange(n),
        },
        {"text": [f"s{i}" for i in range(n)], "gt": [{"a": i} for i in range(n)]},
        {"step": 1},
    )


def test_len_keys_getitem():
    b = make()
    assert len(b) == 5
    assert b.keys() == ["x", "ids", "text", "gt"]
    assert b["text"][2] == "s2"
    assert b["gt"][3] == {"a": 3}
    with pytest.raises(KeyError, match="no key 'nope'"):
        b["nope"]


def test_non_tensor_lists_stay_one_value_per_sample():
    b = Batch(non_tensors={"msgs": [[{"role": "user"}], [{"role": "user"}, {"role": "x"}]]})
    assert len(b) == 2 and b["msgs"].shape == (2,)
    assert b["msgs"][1] == [{"role": "user"}, {"role": "x"}]


def test_mismatched_lengths_rejected():
    with pytest.raises(BatchError, match="same leading size.*x=2.*y=3"):
        Batch({"x": torch.zeros(2), "y": torch.zeros(3)})
    with pytest.raises(BatchError, match="0-dimensional"):
        Batch({"x": torch.tensor(1.0)})
    with pytest.raises(BatchError, match="must be a torch.Tensor"):
        Batch({"x": [1, 2]})
    b = make()
    with pytest.raises(BatchError, match="leading size"):
        b["y"] = torch.zeros(4)
    with pytest.raises(BatchError, match="has 2 values"):
        b["z"] = ["a", "b"]


def test_select_pop_union():
    b = make()
    s = b.select("x", "text")
    assert s.keys() == ["x", "text"] and s.meta == {"step": 1}
    popped = b.pop("gt")
    assert "gt" not in b and popped.keys() == ["gt"]
    merged = b.union(popped)
    assert set(merged.keys()) == {"x", "ids", "text", "gt"}
    # identical values under the same key are fine
    assert b.union(b.select("x")).keys() == b.keys()
    with pytest.raises(KeyError, match="no key"):
        b.select("missing")


def test_union_conflicts_named():
    b = make()
    other = Batch({"x": torch.zeros(5, 3)})
    with pytest.raises(BatchError, match="conflicting values for tensor 'x'"):
        b.union(other)
    with pytest.raises(BatchError, match="conflicting values for non-tensor 'text'"):
        b.union(Batch(non_tensors={"text": ["q"] * 5}))
    with pytest.raises(BatchError, match="batch sizes differ"):
        b.union(Batch({"y": torch.zeros(4)}))
    with pytest.raises(BatchError, match="conflicting meta"):
        b.union(Batch({"y": torch.zeros(5)}, meta={"step": 2}))


def test_repeat_interleaved_and_blocked():
    b = Batch({"v": torch.tensor([1, 2])}, {"s": ["a", "b"]})
    assert b.repeat(3)["v"].tolist() == [1, 1, 1, 2, 2, 2]
    assert list(b.repeat(3)["s"]) == ["a", "a", "a", "b", "b", "b"]
    assert b.repeat(2, interleave=False)["v"].tolist() == [1, 2, 1, 2]
    with pytest.raises(BatchError):
        b.repeat(0)


def test_split_uneven_and_chunk():
    b = make(7)
    parts = b.split([3, 0, 4])
    assert [len(p) for p in parts] == [3, 0, 4]
    assert [len(p) for p in b.split(3)] == [3, 3, 1]
    assert [len(p) for p in b.chunk(3)] == [3, 2, 2]
    assert list(parts[2]["text"]) == ["s3", "s4", "s5", "s6"]
    with pytest.raises(BatchError, match="add up to the batch size 7"):
        b.split([3, 3])


def test_chunk_padded_and_unpad():
    b = make(5)
    parts, pad = b.chunk_padded(4)
    assert pad == 3 and [len(p) for p in parts] == [2, 2, 2, 2]
    back = Batch.concat(parts)
    back = back.index(slice(0, len(back) - pad))
    assert torch.equal(back["x"], b["x"]) and list(back["text"]) == list(b["text"])
    parts, pad = b.chunk_padded(5)
    assert pad == 0 and all(len(p) == 1 for p in parts)


def test_concat_requires_same_keys():
    a, b = make(2), make(3)
    c = Batch.concat([a, b])
    assert len(c) == 5 and c["ids"].tolist() == [0, 1, 0, 1, 2]
    with pytest.raises(BatchError, match="part 1 has different keys.*'gt'"):
        Batch.concat([a, b.select("x", "ids", "text")])
    with pytest.raises(BatchError, match="at least one"):
        Batch.concat([])


def test_reorder_index_by_ids():
    b = make(4)
    b["uid"] = ["u0", "u1", "u2", "u3"]
    r = b.reorder([2, 0, 3, 1])
    assert r["ids"].tolist() == [2, 0, 3, 1]
    back = r.index_by_ids(["u0", "u1", "u2", "u3"])
    assert torch.equal(back["x"], b["x"])
    with pytest.raises(KeyError, match="u9"):
        b.index_by_ids(["u9"])
    with pytest.raises(BatchError, match="out of range"):
        b.index([7])
    mask = torch.tensor([True, False, True, False])
    assert b.index(mask)["ids"].tolist() == [0, 2]


def test_pickle_roundtrip_with_bfloat16_and_grad_flag():
    b = make()
    b["h"] = torch.randn(5, 2).to(torch.bfloat16)
    b["w"] = torch.randn(5, requires_grad=True)
    out = pickle.loads(pickle.dumps(b, protocol=5))
    assert out["h"].dtype == torch.bfloat16 and torch.equal(out["h"], b["h"])
    assert out["w"].requires_grad
    assert out["gt"][4] == {"a": 4} and out.meta == {"step": 1}


def test_pickle_uses_out_of_band_buffers():
    b = Batch({"x": torch.zeros(1000, 100)})
    buffers = []
    data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and len(data) < 2000  # the 400 KB tensor travels out of band
    out = pickle.loads(data, buffers=buffers)
    assert torch.equal(out["x"], b["x"])


def test_to_and_rows():
    b = make(2).to("cpu")
    rows = b.rows(["ids", "text"])
    assert rows == [{"ids": 0, "text": "s0"}, {"ids": 1, "text": "s1"}]


# ---- properties -------------------------------------------------------------------------------

sizes = st.integers(min_value=1, max_value=20)


@settings(max_examples=40, deadline=None)
@given(n=sizes, data=st.data())
def test_split_concat_roundtrip(n, data):
    b = make(n)
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=4)))
    sizes_ = [hi - lo for lo, hi in zip([0, *cuts], [*cuts, n])]
    back = Batch.concat(b.split(sizes_))
    assert torch.equal(back["x"], b["x"]) and list(back["gt"]) == list(b["gt"])


@settings(max_examples=40, deadline=None)
@given(n=sizes, parts=st.integers(1, 8))
def test_chunk_padded_roundtrip(n, parts):
    b = make(n)
    chunks, pad = b.chunk_padded(parts)
    assert len({len(c) for c in chunks}) == 1
    back = Batch.concat(chunks)
    back = back.index(slice(0, len(back) - pad))
    assert torch.equal(back["x"], b["x"])


@settings(max_examples=40, deadline=None)
@given(perm=st.permutations(list(range(9))))
def test_reorder_inverse(perm):
    b = make(9)
    inverse = np.argsort(perm).tolist()
    back = b.reorder(perm).reorder(inverse)
    assert torch.equal(back["x"], b["x"]) and list(back["text"]) == list(b["text"])


@settings(max_examples=20, deadline=None)
@given(n=sizes, k=st.integers(1, 4))
def test_repeat_blocked_vs_interleaved_are_permutations(n, k):
    b = make(n)
    inter, block = b.repeat(k), b.repeat(k, interleave=False)
    # sample i copy j sits at i*k+j (interleaved) and at j*n+i (blocked)
    perm = [j * n + i for i in range(n) for j in range(k)]
    assert torch.equal(block.reorder(perm)["x"], inter["x"])


@settings(max_examples=20, deadline=None)
@given(n=sizes)
def test_pickle_roundtrip_property(n):
    b = make(n)
    out = pickle.loads(pickle.dumps(b))
    assert torch.equal(out["x"], b["x"]) and list(out["gt"]) == list(b["gt"])
