"""The collective weight transport (``groupflow.distributed.collective``) between processes: two
FSDP2-sharded actor ranks (gloo, one torch thread each) broadcast their shards to two rollout
receivers, which end up with the actor's full state exactly, each process holding about one
bucket beyond its model (tensor bytes allocated, counted by a dispatch mode); a corrupted bucket,
a wrong version and a sender that never comes are errors naming the role, the rank and the version.

The actor ranks are ``spawn`` children (FSDP2 needs a process group per process); the receivers
and the single-sender error cases are threads of the test process, which also hosts the
rendezvous store. Every wait has a timeout.
"""

from __future__ import annotations

import os
import threading
import time
import weakref

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from groupflow.distributed.collective import CollectiveTransport, local_pieces
from groupflow.distributed.transport import TransferError, receive_into

BUCKET = 1024  # bytes; each rank's shard is ~5x that


class _Net(nn.Module):
    """Rows that split unevenly over 2 ranks (101, 9, 3, 1), a bf16 parameter and a buffer."""

    def __init__(self, seed: int):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(101, 16)
            self.layers = nn.ModuleList([nn.Linear(16, 9), nn.Linear(9, 3)])
            self.low = nn.Linear(4, 1).to(torch.bfloat16)
            self.register_buffer("scale", torch.rand(3) + seed)


class TensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created inside the block and still alive (not RSS)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.held: dict[int, int] = {}

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self.held.pop(key, None)

    @staticmethod
    def _storage(t):
        """(storage, its address), or None for a tensor without real memory (a DTensor)."""
        if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor:
            return None
        s = t.untyped_storage()
        return s, s.data_ptr()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {s[1] for s in map(self._storage, tree_leaves((args, kwargs))) if s}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if (found := self._storage(t)) is not None:
                s, key = found
                n = s.nbytes()
                if n and key not in inputs and key not in self.held:
                    self.held[key] = n
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(s, self._free, key, n)
        return out


def _actor(rank: int, world: int, store: str, transport, version: int, out: str):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model = _Net(seed=0)
        for m in (*model.layers, model.low):
            fully_shard(m)
        fully_shard(model)  # the actor's own FSDP group: the transport's groups are separate
        weights = model.state_dict()
        with TensorBytes() as mem:
            try:
                transport.send(version, weights, rank=rank)
                result = {
                    "peak": mem.peak,
                    "shard": sum(
                        t.numel() * t.element_size() for _, t in local_pieces(weights, rank)
                    ),
                }
            except TransferError as e:
                result = {"error": str(e)}
        torch.save(result, out)
        transport.leave("actor", rank)
        dist.barrier()  # neither rank tears gloo down while its peer still talks
    finally:
        dist.destroy_process_group()


def _receive(rank: int, transport, version: int, results: dict) -> None:
    """A rollout receiver (a thread of this process): its own weights, then the transfer."""
    dest = _Net(seed=1).state_dict()  # other weights than the actor's: all must be overwritten
    with TensorBytes() as mem:  # a dispatch mode is per thread: this receiver's tensors only
        try:
            receive_into(transport, transport.ticket(version), dest, role="rollout", rank=rank)
            results[rank] = {"peak": mem.peak, "state": dest}
        except TransferError as e:
            results[rank] = {"error": str(e)}
            return
    transport.leave("rollout", rank)  # meet the senders at the groups' barriers


def _send(transport, version: int, weights: dict, results: dict) -> None:
    try:
        transport.send(version, weights, rank=0)
        results["sent"] = True
    except TransferError as e:
        results["sent"] = str(e)


def _threads(*targets, timeout_s: float = 60.0) -> None:
    threads = [threading.Thread(target=fn, args=args, daemon=True) for fn, args in targets]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a transfer did not finish (timeout)"


def _transport(senders: int, receivers: int, timeout_s: float) -> CollectiveTransport:
    t = CollectiveTransport(bucket_bytes=BUCKET, timeout_s=timeout_s)
    t.open(senders, receivers)
    return t


