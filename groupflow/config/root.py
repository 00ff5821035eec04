"""``Config``: the whole run configuration, and the checks that span its sections.

Design decision: every rule that relates two sections (placement vs backend, PPO needs a critic,
the vLLM engine's limits, batch sizes that must divide) is a model validator here, so a config
that loads is one the assembly (``groupflow.assembly``) can run; nothing below the assembly reads
this object (style.md principle 6). What one model kind refuses, requires or defaults (diffusion
refuses LLM-only keys, say) is not here but in that kind's list in ``groupflow.config.kinds``:
these validators are the rules every kind shares.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from groupflow.config.base import _Section
from groupflow.config.diffusion import DiffusionConfig
from groupflow.config.keys import unknown_key_problem
from groupflow.config.kinds import Kind, apply_kind_defaults, kind_of
from groupflow.config.model_data import DataConfig, ModelConfig, TinyModelConfig
from groupflow.config.presets import expand_preset
from groupflow.config.rewards import RewardConfig, RewardModelConfig, TeacherConfig
from groupflow.config.rollout import VLLM_HEAD_DIMS, RolloutConfig, ServeConfig
from groupflow.config.run import ParallelConfig, PlacementConfig, RunConfig, ValidationConfig
from groupflow.config.training import ActorConfig, AlgorithmConfig, CriticConfig, SFTConfig

__all__ = ["Config", "collective_refusal", "spans_nodes"]


def _tiny(cfg: Config) -> TinyModelConfig | None:
    """The tiny model's section, or None (a model directory, or no model section at all)."""
    return cfg.model.tiny if cfg.model is not None else None


def _tiny_vlm(cfg: Config) -> bool:
    """Whether the model is a tiny vision-language one (model.tiny.vision is set)."""
    tiny = _tiny(cfg)
    return tiny is not None and tiny.vision is not None


def collective_refusal(cfg: Config) -> str | None:
    """Why the collective weight transport cannot serve this run, or None: its senders and
    receivers must meet for every transfer (``groupflow.distributed.collective``)."""
    if cfg.run.backend != "ray":
        return f"needs run.backend=ray (got {cfg.run.backend!r})"
    if cfg.placement.rollout == "colocated":
        return "needs a rollout pool (placement.rollout): a colocated rollout has the weights"
    if cfg.rollout.max_staleness:
        return (
            f"needs rollout.max_staleness=0 (got {cfg.rollout.max_staleness}): the asynchronous "
            "rollout fetches each version when it starts a batch, which a broadcast cannot wait for"
        )
    return None


def spans_nodes(cfg: Config) -> str | None:
    """Why this run's pools are on more than one node by its own placement, or None: a pool of
    several nodes, or pools pinned to different custom resources (``placement.<role>.resources``).
    Whether unpinned pools share a node is Ray's choice at run time, unknown here."""
    if cfg.run.backend != "ray":
        return None
    pl = cfg.placement
    pools = {"actor": pl.actor}
    pools |= {r: getattr(pl, r) for r in ("rollout", "reference") if getattr(pl, r) != "colocated"}
    pools |= {r: getattr(pl, r) for r in ("critic", "reward_model", "teacher")
              if getattr(pl, r) is not None}  # fmt: skip
    for role, pool in pools.items():
        if pool.nodes > 1:
            return f"placement.{role}.nodes is {pool.nodes}"
    pinned = {role: pool.resources for role, pool in pools.items()}
    if len({tuple(sorted(r.items())) for r in pinned.values()}) > 1:
        return (
            "the pools are pinned to different resources ("
            + ", ".join(f"placement.{role}.resources={dict(r)}" for role, r in pinned.items())
            + ")"
        )
    return None


