"""The collective weight transport: every actor rank broadcasts the part of the weights it holds
(its FSDP2 shard) straight to the rollout workers, in fixed-size buckets, over a process group of
its own (gloo on CPU, NCCL on GPU, as ``parallel.process_group_backend`` picks).

Design decision (slime and prime-rl broadcast from the trainer ranks, verl and vLLM's
weight-transfer API build a *stateless* group beside the training one): the actor's FSDP group is
left alone. The driver hosts a small TCP store (rendezvous keys only, never weights) and hands its
address out in the transport; each process joins lazily, on its first transfer, one group per
actor rank ``r`` — ``{actor rank r, rollout worker 0, ..., rollout worker R-1}`` with the sender
as group rank 0 — built directly on a ``PrefixStore`` (``ProcessGroupGloo``/``ProcessGroupNCCL``),
so nothing touches ``torch.distributed``'s default world. Per transfer, the receivers take the
senders in rank order; sender ``r``:

1. broadcasts a header ``[version, metadata bytes, buckets]`` and its metadata: the pieces it
   holds, ``(name, dtype, global shape, first row, rows)`` — a Shard(0) DTensor's local rows, a
   plain tensor whole from rank 0 only (replicated: one copy is enough);
2. cuts those pieces' bytes into buckets of ``bucket_bytes`` (``pack_buckets``; one bucket in
   memory at a time) and broadcasts each after a ``[version, index, CRC32]`` header.

The receiver copies each bucket into the rows of its own model's tensors in place
(``scatter_bucket`` over the pieces' views), so it too holds one bucket beyond its model, and no
process ever materialises the full model for the transfer. A version or checksum that does not
match, or a broadcast that does not complete within the timeout, is a ``TransferError`` naming the
role, the rank and the version. Sender and receivers must run at the same time (the driver starts
the actor's ``send_weights`` without waiting, then the pool's ``receive_weights``): a collective
transfer cannot be fetched later, so this transport serves the synchronous rollout pool, not
tickets parked for the asynchronous side or a checkpoint (the config validator says so).
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from groupflow.distributed.parallel import process_group_backend
from groupflow.distributed.transport import (
    Layout,
    TransferError,
    _check,
    checksum,
    pack_buckets,
    scatter_bucket,
)

__all__ = ["CollectiveTransport", "local_pieces"]

# This process's groups, by (group name, sending actor rank, own group rank): joined on first use,
# kept for the run; dropped after a failed transfer (a broken group is not used again).
_GROUPS: dict[tuple[str, int, int], Any] = {}


def local_pieces(weights: dict[str, torch.Tensor], rank: int) -> list[tuple[dict, torch.Tensor]]:
    """The rows of ``weights`` this actor rank contributes: ``[(piece, local tensor)]`` with
    ``piece = {name, dtype, shape (global), row (first), rows}``. A DTensor sharded on dim 0 (FSDP2)
    gives its local rows; a replicated DTensor or a plain tensor is sent whole by rank 0 only."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    out = []
    for name, t in weights.items():
        t = t.detach()
        row = 0
        if isinstance(t, DTensor):
            placements = tuple(t.placements)
            if all(isinstance(p, Replicate) for p in placements):
                local = t.to_local()
                if rank != 0:
                    continue
            elif placements == (Shard(0),):
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                local = t.to_local()
                _, offset = compute_local_shape_and_global_offset(
                    t.shape, t.device_mesh, placements
                )
                row = int(offset[0]) if len(offset) else 0
            else:
                raise ValueError(
                    f"collective weight transport: '{name}' is placed {placements}; only a 1-D "
                    "mesh sharded on dim 0 (FSDP2) or replicated weights can be sent"
                )
        elif rank != 0:
            continue
        else:
            local = t
        shape = tuple(t.shape)
        rows = local.shape[0] if local.dim() else 1
        piece = {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": shape,
                 "row": row, "rows": int(rows)}  # fmt: skip
        out.append((piece, local))
    return out


def _piece_view(t: torch.Tensor, piece: dict) -> torch.Tensor:
    """The rows of ``t`` a piece covers, as a view (row-major: contiguous)."""
    flat = t.view(1) if t.dim() == 0 else t
    return flat[piece["row"] : piece["row"] + piece["rows"]]


def _driver_host() -> str:
    """The address the rollout workers reach the driver's store at: on Ray, the driver node's
    (workers may run on other nodes), else the loopback."""
    try:
        import ray
    except ImportError:
        return "127.0.0.1"
    return str(ray.util.get_node_ip_address()) if ray.is_initialized() else "127.0.0.1"


