"""The sections of where and how a run executes: ``run`` (name, steps, checkpoints, loggers,
backend and workers), ``validation`` (when and what is evaluated), ``parallel`` and
``placement`` (the Ray resource pools per role).

Design decision: the execution and bookkeeping keys are kept apart from the training ones, so
that ``run.allow_config_changes`` and a resume's diff read naturally; the placement section names
Ray's resources without importing the Ray layer (``RAY_RESOURCES`` mirrors
``groupflow.distributed.placement.RESERVED_RESOURCES``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from groupflow.config.base import _Section

# Ray's predefined resources, which a pool sets by its own keys; the same set as
# groupflow.distributed.placement.RESERVED_RESOURCES (the config does not import the Ray layer).
RAY_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


class ValidationConfig(_Section):
    every_steps: int = Field(default=0, ge=0)  # 0: only before and after training
    # evaluate once before the first step (the 'before' of before → after)
    before_training: bool = True
    samples_per_prompt: int = Field(default=1, ge=1)  # k of pass@k / mean@k (sampled)
    # sampling temperature of the sampled evaluation (samples_per_prompt > 1)
    temperature: float = Field(default=1.0, ge=0)
    greedy: bool = True  # also evaluate greedily (val/greedy/*)
    # named benchmarks (groupflow.evals.BENCHMARKS) run greedy at each validation, logged as
    # bench/<name>/<metric>; names are checked when the trainer starts
    benchmarks: list[str] = Field(default_factory=list)
    # the first N prompts of each benchmark (None: all)
    benchmark_limit: int | None = Field(default=None, ge=1)
    # new tokens per benchmark answer (None: each benchmark's own budget)
    benchmark_max_new_tokens: int | None = Field(default=None, ge=1)


class RunConfig(_Section):
    name: str = "run"  # the run's name: its directory under output_dir, the loggers' run name
    output_dir: str = "runs"  # the run directory is <output_dir>/<name>
    seed: int = 0  # seeds data order, sampling and initialisation (a run is reproducible from it)
    # training steps (one rollout batch and its update each)
    total_steps: int = Field(default=100, ge=0)
    resume: str = "auto"  # "auto" | "never" | a checkpoint directory
    # A run directory holds one run (groupflow.run.rundir). A fresh start into a directory that holds
    # an earlier run is refused unless this is true; then the files groupflow wrote there
    # (checkpoints, metrics, samples, tokenizer, plots, logger dirs) are deleted first. With
    # resume=auto it also means "start afresh" even where a checkpoint exists.
    overwrite: bool = False
    # Training-relevant keys (or whole sections) a resume may change from the checkpoint's run;
    # others differing stop the resume with a diff. Keys that only affect bookkeeping, speed or
    # evaluation (groupflow.run.rundir.SAFE_TO_CHANGE, e.g. run.total_steps) may always change.
    allow_config_changes: list[str] = Field(default_factory=list)
    # steps between checkpoints (0: only the final one, see save_final)
    save_every: int = Field(default=0, ge=0)
    save_final: bool = True  # a checkpoint at run.total_steps, whatever save_every says
    # checkpoints kept; older ones are deleted once a newer one is complete
    keep_last: int = Field(default=2, ge=1)
    # where metrics go besides metrics.jsonl
    loggers: list[Literal["console", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["console"]
    )
    console_every: int = Field(default=10, ge=1)  # steps between console lines
    # steps between rows written to samples.jsonl (0: never)
    samples_every: int = Field(default=10, ge=0)
    # samples.jsonl rows also carry prompt_ids, response_ids and response_mask (the trained ids;
    # a few KB a row for long completions, so off by default)
    samples_token_ids: bool = False
    # torch threads of this process (None: torch's default)
    num_threads: int | None = Field(default=None, ge=1)
    # Where the actor workers run: in this process ("local", one worker) or as Ray actors
    # ("ray"; num_workers data-parallel ranks, FSDP2 when > 1). The driver code is the same.
    backend: Literal["local", "ray"] = "local"
    # actor workers (data-parallel ranks; FSDP2 when > 1); needs backend=ray for > 1
    num_workers: int = Field(default=1, ge=1)
    ray_address: str | None = (
        None  # an existing cluster ("auto" or host:port); None starts a local one
    )
    # every remote call fails with a clear error after this
    worker_timeout_s: float = Field(default=600.0, gt=0)

    @model_validator(mode="after")
    def _workers(self):
        if self.backend == "local" and self.num_workers > 1:
            raise ValueError(
                "the local backend runs one in-process worker; use run.backend=ray for num_workers > 1"
            )
        return self


class ParallelConfig(_Section):
    """How the actor's workers split the work beyond data parallelism."""

    # Ulysses sequence parallelism: the actor's run.num_workers workers form groups of this many
    # consecutive ranks; a group trains on the same samples, each rank holding 1/N of every
    # sequence (rows padded to a multiple of N) and 1/N of the heads inside attention. Data
    # parallelism runs across groups (num_workers / N replicas) and FSDP2 over all workers.
    # 1: off. Must divide run.num_workers and the model's attention heads.
    sequence_parallel: int = Field(default=1, ge=1)


class PoolConfig(_Section):
    """Where one role's workers run with run.backend=ray: ``nodes × workers_per_node`` Ray actors,
    each reserving these CPUs/GPUs (a node's workers are packed onto one machine)."""

    nodes: int = Field(default=1, ge=1)  # machines (Ray nodes) the role's workers are spread over
    # None: actor → num_workers / nodes, else 1
    workers_per_node: int | None = Field(default=None, ge=1)
    cpus_per_worker: float = Field(default=1.0, ge=0)  # CPUs each worker reserves from Ray
    # GPUs each worker reserves from Ray (fractions share a GPU)
    gpus_per_worker: float = Field(default=0.0, ge=0)
    # custom Ray resources each worker reserves, e.g. {node_b: 1}: pins the pool to the nodes
    # started with them (ray start --resources '{"node_b": 8}'); CPU and GPU are set above
    resources: dict[str, float] = Field(default_factory=dict)

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for key, amount in value.items():
            if key in RAY_RESOURCES:
                raise ValueError(
                    f"'{key}' is one of Ray's own resources; use cpus_per_worker / "
                    "gpus_per_worker, and name only custom resources here"
                )
            if not key or not amount > 0:
                raise ValueError(f"resource {key!r} needs a name and an amount > 0, got {amount}")
        return value


class PlacementConfig(_Section):
    """Resource pools per role. ``colocated`` roles live inside the actor worker and share its
    weights (the default, no copies); a pool gives the role its own workers, fed weights by the
    driver (the rollout after every update, the reference once)."""

    actor: PoolConfig = Field(default_factory=PoolConfig)
    rollout: Literal["colocated"] | PoolConfig = "colocated"
    reference: Literal["colocated"] | PoolConfig = "colocated"
    # Roles with their own worker class; None: as many workers as the actor, placed like it.
    critic: PoolConfig | None = None
    reward_model: PoolConfig | None = None
    teacher: PoolConfig | None = None
    timeout_s: float = Field(default=120.0, gt=0)  # waiting for the cluster to place a pool
