"""The Batch: what every stage of the dataflow takes and returns.

Design decision: a small purpose-built container rather than tensordict. We need three things
tensordict does not give us together: per-sample Python objects (prompt text, ground truth dicts,
data sources) that move with the tensors through every select/split/concat/reorder; a pickle format
that hands Ray contiguous NumPy buffers (protocol-5 out-of-band, zero-copy) instead of torch's
shared-memory file descriptors; and no compiled extension whose version must track torch's. The
whole container is ~300 lines of obvious code, which keeps it readable and easy to test.

A Batch holds
- ``tensors``: name -> tensor whose first dimension is the sample dimension B;
- ``non_tensors``: name -> object ndarray of length B (one Python value per sample);
- ``meta``: a free-form dict (step, timings, ...) that is carried along and merged, never split.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["Batch", "BatchError"]

# torch dtypes NumPy cannot represent: pickled as same-width integer views.
_VIEW_DTYPES = {torch.bfloat16: torch.int16}
_SENTINEL = object()


class BatchError(ValueError):
    """A Batch operation got inconsistent input (lengths, keys, conflicting values)."""


def _as_object_array(values: Iterable[Any]) -> np.ndarray:
    values = list(values)
    # np.array(list_of_lists) would build a 2-D array; filling an empty object array keeps 1 value per slot.
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _index_tensor(idx: Any, n: int) -> torch.Tensor:
    if isinstance(idx, slice):
        return torch.arange(n)[idx]
    t = torch.as_tensor(np.asarray(idx) if not isinstance(idx, torch.Tensor) else idx)
    if t.dtype == torch.bool:
        if t.numel() != n:
            raise BatchError(f"boolean index has {t.numel()} entries for a batch of {n}")
        return t.nonzero().flatten()
    if t.numel() and (t.dtype.is_floating_point or t.dtype.is_complex):
        raise BatchError(f"index must be integers or booleans, got {t.dtype}")
    t = t.long().flatten()
    if t.numel() and (t.max() >= n or t.min() < -n):
        raise BatchError(
            f"index {int(t.max() if t.max() >= n else t.min())} out of range for a batch of {n}"
        )
    return t


class Batch:
    """Named tensors + per-sample objects with a common leading dimension."""

    __slots__ = ("tensors", "non_tensors", "meta")

    def __init__(
        self,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta: dict[str, Any] | None = None,
    ):
        self.tensors: dict[str, torch.Tensor] = {}
        self.non_tensors: dict[str, np.ndarray] = {}
        self.meta: dict[str, Any] = dict(meta or {})
        for k, v in (tensors or {}).items():
            if not isinstance(v, torch.Tensor):
                raise BatchError(f"tensor '{k}' must be a torch.Tensor, got {type(v).__name__}")
            if v.dim() == 0:
                raise BatchError(
                    f"tensor '{k}' is 0-dimensional; batch tensors need a sample dimension"
                )
            self.tensors[k] = v
        for k, v in (non_tensors or {}).items():
            if k in self.tensors:
                raise BatchError(f"key '{k}' given both as a tensor and as a non-tensor")
            self.non_tensors[k] = v if _is_object_array(v) else _as_object_array(v)
        self._check_lengths()

    # ----- basic protocol -------------------------------------------------------------------
    def _check_lengths(self) -> None:
        lengths = {k: v.shape[0] for k, v in self.tensors.items()}
        lengths.update({k: len(v) for k, v in self.non_tensors.items()})
        if len(set(lengths.values())) > 1:
            detail = ", ".join(f"{k}={n}" for k, n in lengths.items())
            raise BatchError(f"all batch entries need the same leading size; got {detail}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.non_tensors.values():
            return len(v)
        return 0

    def keys(self) -> list[str]:
        return [*self.tensors, *self.non_tensors]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, key: str) -> Any:
        if isinstance(key, str):
            if key in self.tensors:
                return self.tensors[key]
            if key in self.non_tensors:
                return self.non_tensors[key]
            raise KeyError(f"batch has no key '{key}'; keys: {sorted(self.keys())}")
        return self.index(key)

    def __setitem__(self, key: str, value: Any) -> None:
        n = len(self)
        if isinstance(value, torch.Tensor):
            if self.keys() and (value.dim() == 0 or value.shape[0] != n):
                raise BatchError(
                    f"'{key}' has leading size {tuple(value.shape)[:1]}, batch has {n}"
                )
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
        else:
            arr = value if _is_object_array(value) else _as_object_array(value)
            if self.keys() and len(arr) != n:
                raise BatchError(f"'{key}' has {len(arr)} values, batch has {n}")
            self.tensors.pop(key, None)
            self.non_tensors[key] = arr

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __repr__(self) -> str:
        t = ", ".join(
            f"{k}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
            for k, v in self.tensors.items()
        )
        nt = ", ".join(self.non_tensors)
        return (
            f"Batch(len={len(self)}, tensors={{{t}}}, non_tensors=[{nt}], meta={sorted(self.meta)})"
        )

    # ----- key operations -------------------------------------------------------------------
    def select(self, *keys: str, meta: bool = True) -> Batch:
        """A new Batch with only ``keys`` (tensors are shared, not copied)."""
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"select: batch has no key(s) {missing}; keys: {sorted(self.keys())}")
        return Batch(
            {k: v for k, v in self.tensors.items() if k in keys},
            {k: v for k, v in self.non_tensors.items() if k in keys},
            self.meta if meta else None,
        )

    def pop(self, *keys: str) -> Batch:
        """Remove ``keys`` from this batch and return them as a new Batch (meta is shared)."""
        out = self.select(*keys)
        for k in keys:
            self.tensors.pop(k, None)
            self.non_tensors.pop(k, None)
        return out

    def union(self, other: Batch) -> Batch:
        """Merge ``other`` into a new Batch. Same key with different values is an error."""
        if self.keys() and other.keys() and len(self) != len(other):
            raise BatchError(f"union: batch sizes differ ({len(self)} vs {len(other)})")
        tensors, non_tensors = dict(self.tensors), dict(self.non_tensors)
        _merge_kind(tensors, other.tensors, non_tensors, _same_tensor, "tensor", "non-tensor")
        _merge_kind(non_tensors, other.non_tensors, tensors, _same_objects, "non-tensor", "tensor")
        for k, v in other.meta.items():
            if k in self.meta and not _same_meta(self.meta[k], v):
                raise BatchError(f"union: conflicting meta values for '{k}'")
        return Batch(tensors, non_tensors, {**self.meta, **other.meta})

    def rename(self, **mapping: str) -> Batch:
        out = self.copy()
        for old, new in mapping.items():
            if old not in out:
                raise KeyError(f"rename: batch has no key '{old}'")
            out[new] = out[old]
            del out[old]
        return out

    def __delitem__(self, key: str) -> None:
        if key in self.tensors:
            del self.tensors[key]
        elif key in self.non_tensors:
            del self.non_tensors[key]
        else:
            raise KeyError(f"batch has no key '{key}'")

    def copy(self) -> Batch:
        """Shallow copy: new dicts, same tensors and arrays."""
        return Batch(dict(self.tensors), dict(self.non_tensors), copy.copy(self.meta))

    # ----- sample operations ----------------------------------------------------------------
    def index(self, idx: Any) -> Batch:
        """Samples at ``idx`` (int list, tensor, bool mask or slice), in that order."""
        if isinstance(idx, int):
            idx = [idx]
        ind = _index_tensor(idx, len(self))
        ind_np = ind.numpy()
        return Batch(
            {k: v[ind.to(v.device)] for k, v in self.tensors.items()},
            {k: v[ind_np] for k, v in self.non_tensors.items()},
            self.meta,
        )

    reorder = index  # a permutation is just an index that covers every sample once

    def index_by_ids(self, ids: Sequence[Any], key: str = "uid") -> Batch:
        """Samples whose ``key`` value equals each of ``ids``, in the order of ``ids``."""
        if key not in self:
            raise KeyError(f"index_by_ids: batch has no '{key}' column")
        column = self[key]
        values = column.tolist() if isinstance(column, torch.Tensor) else list(column)
        position: dict[Any, int] = {}
        for i, v in enumerate(values):
            if v in position:
                raise BatchError(f"index_by_ids: '{key}' value {v!r} occurs more than once")
            position[v] = i
        missing = [i for i in ids if i not in position]
        if missing:
            raise KeyError(f"index_by_ids: no sample with {key} in {missing[:10]}")
        return self.index([position[i] for i in ids])

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each sample ``n`` times: interleaved (a a b b) or blocked (a b a b)."""
        if n < 1:
            raise BatchError(f"repeat: n must be >= 1, got {n}")
        base = torch.arange(len(self))
        idx = base.repeat_interleave(n) if interleave else base.repeat(n)
        return self.index(idx)

    def split(self, sizes: int | Sequence[int]) -> list[Batch]:
        """Consecutive parts: ``sizes`` is a part size (last part may be smaller) or a list of sizes."""
        n = len(self)
        if isinstance(sizes, int):
            if sizes < 1:
                raise BatchError(f"split: part size must be >= 1, got {sizes}")
            sizes = [min(sizes, n - s) for s in range(0, n, sizes)]
        sizes = list(sizes)
        if any(s < 0 for s in sizes) or sum(sizes) != n:
            raise BatchError(
                f"split: sizes {sizes} must be non-negative and add up to the batch size {n}"
            )
        out, start = [], 0
        for s in sizes:
            out.append(self.index(slice(start, start + s)))
            start += s
        return out

    def chunk(self, n: int) -> list[Batch]:
        """``n`` near-equal consecutive parts (sizes differ by at most one; earlier parts larger)."""
        if n < 1:
            raise BatchError(f"chunk: number of parts must be >= 1, got {n}")
        q, r = divmod(len(self), n)
        return self.split([q + (1 if i < r else 0) for i in range(n)])

    def chunk_padded(self, n: int) -> tuple[list[Batch], int]:
        """``n`` equal parts for data-parallel dispatch, padding by repeating leading samples.

        Returns (parts, pad): the last ``pad`` samples of the concatenated parts are padding, to be
        removed with ``Batch.concat(parts).index(slice(0, len - pad))`` after the call.
        """
        if n < 1:
            raise BatchError(f"chunk_padded: number of parts must be >= 1, got {n}")
        size = len(self)
        if size == 0:
            raise BatchError("chunk_padded: cannot dispatch an empty batch")
        pad = (-size) % n
        padded = self if pad == 0 else Batch.concat([self, self.index(torch.arange(pad) % size)])
        return padded.chunk(n), pad

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Concatenate along the sample dimension; all parts need the same keys. Meta of the first wins."""
        batches = list(batches)
        if not batches:
            raise BatchError("concat: need at least one batch")
        keys = set(batches[0].keys())
        for i, b in enumerate(batches[1:], 1):
            if set(b.keys()) != keys:
                diff = sorted(keys.symmetric_difference(b.keys()))
                raise BatchError(f"concat: part {i} has different keys (differing: {diff})")
        first = batches[0]
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        non_tensors = {
            k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors
        }
        meta: dict[str, Any] = {}
        for b in reversed(batches):
            meta.update(b.meta)
        return Batch(tensors, non_tensors, meta)

    def to(self, device: str | torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors.items()},
            self.non_tensors,
            self.meta,
        )

    def rows(self, keys: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Per-sample dicts of non-tensors (and 1-D tensors as Python scalars), for logging."""
        keys = list(keys) if keys is not None else self.keys()
        out = []
        for i in range(len(self)):
            row = {}
            for k in keys:
                v = self[k][i]
                row[k] = v.item() if isinstance(v, torch.Tensor) and v.dim() == 0 else v
            out.append(row)
        return out

    # ----- pickling -------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # NumPy arrays pickle with protocol-5 out-of-band buffers, which Ray transfers zero-copy;
        # torch tensors would instead go through torch's own (fd-sharing) reducer.
        tensors = {}
        for k, v in self.tensors.items():
            cpu = v.detach().cpu().contiguous()
            view = _VIEW_DTYPES.get(cpu.dtype)
            arr = (cpu.view(view) if view else cpu).numpy()
            tensors[k] = (arr, str(cpu.dtype).replace("torch.", ""), str(v.device), v.requires_grad)
        return {"tensors": tensors, "non_tensors": self.non_tensors, "meta": self.meta}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.tensors = {}
        for k, (arr, dtype, device, requires_grad) in state["tensors"].items():
            # Buffers handed over zero-copy (e.g. by Ray's object store) are read-only; torch needs
            # writable memory, so those are copied once here.
            arr = np.ascontiguousarray(arr)
            t = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
            target = getattr(torch, dtype)
            if t.dtype != target:
                t = t.view(target)
            if (
                device != "cpu"
                and torch.device(device).type == "cuda"
                and torch.cuda.is_available()
            ):
                t = t.to(device)
            self.tensors[k] = t.requires_grad_(requires_grad) if requires_grad else t
        self.non_tensors = state["non_tensors"]
        self.meta = state["meta"]


def _is_object_array(v: Any) -> bool:
    return isinstance(v, np.ndarray) and v.dtype == object and v.ndim == 1


def _merge_kind(into: dict, incoming: dict, other_kind: dict, same, kind: str,
                other: str) -> None:  # fmt: skip
    """``union``'s merge of one kind of value (``kind``: "tensor" or "non-tensor") into ``into``:
    a key held as the ``other`` kind (``other_kind``), or held already with a value that is not
    ``same``, is a BatchError."""
    for k, v in incoming.items():
        if k in other_kind:
            raise BatchError(f"union: key '{k}' is a {other} on one side and a {kind} on the other")
        if k in into and not same(into[k], v):
            raise BatchError(f"union: conflicting values for {kind} '{k}'")
        into[k] = v


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu()))


def _same_objects(a: np.ndarray, b: np.ndarray) -> bool:
    if a is b:
        return True
    return len(a) == len(b) and all(_same_meta(x, y) for x, y in zip(a, b))


def _same_meta(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_tensor(a, b)
    try:
        return bool(a == b)
    except (ValueError, TypeError):  # e.g. ndarray == ndarray is elementwise
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