@dataclass
class CollectiveTransport:
    """Actor ranks → rollout workers over per-sender process groups (see the module docstring).
    ``open`` (driver) starts the rendezvous store; the transport, pickled into the workers with
    every call, carries its address; ``send``/``receive_into`` run in the workers."""

    bucket_bytes: int = 64 << 20
    timeout_s: float = 600.0
    senders: int = 0  # actor ranks
    receivers: int = 0  # rollout workers
    address: tuple[str, int] | None = None  # the rendezvous store (``open``)
    group: str = ""  # a fresh name per ``open``: the keys of one run's groups
    name: str = field(default="collective", init=False)
    every_rank_sends = True  # each actor rank broadcasts the shard it holds
    ticket_holds_tensors = False
    members_only = True  # its process groups span the actor's ranks and the rollout pool

    # ----- driver side ------------------------------------------------------------------------
    def open(self, senders: int, receivers: int, host: str | None = None) -> None:
        """Start the rendezvous store in this process (the driver) for ``senders`` actor ranks and
        ``receivers`` rollout workers; once per run. The store holds group set-up keys only."""
        if senders < 1 or receivers < 1:
            raise ValueError(f"collective transport: {senders} senders, {receivers} receivers")
        host = host if host is not None else _driver_host()
        # torch's type stubs do not re-export the c10d store classes torch.distributed exposes
        from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=self.timeout_s))  # fmt: skip
        self.address, self.senders, self.receivers = (host, self._store.port), senders, receivers
        self.group = f"groupflow-weights-{uuid.uuid4().hex[:12]}"

    def transfer(self, version: int, submit: Callable[[], Callable[[], Any]],
                 receive: Callable[[Any], Any]) -> dict:  # fmt: skip
        """Both halves at once: the actor's ranks broadcast while the receivers receive (each
        waits for the other), so the sending half is started first and waited for last."""
        sent = submit()
        ticket = self.ticket(version)
        receive(ticket)
        sent()
        return ticket

    def close(self) -> None:
        self._store = None

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_store"}  # the store stays here

    def ticket(self, version: int) -> dict:
        """What the receivers are given (no weights: the senders broadcast them meanwhile)."""
        return {"version": version, "group": self.group}

    # ----- worker side ------------------------------------------------------------------------
    def _join(self, src: int, member: int, where: str):
        """This process's handle on sender ``src``'s group (group rank ``member``: 0 is the
        sender, 1.. the receivers); the first call does the rendezvous (``where``: for errors)."""
        key = (self.group, src, member)
        if key not in _GROUPS:
            if self.address is None:
                raise TransferError("collective weight transport: open() was never called")
            from torch.distributed import PrefixStore, TCPStore  # pyright: ignore[reportPrivateImportUsage]

            timeout = datetime.timedelta(seconds=self.timeout_s)
            try:
                store = TCPStore(*self.address, is_master=False, timeout=timeout)
                prefixed = PrefixStore(f"{self.group}/{src}", store)
                size = 1 + self.receivers
                if "nccl" in process_group_backend(torch.cuda.is_available()):
                    from torch.distributed import ProcessGroupNCCL

                    opts = ProcessGroupNCCL.Options()
                    opts._timeout = timeout
                    pg = ProcessGroupNCCL(prefixed, member, size, opts)
                else:
                    from torch.distributed import ProcessGroupGloo

                    pg = ProcessGroupGloo(prefixed, member, size, timeout)
            except RuntimeError as e:  # the store or a peer did not answer in time
                raise TransferError(
                    f"{where}: the weight group of actor rank {src} did not form within "
                    f"{self.timeout_s:g} s (timeout; {type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''})"
                ) from None
            _GROUPS[key] = (pg, store)
        return _GROUPS[key][0]

    def _device(self) -> torch.device:
        if "nccl" in process_group_backend(torch.cuda.is_available()):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @staticmethod
    def _drop(pg) -> None:
        """Forget a group after a failed transfer (its peers are out of step)."""
        for key in [k for k, v in _GROUPS.items() if v[0] is pg]:
            del _GROUPS[key]

    def _bcast(self, pg, t: torch.Tensor, what: str) -> None:
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        try:
            pg.broadcast([t], opts).wait()
        except RuntimeError as e:
            self._drop(pg)
            raise TransferError(
                f"{what}: no answer within {self.timeout_s:g} s (timeout) or the peer failed "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            ) from None

    def send(self, version: int, weights: dict[str, torch.Tensor], *, rank: int = 0) -> dict:
        """Broadcast this actor rank's part of ``weights`` (``local_pieces``) as ``version`` to
        the receivers, bucket by bucket; returns the ticket. Every actor rank calls it."""
        where = f"weight transfer from the actor role, rank {rank}, policy version {version}"
        pg, device = self._join(rank, 0, where), self._device()
        pieces = local_pieces(weights, rank)
        total = sum(t.numel() * t.element_size() for _, t in pieces)
        n_buckets = -(-total // self.bucket_bytes)
        meta = torch.frombuffer(bytearray(json.dumps([p for p, _ in pieces]).encode()),
                                dtype=torch.uint8)  # fmt: skip
        self._bcast(pg, torch.tensor([version, meta.numel(), n_buckets], device=device), where)
        self._bcast(pg, meta.to(device), where)
        del meta
        stream = {f"{i}": t for i, (_, t) in enumerate(pieces)}
        for index, bucket in pack_buckets(stream, self.bucket_bytes, device=device):
            crc = checksum(bucket.cpu())
            header = torch.tensor([version, index, crc], device=device)
            self._bcast(pg, header, f"{where}, bucket {index}")
            self._bcast(pg, bucket, f"{where}, bucket {index}")
            del bucket, header  # before the next is cut: one bucket held at a time
        return self.ticket(version)

    def receive_into(self, ticket: dict, dest: dict[str, torch.Tensor], *,
                     role: str = "rollout", rank: int = 0, allocate: bool = False) -> None:  # fmt: skip
        """Receive a version from every actor rank into ``dest`` (name → tensor, e.g. a model's
        state dict) in place, each bucket checked; every name in ``dest`` must be covered.
        ``allocate``: tensors ``dest`` lacks are created as their first rows arrive."""
        version = int(ticket["version"])
        where = f"weight transfer to the {role} role, rank {rank}, policy version {version}"
        device, covered = self._device(), dict.fromkeys(dest, 0)
        for src in range(self.senders):
            at_src = f"{where}, from actor rank {src}"
            pg = self._join(src, 1 + rank, at_src)
            header = torch.zeros(3, dtype=torch.int64, device=device)
            self._bcast(pg, header, at_src)
            sent_version, meta_bytes, n_buckets = (int(x) for x in header.cpu())
            if sent_version != version:
                self._drop(pg)
                raise TransferError(f"{at_src}: the sender sent policy version {sent_version}")
            meta = torch.empty(meta_bytes, dtype=torch.uint8, device=device)
            self._bcast(pg, meta, at_src)
            pieces = json.loads(bytes(meta.cpu().numpy()).decode())
            del meta
            views = {}
            for i, p in enumerate(pieces):
                if allocate and p["name"] not in dest:
                    dest[p["name"]] = torch.empty(p["shape"], dtype=getattr(torch, p["dtype"]),
                                                  device=device)  # fmt: skip
                    covered[p["name"]] = 0
                t = dest.get(p["name"])
                if (t is None or str(t.dtype).removeprefix("torch.") != p["dtype"]
                        or tuple(t.shape) != tuple(p["shape"])):  # fmt: skip
                    got = "missing" if t is None else f"{t.dtype} {tuple(t.shape)}"
                    raise TransferError(f"{at_src}: '{p['name']}' is {p['dtype']} "
                                        f"{tuple(p['shape'])} in the sent weights, {got} here")  # fmt: skip
                if not t.is_contiguous():
                    raise TransferError(f"{at_src}: '{p['name']}' is not contiguous here")
                views[f"{i}"] = _piece_view(t, p)
                covered[p["name"]] += views[f"{i}"].numel()
            layout = Layout.of(views)
            at = 0
            for index in range(n_buckets):
                size = min(self.bucket_bytes, layout.total - at)
                header = torch.zeros(3, dtype=torch.int64, device=device)
                self._bcast(pg, header, f"{at_src}, bucket {index}")
                bucket = torch.empty(size, dtype=torch.uint8, device=device)
                self._bcast(pg, bucket, f"{at_src}, bucket {index}")
                got_version, got_index, crc = (int(x) for x in header.cpu())
                if got_version != version or got_index != index:
                    self._drop(pg)
                    raise TransferError(f"{at_src}: bucket {index} arrived as bucket {got_index} "
                                        f"of policy version {got_version}")  # fmt: skip
                try:
                    _check(bucket.cpu(), crc, index, version, role, rank)
                except TransferError:
                    self._drop(pg)
                    raise
                scatter_bucket(layout, bucket, at, views)
                at += size
                del bucket, header
        short = [n for n, got in covered.items() if got != dest[n].numel()]
        if short:
            raise TransferError(f"{where}: the actor ranks sent {covered[short[0]]} of "
                                f"{dest[short[0]].numel()} elements of '{short[0]}' "
                                f"({len(short)} tensors incomplete)")  # fmt: skip

    def receive(self, ticket: dict, *, role: str = "rollout", rank: int = 0) -> dict:
        """The version's weights as new tensors (for an engine that keeps its own copy)."""
        out: dict[str, torch.Tensor] = {}
        self.receive_into(ticket, out, role=role, rank=rank, allocate=True)
        return out

    def leave(self, role: str = "rollout", rank: int = 0) -> None:
        """Meet this member's groups' other members at a barrier, then drop its handles (a group
        torn down while a peer still talks aborts the process). ``role``: "actor" (the group of
        actor rank ``rank``) or a receiving role (every sender's group, as receiver ``rank``)."""
        keys = [(self.group, rank, 0)] if role == "actor" else [
            (self.group, src, 1 + rank) for src in range(self.senders)]  # fmt: skip
        for key in keys:
            if key in _GROUPS:
                pg, _ = _GROUPS.pop(key)
                try:
                    pg.barrier().wait()
                except RuntimeError:
                    pass  # a peer is gone: nothing left to wait for
