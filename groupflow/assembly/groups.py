"""Worker groups: where each role runs (``placement``), as the pools their workers are placed in.

Design decision: a role's pool is derived from ``placement`` alone (the critic and reward model
take the actor's shape unless placed otherwise), and a local Ray instance is declared once with
the CPUs of every pool together, so no later pool waits for resources that were never declared.
"""

from __future__ import annotations

import os
from dataclasses import replace

from groupflow.config import Config
from groupflow.distributed import PoolSpec, RayOptions, WorkerGroup
from groupflow.distributed.group import ensure_ray

__all__ = ["role_group", "snapshot_group", "pool_spec", "total_cpus"]


def role_group(config: Config, role: str, worker_cls, /, **kwargs) -> WorkerGroup:
    """The worker group of one role, placed in the pool ``config.placement`` gives it; ``kwargs``
    go to the worker's constructor."""
    spec, run = pool_spec(config, role), config.run
    if run.backend == "ray" and not run.ray_address:
        # Declare logical CPUs for every role's pool at once: Ray starts with the first group, and
        # a later pool asking for more than was declared would wait for the placement timeout.
        ensure_ray(None, num_cpus=max(os.cpu_count() or 1, int(total_cpus(config)) + 2))
    return WorkerGroup(
        worker_cls, spec.world_size, backend=run.backend, timeout_s=run.worker_timeout_s,
        ray_options=RayOptions(address=run.ray_address), pool=spec,
        placement_timeout_s=config.placement.timeout_s, **kwargs,
    )  # fmt: skip


def snapshot_group(
    config: Config, worker_cls, /, role_name: str = "rollout", **kwargs
) -> WorkerGroup:
    """One worker of the asynchronous rollout side, in that side's own process (a child process,
    or this one for ``rollout.async_worker: thread``): a frozen copy the side loads weights into."""
    return WorkerGroup(
        worker_cls, 1, backend="local", timeout_s=config.run.worker_timeout_s, role_name=role_name,
        **kwargs,
    )  # fmt: skip


def pool_spec(cfg: Config, role: str) -> PoolSpec:
    """A role's pool; the critic and reward model take the actor's shape unless placed otherwise."""
    pool = getattr(cfg.placement, role)
    if pool is None:
        return replace(pool_spec(cfg, "actor"), name=role)
    default = cfg.run.num_workers // pool.nodes if role == "actor" else 1
    return PoolSpec(pool.nodes, pool.workers_per_node or default, pool.cpus_per_worker,
                    pool.gpus_per_worker, name=role, resources=dict(pool.resources))  # fmt: skip


def total_cpus(cfg: Config) -> float:
    """Logical CPUs every pool of this run reserves together (a local Ray instance declares them)."""
    roles = ["actor"] + [
        r for r in ("rollout", "reference") if getattr(cfg.placement, r) != "colocated"
    ]
    roles += [r for r in ("critic", "reward_model", "teacher") if getattr(cfg, r) is not None]
    if cfg.kind.teacher_in_actor and "teacher" in roles:  # held inside the actor worker
        roles.remove("teacher")
    return sum(pool_spec(cfg, r).world_size * pool_spec(cfg, r).cpus_per_worker for r in roles)
