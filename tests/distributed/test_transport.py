"""Weight transports (``groupflow.distributed.transport``): buckets by hand, bit-exact round
trips, corrupted or missing versions named by role, rank and version, and the bytes a ticket
carries through the driver."""

from __future__ import annotations

import pytest
import torch

from groupflow.distributed.transport import (
    DriverTransport,
    FileTransport,
    Layout,
    RingTransport,
    TransferError,
    pack_buckets,
    ticket_nbytes,
    ticket_version,
    unpack_buckets,
)
from groupflow.rollout.weight_ring import WeightRing


def _weights():
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(5, generator=g),  # 20 bytes
        "b": torch.randn(2, 3, generator=g).to(torch.bfloat16),  # 12 bytes
        "c": torch.arange(3, dtype=torch.int64),  # 24 bytes
    }


def _same(x, y):
    assert list(x) == list(y)
    for k in x:
        assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape
        assert torch.equal(x[k], y[k]), k


def test_bytes_between_nodes_counts_each_receiver_on_another_node_than_its_senders():
    from groupflow.distributed.transport import bytes_between_nodes

    # rank 0 on node a sends the whole version: the receivers on b and c each get 100 bytes
    assert bytes_between_nodes(100, ["a", "a"], ["a", "b", "c"], every_rank_sends=False) == 200
    assert bytes_between_nodes(100, ["a"], ["a", "a"], every_rank_sends=False) == 0
    # the collective: each of 4 ranks (2 on a, 2 on b) sends a quarter; a receiver on a gets the
    # two quarters of b's ranks across nodes, one on c all four
    assert bytes_between_nodes(100, ["a", "a", "b", "b"], ["a"], every_rank_sends=True) == 50
    assert bytes_between_nodes(100, ["a", "a", "b", "b"], ["a", "c"], every_rank_sends=True) == 150
    assert bytes_between_nodes(0, ["a"], ["b"], every_rank_sends=False) == 0


def test_buckets_cut_the_byte_stream_at_fixed_sizes():
    w = _weights()  # 20 + 12 + 24 = 56 bytes
    buckets = list(pack_buckets(w, 16))
    assert [i for i, _ in buckets] == [0, 1, 2, 3]
    assert [b.numel() for _, b in buckets] == [16, 16, 16, 8]  # tensors straddle buckets
    layout = Layout.of(w)
    assert layout.offsets == (0, 20, 32) and layout.total == 56
    _same(unpack_buckets(layout, [b for _, b in buckets]), w)
    _same(unpack_buckets(Layout.from_dict(layout.to_dict()), [b for _, b in buckets]), w)
    with pytest.raises(TransferError, match="48 bytes, the layout 56"):
        unpack_buckets(layout, [b for _, b in buckets[:3]])


def test_driver_ticket_carries_the_weights_and_counts_their_bytes():
    w = _weights()
    t = DriverTransport()
    ticket = t.send(3, w)
    assert ticket_nbytes(ticket) == 56 and ticket_version(ticket) == 3
    assert t.receive(ticket) is w


def test_ring_transport_ticket_is_the_version(tmp_path):
    w = _weights()
    t = RingTransport(WeightRing(w, slots=2, shared=False))
    ticket = t.send(4, w)
    assert ticket == 4 and ticket_nbytes(ticket) == 0
    _same(t.receive(ticket), w)
    t.send(6, w)  # overwrites version 4's slot
    with pytest.raises(RuntimeError, match="no longer holds policy version 4"):
        t.receive(4)


def test_filesystem_round_trip_is_bit_exact_and_the_ticket_holds_no_weights(tmp_path):
    w = _weights()
    t = FileTransport(str(tmp_path), bucket_bytes=16, timeout_s=1.0)
    ticket = t.send(7, w)
    assert ticket_nbytes(ticket) == 0 and ticket_version(ticket) == 7
    assert len(list((tmp_path / "v7").glob("bucket_*.safetensors"))) == 4
    _same(t.receive(ticket, role="rollout", rank=1), w)


