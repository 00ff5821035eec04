"""The diffusion policy: a flow-matching generator's actor group, as the trainer drives it.

Design decision: a flow-matching policy's actions are its SDE denoising steps, so the driver's
four calls mean here: ``prepare`` — old log-probs of the stored transitions (recomputed only when
a batch gets several optimizer steps); ``update`` — the PPO-clip update of the velocity model;
``sync`` — nothing when colocated (the worker samples with the weights it trains), or with a
rollout pool (``placement.rollout``) the weights of a new version sent from the actor's ranks to
the pool's workers through the weight transport, as the LLM policy does (the driver forwards a
ticket, never the weights); and its checkpoint state.
With a ``teacher`` (on-policy distillation, ``groupflow.diffusion.distillation``) the actor
workers also hold the frozen teacher, checked against the student at load (latent and
conditioning) and never checkpointed; the asynchronous rollout side and a rollout pool sample
without one. With ``rollout.max_staleness >= 1`` the asynchronous side samples with a flow model
of its own in a child process, or — on Ray with a rollout pool — runs in a Ray actor beside the
pool (``groupflow.rollout.ray_host``), whose workers sample with the scheduled versions. Such copies
never train, so a version carries everything sampling depends on, not only the flow weights: the
NFT/AWM "old" copy and the update count that places the SDE window
(``DiffusionWorker._sampling_extras``) — they derive nothing from a scheduler of their own.
Rollout, rewards and the online test are the diffusion *workflow*'s
(``groupflow.workflows.diffusion``); advantages are the shared credit stage's.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from groupflow.assembly.engines import build_weight_transport
from groupflow.assembly.groups import role_group, snapshot_group
from groupflow.batch import Batch
from groupflow.config import Config, DiffusionConfig, DiffusionModelConfig, TeacherConfig, present
from groupflow.contracts import DIFFUSION_CONTRACTS, validate
from groupflow.data import DataError, PromptRow
from groupflow.diffusion.encoder_checks import check_text_encoder_folders
from groupflow.diffusion.kinds import default_shift
from groupflow.diffusion.models import (
    check_teacher_model,
    load_diffusers_model,
    load_tiny_model,
    transformer_config,
    transformer_dir,
)
from groupflow.diffusion.pretrain import pretrain_tiny_model
from groupflow.diffusion.text_encoders import load_text_encoder
from groupflow.diffusion.vaes import check_vae_folder, load_vae_decoder
from groupflow.diffusion.worker import COND_PREFIX, DiffusionSettings, DiffusionWorker
from groupflow.distributed.transport import DriverTransport
from groupflow.policies.base import Moved, RolloutView, published, transfer_weights
from groupflow.utils.timing import StageTimer

log = logging.getLogger("groupflow")

__all__ = [
    "DiffusionPolicy",
    "frozen_view",
    "FlowModelSpec",
    "parts_of",
    "settings_from_config",
    "ensure_tiny_model",
]

_MODEL_KEYS = (
    "latents", "next_latents", "sigmas", "sigmas_next", "response_mask", "advantages", "old_logprobs",
    "old_means", "clean_latents", "sample_seeds",
)  # fmt: skip


class FlowModelSpec:
    """How a worker builds its flow model inside its own process (picklable for Ray)."""

    def __init__(
        self, kind: str, path: str, latent_shape: list[int] | None = None, parts: dict | None = None
    ):
        # a diffusers pipeline's folder means its transformer/: what the loaders and the sharded
        # weight reader (``weights=spec.path``) read
        self.path = path if kind == "tiny" else str(transformer_dir(path))
        self.kind, self.latent_shape = kind, latent_shape
        self.parts = parts or {}  # diffusion.model's text encoder / tokenizer / VAE keys

    def build(self, empty: bool = False, device: str = "cpu"):
        """``empty``: a diffusers transformer with meta parameters (for sharded loading);
        ``device``: where the text encoder and VAE run (the worker's: they are no parameters of
        the flow model, so moving it moves neither)."""
        if self.kind == "tiny":
            return load_tiny_model(self.path)
        encoder = decoder = None
        if self.parts.get("text_encoder_path"):
            check_text_encoder_folders(self.kind, self.parts, self.path)  # before any weights
            width = None
            if self.kind == "sd3":  # without T5, zeros as wide as the transformer's text input
                width = transformer_config(self.path).get("joint_attention_dim")
            encoder = load_text_encoder(self.kind, self.parts, str(device), width=width)
        if self.parts.get("vae_path"):
            decoder = load_vae_decoder(self.kind, self.parts["vae_path"], str(device))
        shape = present(self.latent_shape, "diffusion.model.latent_shape")
        return load_diffusers_model(
            self.path, self.kind, shape, encoder, decoder, empty=empty,
            guidance=self.parts.get("guidance", 3.5),
        )  # fmt: skip


def parts_of(m: DiffusionModelConfig) -> dict:
    """The pipeline parts a worker's :class:`FlowModelSpec` builds beside the transformer: the
    text encoders, tokenizers and VAE keys of ``diffusion.model``, its token budget and guidance."""
    return m.model_dump(include={
        "text_encoder_path", "tokenizer_path", "text_encoder_2_path", "tokenizer_2_path",
        "text_encoder_3_path", "max_sequence_length", "vae_path", "guidance",
    })  # fmt: skip


def resolve_shift(d: DiffusionConfig) -> float:
    """``diffusion.shift``, or when unset the kind's pipeline's (``kinds.default_shift``): 3.0, or
    for FLUX.1, Qwen-Image and FLUX.2 their image-size-dependent e^μ."""
    if d.shift is not None:
        return d.shift
    if d.model.kind == "tiny":
        return 3.0
    shape = present(d.model.latent_shape, "diffusion.model.latent_shape")
    return default_shift(d.model.kind, shape, d.num_steps)


def settings_from_config(
    d: DiffusionConfig, adv_clip_max: float | None = 5.0, teacher: TeacherConfig | None = None
) -> DiffusionSettings:
    distill = {"coef": teacher.coef, "reward_weight": teacher.reward_weight} if teacher else None
    return DiffusionSettings(
        sampler=d.sampler, noise_level=d.noise_level, num_steps=d.num_steps,
        shift=resolve_shift(d),
        cfg_scale=d.cfg_scale, same_noise_per_group=d.same_noise_per_group,
        timestep_selection=d.timestep_selection, timestep_fraction=d.timestep_fraction,
        window=d.window, lora=d.model.lora.model_dump() if d.model.lora else None,
        sde_window=d.sde_window.model_dump() if d.sde_window else None, ratio_norm=d.ratio_norm,
        objective=d.objective, nft=d.nft.model_dump(), flow_dppo=d.flow_dppo.model_dump(),
        awm=d.awm.model_dump(), adv_clip_max=adv_clip_max or 5.0,
        fsdp=d.fsdp, activation_checkpointing=d.activation_checkpointing, bf16=d.bf16,
        cpu_offload=d.cpu_offload, distill=distill,
    )  # fmt: skip


def ensure_tiny_model(d: DiffusionConfig, seed: int) -> dict[str, float]:
    """Pre-train the tiny base model (labels: the synthetic colours) into ``d.model.path`` when
    asked and missing; later runs reuse it."""
    m = d.model
    path = Path(m.path).expanduser()
    if m.kind != "tiny" or (path / "config.json").is_file():
        return {}
    if not m.pretrain_if_missing:
        raise FileNotFoundError(
            f"diffusion.model.path '{path}' holds no tiny model; create it with "
            f"`groupflow pretrain-diffusion --out {path}` or set diffusion.model.pretrain_if_missing=true"
        )
    log.info("pre-training the tiny flow model into %s (%d steps)", path, m.pretrain_steps)
    _, stats = pretrain_tiny_model(path, steps=m.pretrain_steps, seed=seed)
    return stats


def check_labels(path: Path, rows: list[PromptRow]) -> None:
    """A tiny model knows only the colour names it was pre-trained on."""
    import json

    labels = json.loads((path / "config.json").read_text()).get("labels", [])
    for r in rows:
        if isinstance(r.prompt, str) and r.prompt not in labels:
            raise DataError(
                f"prompt {r.prompt!r} is not a label of the tiny diffusion model at {path}; "
                f"valid prompts: {labels}",
                source=r.source, index=r.index, field="prompt",
            )  # fmt: skip


class DiffusionPolicy:
    """The flow model's actor group (data-parallel: replicated, or FSDP2-sharded with
    ``diffusion.fsdp``) and its training calls."""

    contracts = DIFFUSION_CONTRACTS
    reward_model = None  # the diffusion rewards are functions of the images (diffusion.rewards)

    def __init__(self, cfg: Config, run_dir: Path, corpus: list[PromptRow]):
        self.cfg = cfg
        d = present(cfg.diffusion, "diffusion")
        self.pretrain_stats = ensure_tiny_model(d, cfg.run.seed)
        if d.model.kind == "tiny":
            check_labels(Path(d.model.path), corpus)
        parts = parts_of(d.model)
        spec = FlowModelSpec(d.model.kind, d.model.path, d.model.latent_shape, parts)
        settings = settings_from_config(d, cfg.algorithm.adv_clip_max, cfg.teacher)
        # a VAE or text encoder of another class or width fails here, not in every worker
        if d.model.vae_path:
            check_vae_folder(d.model.kind, d.model.vae_path)
        check_text_encoder_folders(d.model.kind, parts, spec.path)
        teacher_spec = None
        if cfg.teacher is not None:  # same kind and text encoder: one conditioning contract
            check_teacher_model(cfg.teacher.path, d.model.path, d.model.kind)
            # the teacher scores the student's states under the student's conditions: its own
            # text encoders and VAE would be loaded (onto the device) and never called
            teacher_spec = FlowModelSpec(
                d.model.kind, cfg.teacher.path, d.model.latent_shape, {"guidance": d.model.guidance}
            )
        # the asynchronous rollout side samples with the student alone: no teacher, no distill
        self._worker_kwargs = dict(spec=spec, cfg=cfg.actor, total_steps=cfg.run.total_steps,
                                   settings=replace(settings, distill=None))  # fmt: skip
        self.actor = role_group(
            cfg, "actor", DiffusionWorker, **{**self._worker_kwargs, "settings": settings},
            pg_timeout_s=cfg.run.worker_timeout_s, sequence_parallel=cfg.parallel.sequence_parallel,
            teacher_spec=teacher_spec,
        )  # fmt: skip
        self.rollout = self.rollout_pool = self.actor
        # How new weights reach a rollout pool (rollout.weight_transport): from the actor's ranks
        self.transport = build_weight_transport(cfg, run_dir)
        self._version_bytes = 0  # a version's size, as the last transfer's receivers got it
        if cfg.placement.rollout != "colocated":
            self.rollout = self.rollout_pool = role_group(
                cfg, "rollout", DiffusionWorker, **self._worker_kwargs, role="rollout",
                role_name="rollout",  # errors name the role: the class serves two
            )  # fmt: skip
            self.transport.open(self.actor.world_size, self.rollout.world_size)

    def prepare(self, batch: Batch, timer: StageTimer | None = None) -> tuple[Batch, dict]:
        """Old log-probs: recomputed when a batch gets several optimizer steps, else the rollout's;
        (batch, metrics: none)."""
        timer = timer or StageTimer()
        a = self.cfg.actor
        several = a.ppo_epochs > 1 or (a.mini_batch_samples or len(batch)) < len(batch)
        d = present(self.cfg.diffusion, "diffusion")
        with timer("old_logprobs"):
            if d.objective in ("nft", "awm"):
                # re-noised final latents: the old policy is the worker's "old" copy, evaluated
                # at the same noise in the update, not stored log-probs
                batch["old_logprobs"] = batch["rollout_logprobs"]
            elif (
                a.recompute_old_logprobs == "always"
                or (a.recompute_old_logprobs == "auto" and several)
                # GRPO-Guard and Flow-DPPO need the old step means too
                or ((d.ratio_norm or d.objective == "flow_dppo") and several)
            ):
                old = self.actor.compute_logprobs(model_inputs(batch))
                batch["old_logprobs"] = old["logprobs"]
                if "old_means" in old:
                    batch["old_means"] = old["old_means"]
            else:
                # One optimizer step per batch: the rollout's log-probs come from the same step
                # function computed the same way (step by step), so the first ratio is exactly 1.
                batch["old_logprobs"] = batch["rollout_logprobs"]
        return batch, {}

    def update(self, batch: Batch, *, step: int, seed: int) -> dict[str, float]:
        batch = validate(batch, DIFFUSION_CONTRACTS["train_ready"])
        return self.actor.update(model_inputs(batch), shuffle_seed=seed)

    @property
    def async_on_pool(self) -> bool:
        """Whether the asynchronous rollout samples on this policy's Ray rollout pool (fed
        versions through the weight transport) rather than with a flow model of its own in a
        child process of the driver."""
        return self.cfg.run.backend == "ray" and self.rollout_pool is not self.actor

    def publish(self, version: int):
        """Send the current weights as ``version``: with a rollout pool through the weight
        transport (the ticket: references, not weights), else as a ``driver`` ticket (they pass
        through the driver, into the child process's ring)."""
        if self.rollout_pool is not self.actor:
            return self.actor.send_weights(version, self.transport)
        return DriverTransport().send(version, self.actor.full_weights())

    def sync(self, version: int = -1) -> Moved:
        """Colocated, the worker samples with the weights it trains: nothing to push (0 bytes).
        With a rollout pool the actor's ranks send the weights to the pool's workers; returns
        what that moved."""
        if self.rollout is self.actor:
            return Moved()
        moved = transfer_weights(self.actor, self.rollout, self.rollout.receive_weights, version,
                                 self.transport)  # fmt: skip
        self._version_bytes = max(self._version_bytes, moved.version_bytes)
        return moved

    def moved_by(self, ticket) -> Moved:
        """What a published ticket moves once the pool's workers fetch it (``published``)."""
        return published(ticket, self.actor, self.rollout_pool, self._version_bytes)

    def begin(self, warm_started: bool) -> None:
        """No reference or critic to initialise, no warm start: the pool already holds the
        weights ``fit``'s ``sync`` gave it."""

    def start_async(self) -> partial:
        """How the asynchronous rollout side builds its ``RolloutView`` (picklable): a second flow
        model that samples with the scheduled (older) weights (``frozen_view``), or with a Ray
        rollout pool (``async_on_pool``) a view over that pool. From now on validation here samples with the actor's current weights."""
        pool = self.rollout_pool
        self.rollout = self.actor
        if self.async_on_pool:
            view = RolloutView(DIFFUSION_CONTRACTS, pool, transport=self.transport, owns=False)
            return partial(_identity, view)
        return partial(frozen_view, self.cfg, self._worker_kwargs)

    def snapshot(self, copy: bool = True) -> dict[str, Any]:
        """The current version as the asynchronous side samples with it: the flow weights
        (``copy=False``: possibly the live tensors) and, where sampling depends on more of the
        actor's state, that too — the NFT/AWM "old" copy, the update count that places the SDE
        window (``DiffusionWorker.sampling_weights``): the side's copy never trains, so it
        derives nothing itself."""
        return self.actor.sampling_weights(copy=copy)

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(state, writers): sharded, every rank writes its DCP shards (``shards``) and the
        checkpoint keeps only the small train state; replicated, the full state by name."""
        if present(self.cfg.diffusion, "diffusion").fsdp and self.cfg.run.num_workers > 1:
            writers = {"shards": lambda path: self.actor.save_sharded(str(path))}
            return {"actor_state": self.actor.train_state()}, writers
        return dict(self.actor.state_dict()), {}

    def load(self, state: dict[str, Any], path: Path) -> None:
        """Shards (written by any number of ranks) or a full state, into this many workers."""
        if "shards" in state:
            self.actor.load_sharded(str(state["shards"]), state["actor_state"])
        else:
            self.actor.load_state_dict(state)

    def shutdown(self) -> None:
        for group in dict.fromkeys((self.actor, self.rollout_pool)):
            group.shutdown()
        self.transport.close()  # e.g. the collective transport's rendezvous store


def frozen_view(cfg: Config, worker_kwargs: dict) -> RolloutView:
    """The rollout side's view with a flow model of its own (built in the side's process: this
    is the picklable recipe's callable) that samples with the weights of a scheduled version."""
    return RolloutView(DIFFUSION_CONTRACTS,
                       snapshot_group(cfg, DiffusionWorker, **worker_kwargs))  # fmt: skip


def _identity(x):
    return x


def model_inputs(batch: Batch) -> Batch:
    """Only the tensors the workers need: images, texts and dataset rows stay on the driver."""
    keys = [k for k in batch.tensors if k in _MODEL_KEYS or k.startswith(COND_PREFIX)]
    return batch.select(*keys, meta=False)
