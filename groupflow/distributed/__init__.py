"""Worker groups and dispatch: how the single controller reaches its workers (local or Ray)."""

from groupflow.distributed.dispatch import MODES, PAD_KEY, collect, register, split_args
from groupflow.distributed.group import RayOptions, WorkerError, WorkerGroup
from groupflow.distributed.placement import PlacementError, PoolSpec

__all__ = [
    "MODES",
    "PAD_KEY",
    "PlacementError",
    "PoolSpec",
    "RayOptions",
    "WorkerError",
    "WorkerGroup",
    "collect",
    "register",
    "split_args",
]
