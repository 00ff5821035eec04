"""Resource pools: where one role's workers run on a Ray cluster.

Design decision: a pool is ``nodes × workers_per_node`` workers, each a bundle of CPUs and GPUs,
as in verl's resource pools. Each node's share is one Ray placement group with the ``STRICT_PACK``
strategy, so a node's workers land on one machine (shared memory, NVLink) while Ray, not us,
chooses the machines. Rank ``r`` lives on node ``r // workers_per_node``, bundle
``r % workers_per_node`` — consecutive ranks are neighbours, which is what FSDP's collectives want.
Creating a pool waits for the cluster with a timeout and names the missing resources: a request
the cluster cannot satisfy would otherwise wait forever (seen with two 1-CPU actors on 2 cores).
A pool is pinned to chosen machines by Ray's custom resources (``resources``, e.g. ``{"node_b": 1}``
for a node started with ``--resources '{"node_b": 8}'``): they go into every bundle, so Ray can only
place the pool where they exist — placement stays Ray's, the config just narrows it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PoolSpec", "RayPool", "PlacementError", "RESERVED_RESOURCES"]

# Ray's predefined resources: a pool asks for them by their own fields, never as custom ones.
RESERVED_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


class PlacementError(RuntimeError):
    """The cluster cannot place a pool's workers (not enough CPUs/GPUs, or too few nodes)."""


@dataclass(frozen=True)
class PoolSpec:
    """How many workers, how they spread over nodes, and what each one reserves."""

    nodes: int = 1
    workers_per_node: int = 1
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    name: str = "pool"
    # custom Ray resources each worker reserves besides CPUs/GPUs (pins the pool to nodes)
    resources: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        if self.nodes < 1 or self.workers_per_node < 1:
            raise ValueError(
                f"pool '{self.name}': nodes and workers_per_node must be >= 1, got "
                f"{self.nodes} and {self.workers_per_node}"
            )
        if self.cpus_per_worker < 0 or self.gpus_per_worker < 0:
            raise ValueError(f"pool '{self.name}': CPU/GPU counts must be >= 0")
        for key, amount in self.resources.items():
            if key in RESERVED_RESOURCES:
                raise ValueError(
                    f"pool '{self.name}': resource '{key}' is Ray's own; set it with "
                    "cpus_per_worker / gpus_per_worker, and name custom resources in resources"
                )
            if not amount > 0:
                raise ValueError(f"pool '{self.name}': resource '{key}' must be > 0, got {amount}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.workers_per_node

    def bundle(self) -> dict[str, float]:
        """The resources one worker reserves (Ray rejects empty bundles, hence the CPU floor)."""
        b = {"CPU": self.cpus_per_worker or 0.001}
        if self.gpus_per_worker:
            b["GPU"] = self.gpus_per_worker
        return {**b, **self.resources}

    def slot(self, rank: int) -> tuple[int, int]:
        """(node index, bundle index on that node) of a rank."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside pool '{self.name}' of {self.world_size}")
        return divmod(rank, self.workers_per_node)


class RayPool:
    """The placement groups that reserve a pool's resources; workers are scheduled into them."""

    def __init__(self, spec: PoolSpec, timeout_s: float = 120.0):
        import ray
        from ray.util.placement_group import placement_group

        self.spec = spec
        self.groups = [
            placement_group([spec.bundle()] * spec.workers_per_node, strategy="STRICT_PACK")
            for _ in range(spec.nodes)
        ]
        ready, _ = ray.wait([g.ready() for g in self.groups], num_returns=len(self.groups),
                            timeout=timeout_s)  # fmt: skip
        if len(ready) < len(self.groups):
            self.remove()
            raise PlacementError(
                f"pool '{spec.name}': Ray could not place {spec.nodes} node(s) × "
                f"{spec.workers_per_node} worker(s) with {spec.bundle()} each within {timeout_s:g} s; "
                f"the cluster has {_resources(ray, spec.resources)}. Lower placement.{spec.name}'s "
                "counts, add nodes (with the resources it names), or raise placement.timeout_s"
            )

    def options(self, rank: int) -> dict[str, Any]:
        """``.options(...)`` for the actor of ``rank``: its bundle and resource request."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        node, index = self.spec.slot(rank)
        return {
            "num_cpus": self.spec.bundle()["CPU"],
            "num_gpus": self.spec.gpus_per_worker,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.groups[node], placement_group_bundle_index=index
            ),
        }

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for g in self.groups:
            remove_placement_group(g)
        self.groups = []


def _resources(ray, custom: Mapping[str, float] = {}) -> str:
    total = ray.cluster_resources()
    free = ray.available_resources()
    keys = [k for k in ("CPU", "GPU", *custom) if k in total]
    have = ", ".join(f"{k}: {free.get(k, 0):g} free of {total[k]:g}" for k in keys) or "nothing"
    missing = [k for k in custom if k not in total]
    return have + (f"; no node has {', '.join(missing)}" if missing else "")
