"""The weight ring: versions by slot, views of one flat buffer, errors for a version it lost."""

from __future__ import annotations

import pytest
import torch

from groupflow.rollout.weight_ring import WeightRing


def _weights(scale: float) -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale,
        "b": torch.tensor(scale, dtype=torch.bfloat16),  # 0-dim, 2 bytes
        "steps": torch.tensor([1, 2, 3], dtype=torch.long) * int(scale),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }


def test_versions_round_trip_through_their_slots():
    ring = WeightRing(_weights(1.0), slots=3, shared=False)
    for v in range(4):  # version 3 reuses version 0's slot
        ring.write(v, _weights(float(v + 1)))
    assert ring.versions() == [1, 2, 3]
    for v in (1, 2, 3):
        got, want = ring.read(v), _weights(float(v + 1))
        assert list(got) == list(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
            assert torch.equal(got[k], want[k]), (v, k)


def test_a_write_is_a_copy_and_a_read_a_view():
    source = _weights(1.0)
    ring = WeightRing(source, slots=2, shared=False)
    ring.write(0, source)
    source["w"].add_(100.0)  # the trainer's next update does not reach the published version
    assert float(ring.read(0)["w"][1, 2]) == 5.0
    ring.read(0)["w"].zero_()  # views: what a reader changes is in the slot
    assert float(ring.read(0)["w"].abs().sum()) == 0.0


def test_a_version_that_was_overwritten_or_never_written_is_an_error():
    ring = WeightRing(_weights(1.0), slots=2, shared=False)
    with pytest.raises(RuntimeError, match="no longer holds policy version 0 .*holds nothing"):
        ring.read(0)
    for v in range(3):
        ring.write(v, _weights(1.0))
    with pytest.raises(RuntimeError, match=r"policy version 0 \(its slot holds version 2\)"):
        ring.read(0)


def test_weights_of_another_layout_are_refused():
    ring = WeightRing(_weights(1.0), slots=2, shared=False)
    bad = _weights(1.0)
    del bad["b"]
    bad["extra"] = torch.ones(1)
    with pytest.raises(KeyError, match=r"missing \['b'\], extra \['extra'\]"):
        ring.write(0, bad)
    with pytest.raises(ValueError, match="at least one slot"):
        WeightRing(_weights(1.0), slots=0, shared=False)


def test_a_shared_ring_is_in_shared_memory():
    ring = WeightRing(_weights(1.0), slots=2, shared=True)
    assert all(b.is_shared() for b in ring.buffers) and ring.held.is_shared()
