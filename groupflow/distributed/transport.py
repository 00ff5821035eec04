"""Weight transport: how a policy version's weights get from the actor to the workers that need
them (a rollout pool, the reference, a critic initialised from the policy, the asynchronous
rollout side), without the driver holding them where the cluster allows it.

Design decision (slime sends from trainer ranks to engines, prime-rl's ``WeightBroadcast``,
AReaL's ``WeightUpdateMeta``): a transfer is two halves and a *ticket*. ``send(version, weights)``
runs where the weights are (the actor's rank 0, in its own process) and returns a small,
picklable ticket; the driver forwards only the ticket; ``receive(ticket)`` runs where the weights
are loaded and returns them, checked. So the bytes that pass through the driver are exactly the
tensor bytes inside tickets (``ticket_nbytes``, logged as ``weights/bytes_via_driver``):

- ``driver``: the ticket *is* the weights (the old path; in-process workers and the default of
  the local backend, where the actor lives in the driver's process anyway);
- ``ring``: the shared-memory ``WeightRing`` of one host (``groupflow.rollout.weight_ring``): the
  ticket is the version; the asynchronous rollout's default on one machine;
- ``filesystem``: safetensors buckets under a directory both sides see, a manifest written last;
  for clusters without a shared collective;
- ``ray``: buckets put into Ray's object store *by the sending rank*; the ticket holds object
  references, the receivers fetch the buckets from the sender's node, never from the driver;
- ``collective`` (``groupflow.distributed.collective``): every actor rank broadcasts its shard
  to the rollout workers over a process group of their own (gloo/NCCL); the ticket is the version.

The transport owns both halves and their order: ``transfer(version, submit, receive)`` runs the
actor's sending half (``submit``: started on its ranks) and the receivers' half in the order it
needs — send, then receive the ticket, or (the collective) both at once — so no caller branches on
which transport it holds. What differs on the sending rank is declared, not inferred from the
name: ``every_rank_sends`` (the collective: each rank broadcasts the shard it holds) and
``ticket_holds_tensors`` (the driver's: the ticket is the weights, so the sender gives a copy);
``members_only`` says the transport reaches only the ranks given to ``open`` (the collective's
process group), so a role outside them (the reference, a critic) needs another one.

The weights travel as a byte stream cut into fixed-size buckets (``rollout.weight_bucket_mb``),
each with its version and a CRC32; a bucket whose checksum or version does not match, or one that
does not arrive within the timeout, is an error naming the role, the rank and the version.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = [
    "WeightTransport",
    "SendThenReceive",
    "TransferError",
    "DriverTransport",
    "RingTransport",
    "FileTransport",
    "RayObjectTransport",
    "Layout",
    "ticket_nbytes",
    "ticket_version",
    "bytes_between_nodes",
    "tensors_nbytes",
    "pack_buckets",
    "unpack_buckets",
    "scatter_bucket",
    "receive_into",
]


class TransferError(RuntimeError):
    """A weight transfer failed its check or timed out (the message names role, rank, version)."""


class WeightTransport(Protocol):
    name: str
    every_rank_sends: bool  # send runs on every actor rank with its own shard (rank=...)
    ticket_holds_tensors: bool  # the ticket is the weights: the sender hands over a copy
    members_only: bool  # reaches only the ranks given to open (see the module docstring)

    def open(self, senders: int, receivers: int) -> None:
        """Set up what both halves share, once per run, in the driver (most: nothing)."""
        ...

    def send(self, version: int, weights: dict[str, torch.Tensor]) -> Any:
        """Make ``version``'s weights available; returns the ticket (small, picklable)."""
        ...

    def receive(
        self, ticket: Any, *, role: str = "rollout", rank: int = 0
    ) -> dict[str, torch.Tensor]:
        """The weights a ticket stands for, checked (version, checksums) within the timeout."""
        ...

    def transfer(self, version: int, submit: Callable[[], Callable[[], Any]],
                 receive: Callable[[Any], Any]) -> Any:  # fmt: skip
        """One version from the actor to a role: ``submit()`` starts the sending half on the
        actor's ranks and returns the function that waits for its ticket; ``receive(ticket)``
        runs the receivers' half. Returns the ticket the driver held (``ticket_nbytes``)."""
        ...

    def close(self) -> None:
        """Free what ``open`` set up (most: nothing)."""
        ...


class SendThenReceive:
    """The halves one after the other: the ticket exists once the sender is done (every
    transport but the collective)."""

    every_rank_sends = False
    ticket_holds_tensors = False
    members_only = False

    def open(self, senders: int, receivers: int) -> None:
        """Nothing shared to set up."""

    def transfer(self, version: int, submit: Callable[[], Callable[[], Any]],
                 receive: Callable[[Any], Any]) -> Any:  # fmt: skip
        ticket = submit()()
        receive(ticket)
        return ticket

    def close(self) -> None:
        """Nothing to free."""


