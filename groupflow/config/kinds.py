"""Model kinds as plug-ins of the run config: an LLM (or vision-language) policy, or a
flow-matching generator.

Design decision: ``Config`` knows a kind only through a :class:`Kind` value: the section that
selects it (``model`` or ``diffusion``; a config has exactly one), the defaults it gives keys of
*other* sections that the user left unset (declared as data, applied once before any check reads
them, so no validator rewrites a section by hand), and its checks: functions of the whole config
that raise a ValueError naming the key, and what the rest of the run asks of a kind (the workflow
``auto`` means, whether it writes text, where a teacher lives), so the driver, the assembly and
the CLI read ``cfg.kind`` instead of testing which section is set. The root config's own checks are the ones every kind
shares; what one kind refuses or requires is here, in one list per kind, so adding a kind is one
``Kind`` and one line in ``KINDS``. A check receives the validated ``Config`` (typed loosely:
this module sits below ``groupflow.config.root``, which imports it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["KINDS", "Kind", "apply_kind_defaults", "kind_of"]

Check = Callable[[Any], None]

# diffusion.model.kind values whose transformer runs Ulysses sequence parallel
# (groupflow.diffusion.sequence_parallel); the others are refused at load
SEQUENCE_PARALLEL_KINDS = ("wan", "sd3", "flux", "flux2", "qwen_image", "z_image")


@dataclass(frozen=True)
class Kind:
    name: str
    section: str  # the config key whose presence selects the kind
    # "section.key" -> value for keys of other sections the kind needs another default for
    defaults: Mapping[str, Any]
    checks: tuple[Check, ...]
    # rollout.workflow=auto resolves to this function's answer
    auto_workflow: Callable[[Any], str]
    # the policy writes text: named benchmarks and the generate / eval / serve commands apply
    writes_text: bool
    # a configured teacher is a loss term inside the actor worker (no pool, no per-token credit)
    teacher_in_actor: bool


def apply_kind_defaults(cfg: Any, kind: Kind) -> None:
    """Set ``kind.defaults`` on ``cfg`` where the user's config left the key unset."""
    for dotted, value in kind.defaults.items():
        section, key = dotted.split(".")
        owner = getattr(cfg, section)
        if key not in owner.model_fields_set:
            setattr(owner, key, value)


def kind_of(cfg: Any) -> Kind:
    """The kind whose section ``cfg`` sets; exactly one must be set (a ValueError otherwise)."""
    chosen = [k for k in KINDS.values() if getattr(cfg, k.section) is not None]
    if len(chosen) != 1:
        raise ValueError(
            "set exactly one of 'model' (an LLM policy) or 'diffusion' (a flow-matching generator)"
        )
    return chosen[0]


# ----- the LLM kind (model:) ------------------------------------------------------------------


def _llm_teacher(cfg) -> None:
    if cfg.teacher is not None and cfg.algorithm.estimator == "gae":
        raise ValueError(
            "teacher (on-policy distillation) gives LLM policies per-token advantages on top "
            "of an outcome estimator; it does not combine with algorithm.estimator=gae"
        )


def _llm_async_on_ray(cfg) -> None:
    k = cfg.rollout.max_staleness
    if k and cfg.run.backend == "ray" and cfg.placement.rollout == "colocated":
        raise ValueError(
            f"rollout.max_staleness={k} with run.backend=ray needs a rollout pool of its own "
            "(placement.rollout: {nodes: 1, ...}): a colocated rollout has no weights but the "
            "actor's current ones"
        )


def _llm_workflow(cfg) -> None:
    if cfg.rollout.workflow == "diffusion":
        raise ValueError("rollout.workflow=diffusion needs a 'diffusion' section")


def _llm_auto_workflow(cfg) -> str:
    r = cfg.rollout
    return "multi_turn" if (r.max_turns > 1 or r.tools or r.environment) else "single_turn"


LLM = Kind(
    "llm",
    "model",
    {},
    (_llm_teacher, _llm_async_on_ray, _llm_workflow),
    auto_workflow=_llm_auto_workflow,
    writes_text=True,
    teacher_in_actor=False,
)


# ----- the diffusion kind (diffusion:) --------------------------------------------------------


def _diffusion_llm_only(cfg) -> None:
    keys = [k for k in ("critic", "reward_model") if getattr(cfg, k) is not None]
    # the diffusion KL is exact per step (algorithms.md §7), not a sampled estimate
    keys += ["actor.kl_bias_correction"] if cfg.actor.kl_bias_correction else []
    # the diffusion worker offloads through diffusion.cpu_offload
    keys += ["actor.cpu_offload"] if cfg.actor.cpu_offload else []
    keys += ["placement.reference"] if cfg.placement.reference != "colocated" else []
    if keys:
        raise ValueError(f"{', '.join(keys)}: for LLM policies only, not with a 'diffusion' policy")
    if cfg.sft.steps:
        raise ValueError(
            "sft.steps (the supervised warm start) is for LLM policies; set it to 0 with diffusion"
        )
    if cfg.actor.packing:
        raise ValueError("actor.packing packs token sequences: it is for LLM policies only")
    if cfg.actor.off_policy in ("tis", "decoupled"):
        raise ValueError(
            f"actor.off_policy={cfg.actor.off_policy} is implemented for LLM policies only; "
            "a diffusion policy trains its stale batches with the rollout's log-probs (none)"
        )
    if cfg.algorithm.preset is not None:
        raise ValueError(
            f"algorithm.preset={cfg.algorithm.preset!r} sets LLM loss keys (clip ranges, "
            "aggregation) that do not suit diffusion.objective; set the keys themselves"
        )
    if cfg.rollout.engine == "vllm":
        raise ValueError("rollout.engine=vllm does not work with a 'diffusion' policy")
    if cfg.rollout.async_mode == "in_flight":
        raise ValueError(
            "rollout.async_mode=in_flight switches weights between an LLM's decode steps; a "
            "'diffusion' policy's samples take new weights between batches "
            "(rollout.async_mode=eager)"
        )


