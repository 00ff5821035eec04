"""A toy worker for dispatch tests (importable by Ray actors: lives in a module, not a test file)."""

import os
import time

import torch

from groupflow.batch import Batch
from groupflow.distributed import PAD_KEY, register


class ToyWorker:
    def __init__(self, rank: int, world_size: int, scale: float = 1.0):
        self.rank, self.world_size, self.scale = rank, world_size, scale

    @register("all")
    def whoami(self) -> tuple[int, int]:
        return self.rank, self.world_size

    @register("rank0")
    def scaled(self, x: float) -> float:
        return x * self.scale + self.rank  # rank 0's answer is x * scale

    @register("dp")
    def double(self, batch: Batch) -> Batch:
        out = batch.copy()
        out["y"] = batch["x"] * 2
        out["rank"] = torch.full((len(batch),), self.rank)
        return out

    @register("dp")
    def expand(self, batch: Batch, n: int) -> Batch:
        """n outputs per input, like generation with n samples per prompt."""
        out = batch.repeat(n)
        out["j"] = torch.arange(n).repeat(len(batch))
        return out

    @register("dp")
    def count_real(self, batch: Batch) -> Batch:
        out = batch.copy()
        out["real_on_rank"] = torch.full((len(batch),), int((~batch[PAD_KEY]).sum()))
        return out

    @register("one")
    def only_rank0(self) -> int:
        return self.rank

    @register("all")
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"boom on rank {rank}")
        return self.rank

    @register("all")
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register("all")
    def die(self, rank: int) -> int:
        if self.rank == rank:
            os._exit(1)
        return self.rank

    def not_exposed(self):
        return "hidden"

    @register("all")
    def placement(self) -> tuple[int, str, str]:
        """(rank, LOCAL_RANK, the Ray placement group id) — where the pool put this worker."""
        import ray

        pg = ray.get_runtime_context().get_placement_group_id()
        return self.rank, os.environ.get("LOCAL_RANK", ""), str(pg)
