"""Policy weights by version, in a few preallocated flat buffers that two processes can share.

Design decision: the asynchronous rollout needs the weights of the last few policy versions on
its side, and a checkpoint needs them on the trainer's. Pickling a state dict per version costs
the trainer a serialisation (torch's shared-memory pickling also passes one file descriptor per
tensor, each served by a thread that needs the trainer's GIL). Instead the weights of version
``v`` are *copied* into slot ``v % slots`` of a ring allocated once — in shared memory when the
reader is another process, so handing it over is a one-time cost — and both sides read a slot as
a dict of tensor views. Publishing a version therefore costs the trainer one memcpy and nothing
else. The caller guarantees a slot is not overwritten while it is read: with the asynchronous
rollout's schedule, version ``v + slots`` is written only after every batch that needs version
``v`` was generated (``groupflow.rollout.hosts``). Each slot records the version it holds, so a
read of a version that was overwritten (or never written) is an error, not silent garbage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["WeightRing"]

_ALIGN = 64  # bytes: every tensor starts on a cache line


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class WeightRing:
    """``slots`` copies of one state dict layout (names, dtypes, shapes of ``template``)."""

    def __init__(self, template: dict[str, torch.Tensor], slots: int, shared: bool):
        if slots < 1:
            raise ValueError(f"a weight ring needs at least one slot, got {slots}")
        entries, offset = [], 0
        for name, t in template.items():
            nbytes = t.numel() * t.element_size()
            entries.append(_Entry(name, t.dtype, tuple(t.shape), offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.entries = entries
        self.buffers = [torch.empty(max(offset, 1), dtype=torch.uint8) for _ in range(slots)]
        self.held = torch.full((slots,), -1, dtype=torch.long)  # the version each slot holds
        if shared:  # torch pickles shared tensors to another process as the same memory
            for b in self.buffers:
                b.share_memory_()
            self.held.share_memory_()
        self._slot_views: list[dict[str, torch.Tensor]] | None = None  # built on first use

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_slot_views": None}  # views are rebuilt on the other side

    @property
    def slots(self) -> int:
        return len(self.buffers)

    def write(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Copy ``weights`` (the template's names, dtypes and shapes) into ``version``'s slot."""
        names = {e.name for e in self.entries}
        if set(weights) != names:
            missing, extra = sorted(names - set(weights)), sorted(set(weights) - names)
            raise KeyError(
                f"weights do not match the ring's layout: missing {missing}, extra {extra}"
            )
        slot = version % self.slots
        self.held[slot] = -1  # a reader never takes a half-written slot for a whole one
        views = self._views(slot)
        with torch.no_grad():  # one call for all tensors: the copy is the whole cost
            torch._foreach_copy_(list(views.values()), [weights[n].detach() for n in views])  # pyright: ignore[reportPrivateImportUsage]
        self.held[slot] = version

    def read(self, version: int) -> dict[str, torch.Tensor]:
        """``version``'s weights as views into its slot (valid until the slot is written again)."""
        slot = version % self.slots
        held = int(self.held[slot])
        if held != version:
            raise RuntimeError(
                f"the weight ring no longer holds policy version {version} (its slot holds "
                f"{'nothing' if held < 0 else f'version {held}'}): a reader fell more than "
                f"{self.slots} versions behind the writer"
            )
        return dict(self._views(slot))

    def versions(self) -> list[int]:
        return sorted(int(v) for v in self.held if v >= 0)

    def _views(self, slot: int) -> dict[str, torch.Tensor]:
        if self._slot_views is None:
            self._slot_views = [
                {
                    e.name: b[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)
                    for e in self.entries
                }  # fmt: skip
                for b in self.buffers
            ]
        return self._slot_views[slot]