def test_filesystem_corrupted_bucket_names_role_rank_and_version(tmp_path):
    from safetensors.torch import load_file, save_file

    t = FileTransport(str(tmp_path), bucket_bytes=16, timeout_s=1.0)
    ticket = t.send(2, _weights())
    path = tmp_path / "v2" / "bucket_1.safetensors"
    bucket = load_file(str(path))["bucket"]
    bucket[0] ^= 1
    save_file({"bucket": bucket}, str(path), metadata={"version": "2"})
    with pytest.raises(TransferError, match=r"reference role, rank 3, policy version 2: bucket 1"):
        t.receive(ticket, role="reference", rank=3)


def test_filesystem_missing_version_times_out_naming_it(tmp_path):
    t = FileTransport(str(tmp_path), timeout_s=0.2)
    with pytest.raises(TransferError, match=r"rollout role, rank 0: policy version 9 did not"):
        t.receive({"version": 9, "dir": str(tmp_path / "v9")}, role="rollout", rank=0)


def test_filesystem_keeps_only_recent_versions(tmp_path):
    t = FileTransport(str(tmp_path), bucket_bytes=64, keep=2)
    for v in range(4):
        t.send(v, _weights())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2", "v3"]


@pytest.mark.slow
def test_ray_objects_round_trip_without_the_weights_in_the_ticket(shared_ray):
    ray = shared_ray
    from groupflow.distributed.transport import RayObjectTransport

    @ray.remote(num_cpus=0)
    def send(version):
        return RayObjectTransport(bucket_bytes=16).send(version, _weights())

    ticket = ray.get(send.remote(5))  # the buckets were put by the remote task
    assert ticket_nbytes(ticket) == 0 and len(ticket["refs"]) == 4
    _same(RayObjectTransport().receive(ticket), _weights())
    ticket["crc32"][2] ^= 1
    with pytest.raises(TransferError, match=r"rollout role, rank 0, policy version 5: bucket 2"):
        RayObjectTransport().receive(ticket)


def test_a_rollout_pool_fed_through_the_filesystem_gives_the_driver_runs_numbers(tiny_config):
    from groupflow.run.tracking import read_metrics
    from groupflow.trainer import Trainer

    def run(name, transport):
        trainer = Trainer(tiny_config(run__name=name, run__total_steps=2,
                                      placement__rollout={"workers_per_node": 1},
                                      rollout__weight_transport=transport))  # fmt: skip
        trainer.fit()
        rows = [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if r["step"] > 0]
        return trainer, rows

    _, driver = run("driver", "driver")
    trainer, files = run("files", "filesystem")
    nbytes = sum(t.numel() * t.element_size() for t in trainer.policy.snapshot().values())
    assert [r["weights/bytes_via_driver"] for r in driver] == [nbytes, nbytes]
    assert [r["weights/bytes_via_driver"] for r in files] == [0.0, 0.0]
    # one host: nothing crosses nodes, whichever way the weights went
    assert [r["weights/bytes_between_nodes"] for r in driver + files] == [0.0] * 4
    for a, b in zip(driver, files):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm"):
            assert a[key] == b[key], key  # bit-exact: the same weights arrived
    assert sorted(p.name for p in (trainer.run_dir / "weights").iterdir())  # versions on disk


def test_receive_into_streams_buckets_into_the_model_in_place(tmp_path):
    from groupflow.distributed.transport import receive_into

    w = _weights()
    t = FileTransport(str(tmp_path), bucket_bytes=16)
    ticket = t.send(1, w)
    dest = {k: torch.zeros_like(v) for k, v in w.items()}
    storage = {k: v.data_ptr() for k, v in dest.items()}
    receive_into(t, ticket, dest, role="rollout", rank=0)
    _same(dest, w)
    assert {k: v.data_ptr() for k, v in dest.items()} == storage  # written in place
    # the in-process transports fall back to copying whole tensors
    dest = {k: torch.zeros_like(v) for k, v in w.items()}
    receive_into(DriverTransport(), DriverTransport().send(1, w), dest)
    _same(dest, w)


def test_receive_into_refuses_a_model_of_another_shape(tmp_path):
    from groupflow.distributed.transport import receive_into

    w = _weights()
    t = FileTransport(str(tmp_path), bucket_bytes=16)
    ticket = t.send(1, w)
    dest = {k: torch.zeros_like(v) for k, v in w.items()}
    dest["b"] = torch.zeros(2, 3)  # float32, not bfloat16
    with pytest.raises(TransferError, match=r"reference role, rank 2: 'b' is bfloat16 \(2, 3\)"):
        receive_into(t, ticket, dest, role="reference", rank=2)