def _diffusion_workflow(cfg) -> None:
    r = cfg.rollout
    multi = r.max_turns > 1 or r.tools or r.environment is not None
    if multi or r.workflow in ("single_turn", "multi_turn"):
        raise ValueError(
            "rollout.max_turns / tools / environment and the single- and multi-turn workflows "
            "are for LLM policies, not with a 'diffusion' policy"
        )
    if r.workflow == "agent":
        raise ValueError("rollout.workflow=agent trains an LLM policy, not a 'diffusion' one")


def _diffusion_objective(cfg) -> None:
    d = cfg.diffusion
    if d.objective == "nft" and cfg.algorithm.adv_clip_max is None:
        raise ValueError(
            "diffusion.objective=nft maps advantages to [0, 1] through algorithm.adv_clip_max; "
            "set it (default 5)"
        )
    if d.ratio_norm and cfg.actor.loss_fn != "ppo_clip":
        raise ValueError(
            f"diffusion.ratio_norm (GRPO-Guard) is defined on the PPO clip loss; "
            f"actor.loss_fn={cfg.actor.loss_fn!r}"
        )


def _diffusion_parallel(cfg) -> None:
    d = cfg.diffusion
    for key in ("bf16", "cpu_offload"):
        if getattr(d, key) and cfg.run.num_workers < 2:
            raise ValueError(
                f"diffusion.{key} applies through FSDP2, which shards over "
                f"run.num_workers >= 2 workers; run.num_workers={cfg.run.num_workers}"
            )
    sp = cfg.parallel.sequence_parallel
    if sp > 1 and d.model.kind not in SEQUENCE_PARALLEL_KINDS:
        raise ValueError(
            f"parallel.sequence_parallel is implemented for LLM policies and the diffusers "
            f"transformers (diffusion.model.kind {' / '.join(SEQUENCE_PARALLEL_KINDS)}), not "
            f"diffusion.model.kind {d.model.kind!r}"
        )
    # a rollout pool holds a replicated flow model that samples with each version it receives
    # (the NFT/AWM "old" copy and the SDE window's update count travel with the weights)
    if sp > 1 and cfg.placement.rollout != "colocated":
        raise ValueError(
            "parallel.sequence_parallel: not with a diffusion rollout pool (placement.rollout): "
            "its workers hold a replicated flow model, not Ulysses groups; use "
            "placement.rollout=colocated"
        )


def _diffusion_teacher(cfg) -> None:
    """A diffusion teacher (groupflow.diffusion.distillation) scores the student's SDE step means
    inside the actor worker: one local model directory, the student's kind, sampler and noise
    level; it needs the step means of objective grpo or flow_dppo."""
    t, d = cfg.teacher, cfg.diffusion
    if t is None:
        return
    if d.objective not in ("grpo", "flow_dppo"):
        raise ValueError(
            f"teacher with diffusion.objective={d.objective!r}: diffusion distillation compares "
            "the SDE step means of the student and the teacher; use objective grpo or flow_dppo"
        )
    if t.coef == 0 and t.reward_weight == 0:
        raise ValueError("teacher.coef and teacher.reward_weight are both 0: no loss term left")
    defaults = {"revision": None, "trust_remote_code": False, "dtype": "float32"}
    unsupported = [f"teacher.{k}" for k, v in defaults.items() if getattr(t, k) != v]
    unsupported += ["placement.teacher"] if cfg.placement.teacher is not None else []
    unsupported += ["diffusion.fsdp"] if d.fsdp else []
    unsupported += ["parallel.sequence_parallel"] if cfg.parallel.sequence_parallel > 1 else []
    if unsupported:
        raise ValueError(
            f"{', '.join(unsupported)}: not with a diffusion teacher (a local model directory "
            "of the student's kind, held replicated in each actor worker, in the student's dtype)"
        )


DIFFUSION = Kind(
    "diffusion",
    "diffusion",
    # log-probs are per-element means: ratios are geometric means over thousands of latent
    # elements, so the clip range is tiny, and advantages are clipped (algorithms.md §7)
    {"actor.clip_eps_low": 1e-4, "algorithm.adv_clip_max": 5.0},
    (
        _diffusion_llm_only,
        _diffusion_workflow,
        _diffusion_objective,
        _diffusion_parallel,
        _diffusion_teacher,
    ),
    auto_workflow=lambda cfg: "diffusion",
    writes_text=False,
    teacher_in_actor=True,  # groupflow.diffusion.distillation
)

KINDS: dict[str, Kind] = {k.name: k for k in (LLM, DIFFUSION)}