def ticket_nbytes(ticket: Any) -> int:
    """Tensor bytes inside a ticket: what passes through the process that forwards it."""
    if isinstance(ticket, torch.Tensor):
        return int(ticket.numel()) * ticket.element_size()
    if isinstance(ticket, dict):
        return sum(ticket_nbytes(v) for v in ticket.values())
    if isinstance(ticket, (list, tuple)):
        return sum(ticket_nbytes(v) for v in ticket)
    return 0


def tensors_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of a name → tensor dict (what a receiver got)."""
    return sum(int(t.numel()) * t.element_size() for t in tensors.values())


def bytes_between_nodes(nbytes: int, senders: Sequence[str], receivers: Sequence[str],
                        every_rank_sends: bool) -> int:  # fmt: skip
    """The bytes of one ``nbytes`` version that cross from one node to another when each
    receiver (its node, per rank) gets it whole: from the node of the sending rank 0, or, with
    ``every_rank_sends`` (the collective), an equal shard from each sender's node."""
    if every_rank_sends:
        return sum(nbytes * sum(s != r for s in senders) // len(senders) for r in receivers)
    return nbytes * sum(r != senders[0] for r in receivers)


def ticket_version(ticket: Any) -> int:
    """The policy version a ticket carries (the ring's ticket is the version itself)."""
    return int(ticket["version"]) if isinstance(ticket, dict) else int(ticket)


# ----- buckets ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Names, dtypes, shapes and byte offsets of a state dict laid out as one byte stream."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    total: int

    @classmethod
    def of(cls, weights: dict[str, torch.Tensor]) -> Layout:
        names, dtypes, shapes, offsets, at = [], [], [], [], 0
        for name, t in weights.items():
            names.append(name)
            dtypes.append(str(t.dtype).removeprefix("torch."))
            shapes.append(tuple(t.shape))
            offsets.append(at)
            at += t.numel() * t.element_size()
        return cls(tuple(names), tuple(dtypes), tuple(shapes), tuple(offsets), at)

    def to_dict(self) -> dict:
        return {"names": list(self.names), "dtypes": list(self.dtypes),
                "shapes": [list(s) for s in self.shapes], "offsets": list(self.offsets),
                "total": self.total}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> Layout:
        return cls(tuple(d["names"]), tuple(d["dtypes"]), tuple(tuple(s) for s in d["shapes"]),
                   tuple(d["offsets"]), int(d["total"]))  # fmt: skip


def _as_bytes(t: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    return t.detach().contiguous().to(device).reshape(-1).view(torch.uint8)


def pack_buckets(weights: dict[str, torch.Tensor], bucket_bytes: int,
                 device: torch.device | str = "cpu"):  # fmt: skip
    """Yield (index, uint8 bucket [<= bucket_bytes]) over the weights' byte stream, in order, on
    ``device``; at most one bucket is held at a time (tensors may straddle two buckets)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    parts, size, index = [], 0, 0
    for t in weights.values():
        data, at = _as_bytes(t, device), 0
        while at < data.numel():
            take = min(bucket_bytes - size, data.numel() - at)
            parts.append(data[at : at + take])
            size, at = size + take, at + take
            if size == bucket_bytes:
                yield index, torch.cat(parts)
                parts, size, index = [], 0, index + 1
    if parts:
        yield index, torch.cat(parts)


def unpack_buckets(layout: Layout, buckets) -> dict[str, torch.Tensor]:
    """Rebuild the state dict from its buckets, in order (the inverse of ``pack_buckets``)."""
    flat = torch.empty(layout.total, dtype=torch.uint8)
    at = 0
    for b in buckets:
        flat[at : at + b.numel()] = b
        at += b.numel()
    if at != layout.total:
        raise TransferError(f"the buckets hold {at} bytes, the layout {layout.total}")
    out = {}
    for name, dtype, shape, offset, nxt in zip(
        layout.names, layout.dtypes, layout.shapes, layout.offsets,
        (*layout.offsets[1:], layout.total),
    ):  # fmt: skip
        out[name] = flat[offset:nxt].view(getattr(torch, dtype)).view(shape)
    return out


def _check_dest(layout: Layout, dest: dict[str, torch.Tensor], where: str) -> None:
    for name, dtype, shape in zip(layout.names, layout.dtypes, layout.shapes):
        t = dest.get(name)
        if t is None or str(t.dtype).removeprefix("torch.") != dtype or tuple(t.shape) != shape:
            got = "missing" if t is None else f"{t.dtype} {tuple(t.shape)}"
            raise TransferError(
                f"{where}: '{name}' is {dtype} {shape} in the sent weights, {got} here"
            )
        if not t.is_contiguous():
            raise TransferError(f"{where}: '{name}' is not contiguous here")


def scatter_bucket(layout: Layout, bucket: torch.Tensor, start: int,
                   dest: dict[str, torch.Tensor]) -> None:  # fmt: skip
    """Copy the bucket covering bytes [start, start + len) of the stream into ``dest``'s tensors
    in place (so a receiver holds one bucket at a time, never a second copy of the model)."""
    end = start + bucket.numel()
    bounds = zip(layout.names, layout.offsets, (*layout.offsets[1:], layout.total))
    with torch.no_grad():
        for name, lo_t, hi_t in bounds:
            lo, hi = max(lo_t, start), min(hi_t, end)
            if lo < hi:
                flat = dest[name].view(-1).view(torch.uint8)
                flat[lo - lo_t : hi - lo_t] = bucket[lo - start : hi - start].to(flat.device)


def receive_into(transport, ticket: Any, dest: dict[str, torch.Tensor], *, role: str = "rollout",
                 rank: int = 0) -> None:  # fmt: skip
    """Load a ticket's weights into ``dest`` (name → tensor, e.g. a model's state dict) in place:
    bucket by bucket where the transport streams them (``buckets``), or its own way (a collective
    transport's ``receive_into``), else from the whole dict."""
    own = getattr(transport, "receive_into", None)
    if own is not None:
        return own(ticket, dest, role=role, rank=rank)
    stream = getattr(transport, "buckets", None)
    if stream is None:
        weights = transport.receive(ticket, role=role, rank=rank)
        with torch.no_grad():
            for name, t in weights.items():
                dest[name].copy_(t)
        return
    layout, at = None, 0
    for layout, bucket in stream(ticket, role=role, rank=rank):
        if at == 0:
            _check_dest(layout, dest, f"weight transfer to the {role} role, rank {rank}")
        scatter_bucket(layout, bucket, at, dest)
        at += bucket.numel()
    if layout is not None and at != layout.total:
        raise TransferError(f"weight transfer to the {role} role, rank {rank}: {at} of "
                            f"{layout.total} bytes arrived")  # fmt: skip


def checksum(bucket: torch.Tensor) -> int:
    """CRC32 of a uint8 bucket, read in place (no copy of its bytes)."""
    data = bucket.contiguous().numpy()
    return zlib.crc32(memoryview(data))  # pyright: ignore[reportArgumentType] - ndarray is a buffer


def _check(bucket: torch.Tensor, expected: int, index: int, version: int, role: str, rank: int):
    got = checksum(bucket)
    if got != expected:
        raise TransferError(
            f"weight transfer to the {role} role, rank {rank}, policy version {version}: bucket "
            f"{index} has checksum {got:#010x}, the sender's was {expected:#010x} (corrupted)"
        )


# ----- implementations -------------------------------------------------------------------------


class DriverTransport(SendThenReceive):
    """The ticket is the weights: they pass through every process that forwards the ticket."""

    name = "driver"
    ticket_holds_tensors = True

    def send(self, version: int, weights: dict[str, torch.Tensor]) -> dict:
        return {"version": version, "weights": weights}

    def receive(self, ticket: dict, *, role: str = "rollout", rank: int = 0) -> dict:
        return ticket["weights"]


class RingTransport(SendThenReceive):
    """One host: versions are copied into a shared-memory ``WeightRing``; the ticket is the
    version (the ring's slots record which version they hold, so a stale read is an error)."""

    name = "ring"

    def __init__(self, ring):
        self.ring = ring

    def send(self, version: int, weights: dict[str, torch.Tensor]) -> int:
        self.ring.write(version, weights)
        return version

    def receive(self, ticket: int, *, role: str = "rollout", rank: int = 0) -> dict:
        return self.ring.read(ticket)


@dataclass
class FileTransport(SendThenReceive):
    """safetensors buckets under ``root/v<version>/``; ``manifest.json`` (layout, per-bucket
    CRC32) is renamed into place last, so a reader never sees half a version."""

    root: str
    bucket_bytes: int = 64 << 20
    timeout_s: float = 600.0
    keep: int = 4  # versions kept on disk (older ones are removed by the sender)
    name: str = field(default="filesystem", init=False)

    def send(self, version: int, weights: dict[str, torch.Tensor]) -> dict:
        from safetensors.torch import save_file

        folder = Path(self.root) / f"v{version}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "manifest.json").unlink(missing_ok=True)  # the version is sent again: not whole
        sums = []
        for i, bucket in pack_buckets(weights, self.bucket_bytes):
            sums.append(checksum(bucket))
            save_file({"bucket": bucket}, str(folder / f"bucket_{i}.safetensors"),
                      metadata={"version": str(version), "crc32": str(sums[-1])})  # fmt: skip
        manifest = {"version": version, "layout": Layout.of(weights).to_dict(), "crc32": sums}
        tmp = folder / "manifest.json.tmp"
        tmp.write_text(json.dumps(manifest))
        os.replace(tmp, folder / "manifest.json")
        self._prune(version)
        return {"version": version, "dir": str(folder)}

    def receive(self, ticket: dict, *, role: str = "rollout", rank: int = 0) -> dict:
        parts = list(self.buckets(ticket, role=role, rank=rank))
        return unpack_buckets(parts[0][0], [b for _, b in parts])

    def buckets(self, ticket: dict, *, role: str = "rollout", rank: int = 0):
        """(layout, bucket) pairs in order, each checked; one bucket in memory at a time."""
        from safetensors import safe_open

        version, folder = ticket["version"], Path(ticket["dir"])
        deadline = time.monotonic() + self.timeout_s
        while not (folder / "manifest.json").is_file():
            if time.monotonic() >= deadline:
                raise TransferError(
                    f"weight transfer to the {role} role, rank {rank}: policy version {version} "
                    f"did not appear under {folder} within {self.timeout_s:g} s"
                )
            time.sleep(0.05)
        manifest = json.loads((folder / "manifest.json").read_text())
        if manifest["version"] != version:
            raise TransferError(
                f"weight transfer to the {role} role, rank {rank}: {folder} holds policy version "
                f"{manifest['version']}, expected {version}"
            )
        layout = Layout.from_dict(manifest["layout"])
        for i, expected in enumerate(manifest["crc32"]):
            with safe_open(str(folder / f"bucket_{i}.safetensors"), "pt") as f:
                meta = f.metadata() or {}
                if meta.get("version") != str(version):
                    raise TransferError(
                        f"weight transfer to the {role} role, rank {rank}: bucket {i} of "
                        f"{folder} belongs to version {meta.get('version')}, expected {version}"
                    )
                bucket = f.get_tensor("bucket")
            _check(bucket, expected, i, version, role, rank)
            yield layout, bucket

    def _prune(self, version: int) -> None:
        import shutil

        for d in Path(self.root).glob("v*"):
            v = d.name[1:]
            if v.isdigit() and int(v) <= version - self.keep:
                shutil.rmtree(d, ignore_errors=True)


@dataclass
class RayObjectTransport(SendThenReceive):
    """Buckets put into Ray's object store by the sending process (an actor rank); the ticket
    carries their object references and checksums. Receivers fetch each bucket from the sender's
    node; the driver, which forwards the ticket, never holds a byte of the weights.

    Memory: the sending process's heap holds one bucket at a time (each is copied into the object
    store and dropped), but the object store holds the whole version until the last ticket naming
    it is dropped — by design, not by accident: a ticket is fetched *later* (the asynchronous
    rollout fetches a version when it starts a batch, several workers fetch it one after the
    other, a checkpoint reads in-flight versions back), while the actor has already moved on to
    the next update, so no bucket can be cut lazily from the live weights. Bounding it to a few
    buckets would need the sender to wait for every reader (a streaming generator with
    backpressure blocks the actor until all readers are done, i.e. a collective in disguise).
    Bounds: shared memory of the sender's node (spillable to disk by Ray), at most the versions
    whose tickets are held (``TicketStore``: ``max_staleness + 2``). Where the receivers read at
    once (a synchronous rollout pool) ``CollectiveTransport`` keeps every process at ~one bucket."""

    bucket_bytes: int = 64 << 20
    timeout_s: float = 600.0
    name: str = field(default="ray", init=False)

    def send(self, version: int, weights: dict[str, torch.Tensor]) -> dict:
        import ray

        refs, sums = [], []
        for _, bucket in pack_buckets(weights, self.bucket_bytes):
            sums.append(checksum(bucket))
            refs.append(ray.put(bucket))
        return {"version": version, "layout": Layout.of(weights), "refs": refs, "crc32": sums}

    def receive(self, ticket: dict, *, role: str = "rollout", rank: int = 0) -> dict:
        buckets = [b for _, b in self.buckets(ticket, role=role, rank=rank)]
        return unpack_buckets(ticket["layout"], buckets)

    def buckets(self, ticket: dict, *, role: str = "rollout", rank: int = 0):
        """(layout, bucket) pairs in order, each fetched and checked when asked for."""
        import ray
        from ray.exceptions import GetTimeoutError

        version = ticket["version"]
        deadline = time.monotonic() + self.timeout_s
        for i, (ref, expected) in enumerate(zip(ticket["refs"], ticket["crc32"])):
            try:
                bucket: torch.Tensor = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except GetTimeoutError:
                raise TransferError(
                    f"weight transfer to the {role} role, rank {rank}: bucket {i} of policy "
                    f"version {version} did not arrive within {self.timeout_s:g} s"
                ) from None
            _check(bucket, expected, i, version, role, rank)
            yield ticket["layout"], bucket