@pytest.mark.slow  # two processes importing torch
def test_sharded_actor_ranks_send_their_shards_to_two_receivers(tmp_path):
    transport = _transport(2, 2, timeout_s=90)
    ctx = mp.get_context("spawn")
    out = [str(tmp_path / f"actor{r}") for r in range(2)]
    actors = [ctx.Process(target=_actor, daemon=True,
                          args=(r, 2, str(tmp_path / "store"), transport, 7, out[r]))
              for r in range(2)]  # fmt: skip
    for p in actors:
        p.start()
    got: dict = {}
    try:
        _threads(*[(_receive, (r, transport, 7, got)) for r in range(2)], timeout_s=150)
    finally:
        for p in actors:
            p.join(60)
            if p.is_alive():  # ours: never left behind
                p.kill()
    want, other = _Net(seed=0).state_dict(), _Net(seed=1).state_dict()
    total = sum(t.numel() * t.element_size() for t in want.values())
    for r in range(2):
        assert "error" not in got[r], got[r].get("error")
        assert list(got[r]["state"]) == list(want)
        for k, v in want.items():
            assert not torch.equal(v, other[k]), k  # the receiver started from other weights
            assert got[r]["state"][k].dtype == v.dtype and torch.equal(got[r]["state"][k], v), k
        # about one bucket, no model: gloo may still hold the previous bucket for a moment (its
        # work object is released by its own thread), so two at most, and a 24-byte header
        assert got[r]["peak"] <= 2 * BUCKET + 64, got[r]["peak"]
    for r in range(2):
        assert os.path.exists(out[r]), f"actor rank {r} failed (see its output)"
        sent = torch.load(out[r], weights_only=False)
        assert "error" not in sent, sent.get("error")
        assert BUCKET * 3 < sent["shard"] < total  # several buckets each, never the whole model
        assert sent["peak"] <= 2 * BUCKET + 64, sent["peak"]


def test_a_corrupted_bucket_is_named_by_role_rank_version(monkeypatch):
    import groupflow.distributed.collective as collective

    transport = _transport(1, 1, timeout_s=3)
    real = collective.checksum  # the sender's checksum disagrees with the bytes it sends
    monkeypatch.setattr(collective, "checksum", lambda b: (real(b) + 1) & 0xFFFFFFFF)
    got: dict = {}
    _threads((_send, (transport, 3, _Net(seed=0).state_dict(), got)),
             (_receive, (0, transport, 3, got)))  # fmt: skip
    assert got[0]["error"].startswith(
        "weight transfer to the rollout role, rank 0, policy version 3: bucket 0 has checksum"
    )
    assert got[0]["error"].endswith("(corrupted)")
    assert "from the actor role, rank 0, policy version 3" in got["sent"]  # left waiting: timeout


def test_a_version_mismatch_is_named_by_role_rank_version():
    transport = _transport(1, 1, timeout_s=3)
    got: dict = {}
    _threads((_send, (transport, 3, _Net(seed=0).state_dict(), got)),
             (_receive, (0, transport, 4, got)))  # fmt: skip
    assert got[0]["error"] == (
        "weight transfer to the rollout role, rank 0, policy version 4, from actor rank 0: "
        "the sender sent policy version 3"
    )


def test_a_sender_that_never_comes_times_out_naming_role_rank_version():
    t = _transport(1, 1, timeout_s=1.5)
    start = time.monotonic()
    with pytest.raises(TransferError) as e:
        t.receive_into(t.ticket(5), {}, role="rollout", rank=0)
    assert time.monotonic() - start < 30
    assert str(e.value).startswith(
        "weight transfer to the rollout role, rank 0, policy version 5, from actor rank 0: the "
        "weight group of actor rank 0 did not form within 1.5 s (timeout"
    )


def test_local_pieces_take_rank_zero_for_plain_tensors():
    w = {"a": torch.ones(2, 3), "b": torch.tensor(2.0)}
    pieces = local_pieces(w, 0)
    assert [p for p, _ in pieces] == [
        {"name": "a", "dtype": "float32", "shape": (2, 3), "row": 0, "rows": 2},
        {"name": "b", "dtype": "float32", "shape": (), "row": 0, "rows": 1},
    ]
    assert local_pieces(w, 1) == []  # replicated: one copy is enough


def test_open_needs_senders_and_receivers():
    with pytest.raises(ValueError, match="0 senders, 1 receivers"):
        CollectiveTransport().open(0, 1)