class Config(_Section):
    # Modules imported before validation, so that user code can register estimators, losses
    # and rewards (e.g. "my_pkg.algos") and the config can name them.
    imports: list[str] = Field(default_factory=list)
    # the run: name, output directory, seed, steps, checkpoints, loggers, backend
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig | None = None  # an LLM policy; absent when `diffusion` is set
    # where the prompts come from (files, a Hub dataset or a built-in task) and batch size
    data: DataConfig
    # how samples are generated: engine, sampling, multi-turn, agents, asynchrony
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    # held-out evaluation before, during and after training
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    # advantage estimation: the estimator, its scaling, presets, dynamic sampling
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    # the policy's optimizer and loss: learning rate, clipping, KL, micro-batching, LoRA
    actor: ActorConfig = Field(default_factory=ActorConfig)
    # the reward functions and their weights, failure values and timeouts
    reward: RewardConfig = Field(default_factory=RewardConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)

    critic: CriticConfig | None = None  # PPO's value model (needs algorithm.estimator=gae)
    reward_model: RewardModelConfig | None = None
    teacher: TeacherConfig | None = (
        None  # on-policy distillation (groupflow.algorithms.distillation)
    )

    diffusion: DiffusionConfig | None = None  # a flow-matching policy instead of an LLM

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        # algorithm.preset's keys go under the user's own, before any section is validated
        return expand_preset(data)

    @model_validator(mode="after")
    def _kind(self):
        # first: the kind's defaults fill the keys the user left unset before any check reads them
        apply_kind_defaults(self, kind_of(self))
        return self

    @property
    def kind(self) -> Kind:
        """The model kind this config trains (``groupflow.config.kinds``)."""
        return kind_of(self)

    @model_validator(mode="after")
    def _known_keys(self):
        # here, not on RunConfig: a key is checked against the whole schema
        for key in self.run.allow_config_changes:
            problem = unknown_key_problem(type(self), key.split("."))
            if problem:
                raise ValueError(f"run.allow_config_changes: '{key}' {problem}")
        return self

    @model_validator(mode="after")
    def _placement(self):
        pl, run = self.placement, self.run
        a = pl.actor
        if a.workers_per_node is None and run.num_workers % a.nodes:
            raise ValueError(
                f"run.num_workers={run.num_workers} does not split evenly over "
                f"placement.actor.nodes={a.nodes}"
            )
        per_node = a.workers_per_node or run.num_workers // a.nodes
        if a.nodes * per_node != run.num_workers:
            raise ValueError(
                f"placement.actor: {a.nodes} node(s) × {per_node} worker(s) per node does not "
                f"make run.num_workers={run.num_workers}"
            )
        if (
            pl.reference != "colocated"
            and self.actor.kl_coef == 0
            and self.algorithm.kl_in_reward is None
        ):
            raise ValueError(
                "placement.reference is a pool but no reference model is used (actor.kl_coef is 0 "
                "and algorithm.kl_in_reward is unset); set one or placement.reference=colocated"
            )
        for role in ("critic", "reward_model"):
            if getattr(pl, role) is not None and getattr(self, role) is None:
                raise ValueError(f"placement.{role} is set but the run has no '{role}' section")
        for role in ("rollout", "reference", "critic", "reward_model"):
            pool = getattr(pl, role)
            if (
                pool not in ("colocated", None)
                and run.backend == "local"
                and pool.nodes * (pool.workers_per_node or 1) > 1
            ):
                raise ValueError(
                    f"placement.{role}: the local backend runs one in-process worker per role; "
                    "use run.backend=ray for more"
                )
        return self

    @model_validator(mode="after")
    def _packing(self):
        keys = [k for k, on in (("actor.packing", self.actor.packing),
                                ("critic.packing", self.critic is not None and self.critic.packing))
                if on]  # fmt: skip
        if not keys:
            return self
        if self.parallel.sequence_parallel > 1:
            raise ValueError(
                f"{keys[0]} is not implemented with parallel.sequence_parallel="
                f"{self.parallel.sequence_parallel} (Ulysses attention masks padded rows); "
                f"set {keys[0]}: false or parallel.sequence_parallel: 1"
            )
        if _tiny_vlm(self):
            raise ValueError(
                f"{keys[0]} does not support vision-language models (model.tiny.vision is set): "
                "image rows take the padded forward"
            )
        return self

    @model_validator(mode="after")
    def _sequence_parallel(self):
        n = self.parallel.sequence_parallel
        if n == 1:
            return self
        if self.run.num_workers % n:
            raise ValueError(
                f"parallel.sequence_parallel={n} must divide run.num_workers="
                f"{self.run.num_workers} (the actor's workers form groups of {n})"
            )
        if _tiny_vlm(self):
            raise ValueError(
                f"parallel.sequence_parallel={n} does not support vision-language models yet "
                "(model.tiny.vision is set): use parallel.sequence_parallel: 1"
            )
        tiny = _tiny(self)
        if tiny is not None and tiny.num_heads % n:
            raise ValueError(
                f"parallel.sequence_parallel={n} must divide model.tiny.num_heads={tiny.num_heads} "
                "(each rank attends with 1/N of the heads)"
            )
        return self

    @model_validator(mode="after")
    def _weight_transport(self):
        if self.rollout.weight_transport == "ray" and self.run.backend != "ray":
            raise ValueError(
                f"rollout.weight_transport=ray needs run.backend=ray (got {self.run.backend!r}); "
                "use auto, driver or filesystem"
            )
        if self.rollout.weight_transport == "collective":
            why = collective_refusal(self)
            if why:
                raise ValueError(f"rollout.weight_transport=collective {why}; use auto or ray")
        apart = spans_nodes(self)
        if (
            apart
            and self.rollout.weight_transport == "filesystem"
            and self.rollout.weight_dir is None
        ):
            # the default <run dir>/weights is on the driver's disk, which other nodes need not see
            raise ValueError(
                f"rollout.weight_dir: the filesystem weight transport across nodes ({apart}) needs "
                "a directory every node sees (shared storage); set rollout.weight_dir to one, or "
                "use rollout.weight_transport=auto (Ray's object store crosses nodes)"
            )
        return self

    @model_validator(mode="after")
    def _async_rollout(self):
        if self.rollout.max_staleness == 0:
            if self.rollout.async_mode != "deterministic":
                raise ValueError(
                    f"rollout.async_mode={self.rollout.async_mode} needs rollout.max_staleness >= 1 "
                    "(with 0 every batch is generated with the current weights already)"
                )
            if self.rollout.async_worker == "thread":
                raise ValueError(
                    "rollout.async_worker=thread chooses where the asynchronous rollout side "
                    "runs, but rollout.max_staleness=0 runs none (it would do nothing): set "
                    "rollout.max_staleness >= 1 or drop rollout.async_worker"
                )
            return self
        k = self.rollout.max_staleness
        if self.rollout.engine == "vllm" and self.rollout.async_worker == "thread":
            raise ValueError(
                f"rollout.max_staleness={k} with rollout.engine=vllm needs "
                "rollout.async_worker=process: the snapshot's vLLM engine runs in a process of its "
                "own (vLLM's in-process engine keeps process-wide state; the actor has one already)"
            )
        return self

    @model_validator(mode="after")
    def _sft_demonstrations(self):
        # only the agent workflow plays demonstrations one episode each; elsewhere the setting
        # would be silently ignored (compared with the default: configs are re-validated from
        # full dumps, in which every field counts as set)
        default = type(self.sft).model_fields["demonstrations"].default
        if self.sft.demonstrations != default and self.rollout.workflow != "agent":
            raise ValueError(
                "sft.demonstrations bounds the demonstrations the agent workflow plays through "
                f"its agent; rollout.workflow={self.rollout.workflow!r} trains on every row's "
                "(remove it)"
            )
        return self

    @model_validator(mode="after")
    def _ppo(self):
        gae = self.algorithm.estimator == "gae"
        if gae and self.critic is None:
            raise ValueError("algorithm.estimator 'gae' needs a critic: add a 'critic' section")
        if not gae and self.critic is not None:
            raise ValueError(
                f"a 'critic' section is only used by algorithm.estimator 'gae' "
                f"(got '{self.algorithm.estimator}'); remove it or set the estimator to gae"
            )
        if gae and self.algorithm.dynamic_sampling:
            raise ValueError(
                "algorithm.dynamic_sampling filters groups for outcome estimators; not with 'gae'"
            )
        mb = self.critic.mini_batch_samples if self.critic else None
        samples = self.data.prompts_per_step * self.rollout.samples_per_prompt
        if mb is not None and samples % mb:
            raise ValueError(
                f"critic.mini_batch_samples={mb} must divide the samples per step ({samples})"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _required_sections(cls, data: Any) -> Any:
        # Checked before field validation so that an empty file names every missing section.
        if isinstance(data, dict) and data.get("model") is None and data.get("diffusion") is None:
            missing = ["one of 'model' (an LLM policy) or 'diffusion' (a flow-matching generator)"]
            if "data" not in data:
                missing.append("'data'")
            raise ValueError(f"missing required section(s): {' and '.join(missing)}")
        return data

    @model_validator(mode="after")
    def _kind_checks(self):
        # the kind's own checks, after the shared ones above (they may read what those checked)
        for check in self.kind.checks:
            check(self)
        if self.actor.cpu_offload and self.run.num_workers < 2:
            raise ValueError(
                "actor.cpu_offload applies through FSDP2, which shards over run.num_workers >= 2 "
                f"workers; run.num_workers={self.run.num_workers}"
            )
        return self

    @model_validator(mode="after")
    def _workflow(self):
        r = self.rollout
        name = r.workflow
        builtin = ("auto", "single_turn", "multi_turn", "diffusion", "agent")
        if name not in builtin and ":" not in name:
            raise ValueError(
                f"rollout.workflow={name!r}: use one of {', '.join(builtin)} or the import path of "
                "a workflow class ('package.module:Class')"
            )
        multi = r.max_turns > 1 or r.tools or r.environment is not None
        if multi and r.observation_template is None and self.data.use_chat_template is False:
            raise ValueError(
                "data.use_chat_template=false with a multi-turn rollout: observations are then "
                "appended as text, so set rollout.observation_template (e.g. '{content}\\n')"
            )
        if name == "single_turn" and multi:
            raise ValueError(
                "rollout.workflow=single_turn with rollout.max_turns > 1, tools or an environment: "
                "use multi_turn (or auto)"
            )
        # a custom workflow (an import path) may read them; the built-in ones only when multi-turn
        observations = multi or name == "multi_turn" or ":" in name
        for key in ("max_observation_tokens", "max_observation_chars"):
            if getattr(r, key) is not None and not observations:
                raise ValueError(
                    f"rollout.{key}={getattr(r, key)}: only a multi-turn rollout (rollout.tools "
                    "or rollout.environment) has observations, so here it would do nothing; "
                    f"drop rollout.{key}"
                )
        return self

    @model_validator(mode="after")
    def _engine(self):
        if self.rollout.engine != "vllm":
            return self
        clashes = []
        if self.actor.lora is not None:
            clashes.append("actor.lora (the engine is fed plain weights, not adapters)")
        local_pool = self.placement.rollout != "colocated" and self.run.backend != "ray"
        if local_pool and self.rollout.max_staleness:
            # the local pool's worker lives in the trainer's process beside the actor's engine
            # (kept for validation when the rollout is asynchronous): two in-process engines
            clashes.append(
                f"placement.rollout as its own pool on run.backend=local with "
                f"rollout.max_staleness={self.rollout.max_staleness} (the pool's in-process worker "
                "and the actor would each hold a vLLM engine in the trainer's process; use "
                "run.backend=ray, or placement.rollout=colocated)"
            )
        if clashes:
            raise ValueError(f"rollout.engine=vllm does not work with {'; '.join(clashes)}")
        return self

    @model_validator(mode="after")
    def _cross(self):
        samples = self.data.prompts_per_step * self.rollout.samples_per_prompt
        mb = self.actor.mini_batch_samples
        if mb is not None and samples % mb:
            raise ValueError(
                f"actor.mini_batch_samples={mb} must divide the samples per step "
                f"(data.prompts_per_step × rollout.samples_per_prompt = {samples})"
            )
        if self.rollout.engine == "vllm" and _tiny_vlm(self):
            raise ValueError(
                "rollout.engine=vllm: model.tiny.vision builds a vision-language model with no "
                "model directory, and vLLM's multimodal inputs need one (its processor files); "
                "use a VLM directory (model.path) or set rollout.engine=hf"
            )
        tiny = _tiny(self)
        if self.rollout.engine == "vllm" and tiny is not None:
            head_dim = tiny.hidden_size // tiny.num_heads
            if head_dim not in VLLM_HEAD_DIMS:
                raise ValueError(
                    f"rollout.engine=vllm: the tiny model's head dim (model.tiny.hidden_size / "
                    f"num_heads = {head_dim}) is not one vLLM's attention supports "
                    f"({', '.join(map(str, VLLM_HEAD_DIMS))}); e.g. hidden_size=128, num_heads=2"
                )
        a = self.actor
        if a.off_policy == "tis" and a.tis_cap is None:
            raise ValueError("actor.off_policy=tis needs actor.tis_cap (the weight's truncation)")
        if a.off_policy in ("none", "decoupled") and a.tis_cap is not None:
            raise ValueError(
                f"actor.tis_cap is set but actor.off_policy={a.off_policy}: unset tis_cap, or use "
                "off_policy auto or tis"
            )
        if a.off_policy == "decoupled" and a.recompute_old_logprobs == "never":
            raise ValueError(
                "actor.off_policy=decoupled needs the proximal log-probs recomputed; "
                "actor.recompute_old_logprobs=never forbids it (use auto or always)"
            )
        if self.actor.tis_cap is not None and self.actor.recompute_old_logprobs == "never":
            raise ValueError(
                "actor.tis_cap compares recomputed old log-probs with the rollout's; with "
                "actor.recompute_old_logprobs=never they are the same and every weight is 1 "
                "(use auto or always, or unset actor.tis_cap)"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)
