"""How a worker-group call fans out to workers and how results come back.

Design decision: four dispatch modes, declared per worker method with ``@register(mode)``, are
all the single controller needs (verl has a dozen; we keep the ones its trainer actually uses):

- ``all``:   every rank gets the same arguments; the caller gets the list of results.
- ``rank0``: every rank runs the method (so collectives inside it work); the caller gets rank 0's
             result. For updates and checkpoints.
- ``dp``:    the first argument is a Batch, split into ``world_size`` equal parts (padding the last
             ones by repeating samples, marked ``dispatch_pad``), other arguments replicated; Batch
             results are concatenated and the padding removed — so the caller sees exactly one
             output per input sample (or ``k`` per input sample, e.g. ``n`` generations per prompt).
             Non-Batch results come back from rank 0.
- ``one``:   only rank 0 runs (no collectives allowed).

The split/collect functions are pure and tested on their own; the worker group applies them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from groupflow.batch import Batch

__all__ = ["MODES", "register", "dispatch_mode", "split_args", "collect", "PAD_KEY"]

MODES = ("all", "rank0", "dp", "one")
PAD_KEY = (
    "dispatch_pad"  # bool [B]: True for samples added to make parts equal; workers must ignore them
)
_ATTR = "_groupflow_dispatch"


def register(mode: str = "all") -> Callable:
    """Mark a worker method as callable through a WorkerGroup with dispatch ``mode``."""
    if mode not in MODES:
        raise ValueError(f"unknown dispatch mode '{mode}'; valid: {', '.join(MODES)}")

    def mark(fn: Callable) -> Callable:
        setattr(fn, _ATTR, mode)
        return fn

    return mark


def dispatch_mode(fn: Any) -> str | None:
    return getattr(fn, _ATTR, None)


def split_args(
    mode: str, world_size: int, args: tuple, kwargs: dict
) -> tuple[list[tuple[tuple, dict]], int]:
    """Per-rank (args, kwargs) and the number of padding samples added (``dp`` only)."""
    if mode != "dp":
        return [(args, kwargs)] * world_size, 0
    if not args or not isinstance(args[0], Batch):
        raise TypeError("a 'dp' method needs a Batch as its first positional argument")
    batch = args[0]
    n = len(batch)
    if n == 0:
        raise ValueError("cannot dispatch an empty Batch")
    marked = batch.copy()
    marked[PAD_KEY] = torch.zeros(n, dtype=torch.bool)
    parts, pad = marked.chunk_padded(world_size)
    if pad:
        # the padding rows are the last `pad` rows of the concatenation: mark them
        flags = torch.zeros(n + pad, dtype=torch.bool)
        flags[n:] = True
        parts = [p for p in _remark(parts, flags)]
    return [((part, *args[1:]), kwargs) for part in parts], pad


def _remark(parts: list[Batch], flags: torch.Tensor) -> list[Batch]:
    out, start = [], 0
    for p in parts:
        p = p.copy()
        p[PAD_KEY] = flags[start : start + len(p)]
        start += len(p)
        out.append(p)
    return out


def collect(mode: str, results: Sequence[Any], *, inputs: int = 0, pad: int = 0) -> Any:
    """Combine per-rank results. ``inputs``/``pad``: the dp input size before padding and the padding."""
    if mode == "all":
        return list(results)
    if mode in ("rank0", "one"):
        return results[0]
    if not all(isinstance(r, Batch) for r in results):
        return results[0]
    merged = Batch.concat(list(results))
    padded_inputs = inputs + pad
    if len(merged) % padded_inputs:
        raise ValueError(
            f"dp results have {len(merged)} samples for {padded_inputs} inputs: a dp method must return a "
            "whole number of outputs per input sample"
        )
    per_input = len(merged) // padded_inputs
    keep = merged.index(slice(0, inputs * per_input))
    if PAD_KEY in keep:
        del keep[PAD_KEY]
    return keep
