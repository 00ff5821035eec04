"""The diffusion worker: rollout with per-step log-probs, log-prob recomputation, and the GRPO update.

Design decision: the same shape as the LLM actor worker — one colocated object holding policy,
optional reference, optimizer and LR schedule, exposed to the driver through the dispatch
decorators (``dp`` for Batch-in/Batch-out methods, ``rank0`` for state), so it runs under
``backend=local`` and ``backend=ray`` through an unchanged WorkerGroup. The *actions* of a
flow-matching policy are its denoising steps: a rollout stores, per sample, every step's latent,
next latent, sigma pair and log-prob, and a ``response_mask`` [B, N] marking the steps that will
be trained (``timestep_fraction`` of them at random per sample, or a window). Everything after
that — advantages, ``policy_loss`` (PPO clip, here with a 1e-4 range), ``aggregate`` with
mini-batch-global denominators, gradient clipping, warm-up + cosine LR — is the LLM code.

The objectives' per-step terms are ``diffusion.terms``'s (the worker hands it its ``_velocity``).
The Flow-GRPO KL compares the policy's step mean with the reference's (a frozen copy, or — with
LoRA — the same network with its adapters disabled). With several ranks the model is either
replicated, its gradients summed by an all-reduce (the losses already use global denominators),
or — ``fsdp`` — sharded with FSDP2 like the LLM actor's (``diffusion.sharding``), the loss scaled
by the world size since FSDP averages. What the worker holds — LoRA adapters, the reference and
old copies, FSDP2 shards (of a transformer built on the meta device, each rank reading only its
rows), CPU offload — is built in ``diffusion.build``; its checkpoints are ``workers.state``'s.

The 2025 variants are switches on the same worker: ``sde_window`` (MixGRPO) samples with the SDE
only inside a window that slides with the update count (the scheduler's step, so it resumes
exactly) and trains exactly those steps; ``ratio_norm`` (GRPO-Guard), ``flow_dppo``, ``nft``
(DiffusionNFT: it samples with an EMA "old" copy) and ``awm`` (the old copy is the weights before
the update) are ``diffusion.terms``'s. The old copy and the update count are part of what a
version *is* for sampling: a copy that only samples (a rollout pool's worker, the asynchronous
side's) receives them with the flow weights (``_sampling_extras``; ``send_weights`` /
``receive_weights``, ``sampling_weights`` / ``load_weights``) and derives neither from its own,
never-stepped scheduler.

On-policy distillation (``teacher``; ``diffusion.distillation``): a frozen teacher flow model,
built beside the policy in each worker (never in an optimizer or a checkpoint), predicts the
velocity on the stored states of the trained steps with no grad; its step mean against the
policy's gives the exact step KL, added to the loss with ``teacher.coef`` (the policy-gradient
term weighted by ``teacher.reward_weight``). It is recomputed with each update's forward, as the
reference's is: the states are stored and the teacher frozen, so every epoch sees the same means.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from groupflow.algorithms import aggregate
from groupflow.batch import Batch
from groupflow.config import ActorConfig
from groupflow.diffusion import objectives as obj
from groupflow.diffusion.build import build_worker_models, meta_init
from groupflow.diffusion.distillation import distillation_loss
from groupflow.diffusion.models import FlowModel, check_latents
from groupflow.diffusion.samplers import (
    get_sampler,
    guided_velocity,
    sample_trajectory,
    sde_step_mask,
)
from groupflow.diffusion.schedule import sigma_schedule
from groupflow.diffusion.sequence_parallel import enable_ulysses
from groupflow.diffusion.settings import (
    COND_PREFIX,
    DiffusionSettings,
    combine_metrics,
    initial_noise,
    prompt_rows,
    seeded_generator,
    select_steps,
    training_steps,
)
from groupflow.diffusion.sharding import memory_stats, peak_rss_bytes
from groupflow.diffusion.terms import ObjectiveTerms
from groupflow.distributed import PAD_KEY, register
from groupflow.distributed.parallel import (
    all_reduce,
    clip_grad_norm,
    full_model_state,
    full_state,
    init_process_group,
    load_full_state,
    load_full_weights,
    release_gathered,
    sum_grads,
)
from groupflow.distributed.transport import receive_into, tensors_nbytes
from groupflow.distributed.ulysses import gather_rows, sequence_groups
from groupflow.workers.common import (
    NonFiniteGuard,
    loss_options,
    optimizer_and_schedule,
    worker_device,
)
from groupflow.workers.state import CheckpointMethods, TrainedState
from groupflow.workers.update import accumulate, global_denominators, reduce_stats

__all__ = [
    "DiffusionSettings", "DiffusionWorker", "select_steps", "COND_PREFIX", "prompt_rows",
    "OLD_PREFIX", "UPDATES_KEY",
]  # fmt: skip

if TYPE_CHECKING:  # the flow model as an nn.Module with FlowModel's interface, for the checker

    class _FlowModule(nn.Module, FlowModel): ...


# A version's sampling state beside the flow weights (``sampling_weights``): the "old" copy
# DiffusionNFT / AWM sample with, and the update count that places MixGRPO's SDE window.
OLD_PREFIX = "sampling_old."
UPDATES_KEY = "sampling.updates"


class DiffusionWorker(CheckpointMethods):
    """Flow-matching policy + optional reference + AdamW + LR schedule + SDE rollout."""

    def __init__(
        self,
        model: nn.Module,
        settings: DiffusionSettings,
        cfg: ActorConfig,
        *,
        total_steps: int,
        rank: int = 0,
        world_size: int = 1,
        weights: str | None = None,
        sequence_parallel: int = 1,
        teacher: nn.Module | None = None,
        role: str = "actor",
    ):
        """``role``: ``"rollout"`` for a worker of a rollout pool (``placement.rollout``), which
        only samples with the weights it receives (``receive_weights``).
        ``weights``: ``model`` was built with meta parameters (``empty_parameters``); after
        sharding, each rank reads its shards from this diffusers directory.
        ``sequence_parallel``: Ulysses groups of that many ranks over the transformer's
        latent tokens (``enable_ulysses``: Wan, SD3, FLUX.1, FLUX.2, Qwen-Image); a group pools its rows (``gather_rows``) for every call, so each sample
        is held by that many ranks (sums over ranks are divided by it).
        ``teacher``: the frozen distillation teacher (with ``settings.distill``)."""
        self.rank, self.world_size, self.role = rank, world_size, role
        self.generated_samples = 0  # SDE samples this worker drew (placement checks)
        # a frozen copy (the asynchronous side) never steps its scheduler: it is given the
        # update count of the version it samples with (``load_weights``)
        self.received_updates: int | None = None
        self.sp = sequence_groups(rank, world_size, sequence_parallel)
        self.sp_size = sequence_parallel
        self.dp_size, self.dp_rank = world_size // sequence_parallel, rank // sequence_parallel
        if self.sp is not None:  # before the copies (reference, NFT old): they run it alike
            enable_ulysses(getattr(model, "transformer", model), self.sp)
        self.settings, self.cfg = settings, cfg
        self.device = worker_device(rank) if weights else next(model.parameters()).device
        self.meta_built = weights is not None
        self.flow = cast("_FlowModule", model)  # FlowModel: encode, null_cond, decode, latent_shape
        held = build_worker_models(
            model, settings, kl_coef=cfg.kl_coef, device=self.device, weights=weights
        )
        self.peft, self.ref_model, self.old_model = held.peft, held.ref, held.old
        self.sharded = held.sharded
        self.teacher = self._frozen_teacher(teacher)
        self.sigmas = sigma_schedule(settings.num_steps, settings.shift)
        self.spec = get_sampler(settings.sampler)
        self.noise_level = (
            self.spec.default_noise_level if settings.noise_level is None else settings.noise_level
        )
        self.optimizer, self.scheduler = optimizer_and_schedule(
            model, cfg, total_steps, cfg.warmup_steps
        )
        self.loss_options = loss_options(cfg)
        self.terms = ObjectiveTerms(
            self._velocity, self.spec, settings, cfg, noise_level=self.noise_level,
            device=self.device, loss_options=self.loss_options,
            distill=self.teacher is not None, placeholder=self.sharded,
        )  # fmt: skip
        self.nonfinite = NonFiniteGuard(
            cfg.max_nonfinite_steps, "diffusion updates",
            "lower actor.lr or raise actor.max_nonfinite_steps",
        )  # fmt: skip
        # the checkpoint's shards hold DiffusionNFT's / AWM's old copy beside the flow model
        extra = {"nft_old": self.old_model} if self.old_model is not None else {}
        self.trained = TrainedState(
            self.flow, self.optimizer, self.scheduler, self.nonfinite, extra=extra
        )
        self.load_peak_rss = peak_rss_bytes()  # the high-water mark of building and loading
        # where the update count travels in a weight transfer (sde_window; see _sampling_state)
        self._updates_buffer = torch.zeros((), dtype=torch.long, device=self.device)

    def _frozen_teacher(self, teacher: nn.Module | None) -> nn.Module | None:
        if (teacher is None) != (self.settings.distill is None):
            raise ValueError("DiffusionWorker: a teacher model and settings.distill go together")
        if teacher is None:
            return None
        if tuple(shape := cast(FlowModel, teacher).latent_shape) != tuple(self.flow.latent_shape):
            raise ValueError(
                f"teacher.path: the teacher's latent shape {list(shape)} differs "
                f"from the student's {list(self.flow.latent_shape)}"
            )
        return teacher.to(self.device).eval().requires_grad_(False)

    @classmethod
    def create(
        cls,
        rank: int,
        world_size: int,
        *,
        spec,
        settings: DiffusionSettings,
        cfg: ActorConfig,
        total_steps: int,
        pg_timeout_s: float = 600.0,
        sequence_parallel: int = 1,
        teacher_spec=None,
        role: str = "actor",
    ):
        """Factory used by WorkerGroup: join the process group, then build the model (and the
        distillation teacher from ``teacher_spec``) in this process. ``role="rollout"``: a
        rollout pool's worker — replicated, no process group (its workers never talk to each
        other), no reference copy, no teacher: it samples, and receives each version's weights
        from the actor's ranks through the weight transport."""
        device = worker_device(rank)  # the text encoder's and VAE's too: no flow parameters
        if role == "rollout":
            model = spec.build(device=device).to(device)
            return cls(model, replace(settings, fsdp=False, distill=None),
                       cfg.model_copy(update={"kl_coef": 0.0}), total_steps=total_steps,
                       rank=rank, world_size=world_size, role=role)  # fmt: skip
        init_process_group(rank, world_size, pg_timeout_s)
        teacher = teacher_spec.build(device=device) if teacher_spec is not None else None
        if meta_init(spec, settings, world_size):  # no rank ever holds the full transformer
            return cls(
                spec.build(empty=True, device=device), settings, cfg, total_steps=total_steps,
                rank=rank, world_size=world_size, weights=spec.path,
                sequence_parallel=sequence_parallel, teacher=teacher,
            )  # fmt: skip
        model = spec.build(device=device).to(device)
        return cls(model, settings, cfg, total_steps=total_steps, rank=rank, world_size=world_size,
                   sequence_parallel=sequence_parallel, teacher=teacher)  # fmt: skip

    def _pool(self, batch: Batch) -> tuple[Batch, slice | None]:
        """Sequence parallelism: the group's rows on every member, and where this rank's sit."""
        return (batch, None) if self.sp is None else gather_rows(batch, self.sp)

    @staticmethod
    def _own(out: Batch, mine: slice | None) -> Batch:
        return out if mine is None else out.index(mine)

    # ----- model calls ------------------------------------------------------------------------
    def _velocity(
        self,
        x: Tensor,
        sigma: Tensor,
        cond: dict[str, Tensor],
        reference: bool = False,
        old: bool = False,
        teacher: bool = False,
    ) -> Tensor:
        # bf16: FSDP2 casts parameters, autocast the ops diffusers upcasts to fp32 (Wan's
        # modulation and norms), so mixed-dtype matmuls run in bf16; velocities return in fp32
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.settings.bf16):
            return self._guided(x, sigma, cond, reference, old, teacher)

    def _guided(
        self, x: Tensor, sigma: Tensor, cond, reference: bool, old: bool, teacher: bool = False
    ) -> Tensor:
        null = self.flow.null_cond(x.shape[0]) if self.settings.cfg_scale != 1.0 else None
        if null is not None:
            null = {k: v.to(self.device) for k, v in null.items()}
        if teacher:  # the same conditioning contract (checked at load), the student's CFG scale
            assert self.teacher is not None, "the terms ask for the teacher with settings.distill"
            return guided_velocity(self.teacher, x, sigma, cond, null, self.settings.cfg_scale)
        if old and self.old_model is not None:
            return guided_velocity(self.old_model, x, sigma, cond, null, self.settings.cfg_scale)
        if not reference:
            return guided_velocity(self.flow, x, sigma, cond, null, self.settings.cfg_scale)
        if self.peft is not None:
            with self.peft.disable_adapter():
                return guided_velocity(self.flow, x, sigma, cond, null, self.settings.cfg_scale)
        assert self.ref_model is not None, "the terms ask for the reference with a KL (kl_coef)"
        return guided_velocity(self.ref_model, x, sigma, cond, null, self.settings.cfg_scale)

    def updates(self) -> int:
        """Updates applied so far (restored on resume), or those of the version last loaded."""
        if self.received_updates is not None:
            return self.received_updates
        return int(self.scheduler.last_epoch)

    # ----- rollout ----------------------------------------------------------------------------
    @register("dp")
    @torch.no_grad()
    def generate(self, prompts: Batch, n: int) -> Batch:
        """``n`` samples per prompt row (``prompt``, ``seeds`` [n per row], ``group_ids``).

        Returns per sample: latents / next_latents [B, N, ...], sigmas / sigmas_next [B, N],
        rollout_logprobs [B, N], response_mask [B, N] (steps to train), images [B, 3, (F,) H, W]
        in [0, 1], cond.* (the condition tensors, reused by training), group_ids.
        """
        self.flow.train(False)
        prompts, mine = self._pool(prompts)
        if mine is not None:  # this rank's samples: n per own prompt row
            mine = slice(mine.start * n, mine.stop * n)
        texts = [p for p in prompts["prompt"] for _ in range(n)]
        seeds = [s for row in prompts["seeds"] for s in row]
        if len(seeds) != len(texts):
            raise ValueError(
                f"generate: {len(seeds)} seeds for {len(texts)} samples (n={n} per prompt)"
            )
        shape = tuple(self.flow.latent_shape)
        # Same initial noise per group (an option): the group's first seed draws it.
        init_seeds = [
            row[0] if self.settings.same_noise_per_group else s
            for row in prompts["seeds"]
            for s in row
        ]
        noise = initial_noise(init_seeds, shape)
        gens = [seeded_generator(s, 1) for s in seeds]  # SDE noise: distinct per sample
        cond = {k: v.to(self.device) for k, v in self.flow.encode(texts).items()}
        sde_steps = sde_step_mask(self.updates(), self.settings.num_steps, self.settings.sde_window)
        traj = sample_trajectory(
            lambda x, s: self._velocity(x, s, cond, old=True), noise.to(self.device), self.sigmas,
            self.settings.sampler, noise_level=self.noise_level, generators=gens, sde_steps=sde_steps,
        )  # fmt: skip
        mask = training_steps(
            self.settings, seeds, sde_steps, self.terms.trainable_steps(self.sigmas)
        )
        renoised = self.settings.objective in ("nft", "awm")
        extra = {"clean_latents": traj.final} if renoised else {}
        tensors = {
            **extra,
            "latents": traj.latents, "next_latents": traj.next_latents,
            "sigmas": traj.sigmas, "sigmas_next": traj.sigmas_next,
            "rollout_logprobs": traj.logprobs, "response_mask": mask,
            "images": self.flow.decode(traj.final),
            **{COND_PREFIX + k: v for k, v in cond.items()},
        }  # fmt: skip
        tensors = {k: v.cpu() for k, v in tensors.items()}
        tensors["group_ids"] = prompts["group_ids"].repeat_interleave(n)
        # the samples' own seeds: DiffusionNFT / AWM draw their training noise from them
        tensors["sample_seeds"] = torch.tensor(seeds, dtype=torch.long)
        self.generated_samples += len(seeds)
        return self._own(Batch(tensors), mine)

    @register("all")
    def generated(self) -> int:
        """SDE samples this worker drew so far (a rollout pool's test: who generated)."""
        return self.generated_samples

    @register("dp")
    @torch.no_grad()
    def sample_images(self, prompts: Batch, sampler: str = "ode") -> Batch:
        """Evaluation: one image per row from its fixed ``noise_seed`` with ``sampler`` (ODE by default)."""
        self.flow.train(False)
        prompts, mine = self._pool(prompts)
        shape = tuple(self.flow.latent_shape)
        seeds = prompts["noise_seed"].tolist()
        noise = initial_noise(seeds, shape)
        cond = {k: v.to(self.device) for k, v in self.flow.encode(list(prompts["prompt"])).items()}
        gens = [seeded_generator(s, 1) for s in seeds]
        traj = sample_trajectory(
            lambda x, s: self._velocity(x, s, cond), noise.to(self.device), self.sigmas, sampler,
            noise_level=None if sampler != self.settings.sampler else self.noise_level, generators=gens,
        )  # fmt: skip
        return self._own(Batch({"images": self.flow.decode(traj.final).cpu()}), mine)

    # ----- log-probs --------------------------------------------------------------------------
    def _check(self, batch: Batch) -> None:
        lat = batch["latents"]
        if lat.dim() < 3:
            raise ValueError(f"latents must be [B, N, ...], got {list(lat.shape)}")
        check_latents(lat[:, 0], self.flow.latent_shape, "diffusion worker (stored latents)")

    @register("dp")
    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> Batch:
        """``logprobs`` [B, N] of the stored transitions on the masked steps under the current policy."""
        self._check(batch)
        batch, mine = self._pool(batch)
        batch = batch.to(self.device)
        self.flow.train(False)
        guard = self.terms.needs_step_kl()
        logp, _, _, means, _ = self.terms.step_terms(
            batch, batch["response_mask"], False, means=guard
        )
        out = {"logprobs": (logp * batch["response_mask"]).cpu()}  # placeholders (FSDP) out
        if means is not None:  # guard: GRPO-Guard's bias and Flow-DPPO's KL need the old means
            out["old_means"] = means.cpu()
        return self._own(Batch(out), mine)

    # ----- update -----------------------------------------------------------------------------
    @register("dp")
    def update(
        self, batch: Batch, *, shuffle_seed: int | None = None, temperature: float | None = None
    ) -> dict[str, float]:
        """μ epochs over shuffled mini-batches of samples; one optimizer step per mini-batch.
        ``temperature`` is accepted (and ignored) so the driver calls both policy types alike."""
        cfg = self.cfg
        self._check(batch)
        batch = self._pool(batch)[0].to(self.device)
        if PAD_KEY in batch:  # dispatch padding counts nowhere
            batch["response_mask"] = batch["response_mask"] * (~batch[PAD_KEY]).long()[:, None]
        self.flow.train(True)
        n = len(batch)
        # mini_batch_samples counts samples over all replicas; each holds an equal share
        mb_size = max(1, (cfg.mini_batch_samples or n * self.dp_size) // self.dp_size)
        gen = torch.Generator().manual_seed(shuffle_seed) if shuffle_seed is not None else None
        if self.settings.objective in ("nft", "awm") and "sample_seeds" not in batch:
            raise ValueError(
                f"diffusion.objective={self.settings.objective}: the batch has no 'sample_seeds' "
                "(the rollout seeds the training noise is drawn from; generate returns them)"
            )
        lr = self.optimizer.param_groups[0]["lr"]
        per_step = []
        for epoch in range(cfg.ppo_epochs):
            order = torch.randperm(n, generator=gen) if n > mb_size else torch.arange(n)
            for start in range(0, n, mb_size):
                mini = batch.index(order[start : start + mb_size])
                per_step.append(self._optimizer_step(mini, epoch))
        self.scheduler.step()
        if self.old_model is not None:
            self._update_old_model()
        metrics = combine_metrics(per_step)
        metrics["actor/lr"] = lr
        metrics["actor/nonfinite_skipped_total"] = float(self.nonfinite.total)
        return metrics

    def _optimizer_step(self, mini: Batch, epoch: int = 0) -> dict[str, float]:
        """One optimizer step on ``mini`` (``epoch``: which pass over the batch, for the
        re-noising objectives' training noise)."""
        cfg = self.cfg
        size = cfg.micro_batch_samples or len(mini)
        # summed over ranks, as the actor's (local_token_mean: divided by the micro-batch count)
        starts = range(0, len(mini), size)
        denominators = global_denominators(
            mini, [range(i, min(i + size, len(mini))) for i in starts], replicas=self.sp_size
        )
        stats: dict[str, float] = {}
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for start in starts:
            mb = mini.index(slice(start, start + size))
            mask = mb["response_mask"]
            loss, kl, to_teacher, m = self.terms.loss(mb, mask, epoch, denominators)
            share = float(mask.sum()) / max(1, denominators["num_tokens"])
            accumulate(stats, "actor/pg_loss", float(loss.detach()))
            if to_teacher is not None:
                kl_teacher = aggregate(to_teacher, mask, cfg.loss_agg, **denominators)
                accumulate(stats, "actor/distill_kl", float(kl_teacher.detach()))
                assert self.settings.distill is not None, "a teacher term needs settings.distill"
                loss = distillation_loss(loss, kl_teacher, **self.settings.distill)
            if kl is not None:
                kl_term = aggregate(kl, mask, cfg.loss_agg, **denominators)
                accumulate(stats, "actor/kl_loss", float(kl_term.detach()))
                loss = loss + cfg.kl_coef * kl_term
            for k, v in m.items():
                accumulate(stats, f"actor/{k}", float(v), share)
            # FSDP2 averages gradients over ranks; the losses use global denominators (a sum)
            (loss * self.world_size if self.sharded else loss).backward()
            total += float(loss.detach())
        params = [p for p in self.flow.parameters() if p.requires_grad]
        if not self.sharded:  # FSDP2 reduce-scatters its own
            sum_grads(params)
        grad_norm = clip_grad_norm(params, cfg.grad_clip)
        stats = reduce_stats(stats, self.sp_size)
        total = all_reduce(total) / self.sp_size
        stats.update({"actor/grad_norm": grad_norm, "actor/loss": total})
        stats["actor/nonfinite_skipped"] = self.nonfinite.step(self.optimizer, total, grad_norm)
        return stats

    @torch.no_grad()
    def _update_old_model(self) -> None:
        """old ← d·old + (1 − d)·current, d rising with the update count (DiffusionNFT)."""
        assert self.old_model is not None, "update calls this for a worker with an old copy"
        nft = self.settings.nft
        d = obj.ema_decay(
            int(self.scheduler.last_epoch), nft.get("old_decay_rate", 0.001),
            nft.get("old_decay_max", 0.5),
        )  # fmt: skip
        if self.settings.objective == "awm":  # the sampling policy: the weights after the update
            d = 0.0
        if self.sharded:  # shard-wise EMA: neither copy may still hold gathered parameters
            release_gathered(self.old_model)
            release_gathered(self.flow)
        for o, p in zip(self.old_model.parameters(), self.flow.parameters(), strict=True):
            o.mul_(d).add_(p.detach(), alpha=1 - d)

    # ----- state ------------------------------------------------------------------------------
    @register("rank0")
    def state_dict(self) -> dict:
        """Full state by parameter name (gathered when sharded: every rank runs this), so a
        checkpoint written by N workers loads into M."""
        model, optimizer = full_state(self.flow, self.optimizer)
        out = {"model": model, "optimizer": optimizer, **self.trained.train_state()}
        if self.old_model is not None:
            out["nft_old"] = {k: v.cpu() for k, v in full_model_state(self.old_model).items()}
        return out

    @register("all")
    def load_state_dict(self, state: dict) -> None:
        load_full_state(self.flow, self.optimizer, state["model"], state["optimizer"])
        self.trained.load_train_state(state)
        if self.old_model is not None:
            load_full_weights(self.old_model, state.get("nft_old", state["model"]))

    @register("all")
    def memory_stats(self) -> dict[str, float]:
        """This rank's model-state bytes (parameters, gradients, optimizer state: local shards
        when sharded), the process's peak resident memory (now, and once the model was loaded),
        and whether it was built on the meta device (``meta_init``: 1.0 — the full transformer
        was never in this process)."""
        return {
            **memory_stats(self.flow, self.optimizer), "load_peak_rss_bytes": self.load_peak_rss,
            "meta_init": float(self.meta_built),
        }  # fmt: skip

    @register("rank0")
    def full_weights(self, copy: bool = True) -> dict:
        """The flow model's weights (LoRA layers included), a copy: the asynchronous rollout's
        snapshot of one policy version (``copy=False``: in-process, CPU weights may come as the
        live tensors, for a caller that copies them at once)."""
        weights = {k: v.detach().cpu() for k, v in self.flow.state_dict().items()}
        return {k: v.clone() for k, v in weights.items()} if copy else weights

    def _sampling_extras(self, full: bool = False) -> dict[str, Tensor]:
        """What sampling depends on beside the flow weights, by name, as the live tensors
        (``full``: gathered when sharded): the "old" copy's weights under ``OLD_PREFIX`` when the
        objective samples with it (nft, awm) and, with ``sde_window``, the update count as a 0-d
        tensor (``UPDATES_KEY``). A copy that samples and never trains must be given them."""
        out = {}
        if self.old_model is not None:
            old = self._state(self.old_model, full)
            out.update({OLD_PREFIX + k: v.detach() for k, v in old.items()})
        if self.settings.sde_window is not None:
            self._updates_buffer.fill_(self.updates())
            out[UPDATES_KEY] = self._updates_buffer
        return out

    def _sampling_state(self, full: bool = False) -> dict[str, Tensor]:
        """The flow weights and ``_sampling_extras``: a version, as a weight transfer sends it."""
        flow = self._state(self.flow, full)
        return {**{k: v.detach() for k, v in flow.items()}, **self._sampling_extras(full)}

    def _state(self, module: nn.Module, full: bool) -> dict[str, Tensor]:
        """``module``'s state dict; ``full`` and sharded: gathered (a collective)."""
        return full_model_state(module) if full and self.sharded else module.state_dict()

    @register("rank0")
    def sampling_weights(self, copy: bool = True) -> dict:
        """A version as the asynchronous rollout's snapshot: ``full_weights`` and, on the CPU,
        ``_sampling_extras`` (sharded, every rank runs this: the old copy is gathered)."""
        extras = {k: v.cpu().clone() for k, v in self._sampling_extras(full=True).items()}
        return {**self.full_weights(copy), **extras}

    @register("all")
    def load_weights(self, weights: dict) -> None:
        """Flow weights (``full_weights``), or a version's whole sampling state
        (``sampling_weights``): then the old copy and the update count are this version's too."""
        flow = {k: v for k, v in weights.items() if not k.startswith(OLD_PREFIX)}
        updates = flow.pop(UPDATES_KEY, None)
        old = {k[len(OLD_PREFIX) :]: v for k, v in weights.items() if k.startswith(OLD_PREFIX)}
        if old and self.old_model is None:
            raise ValueError(
                f"load_weights: weights of an old copy ({OLD_PREFIX}*) for a worker without one "
                f"(diffusion.objective={self.settings.objective!r})"
            )
        self.flow.load_state_dict(flow)
        if old and self.old_model is not None:  # (old weights without an old copy: refused above)
            load_full_weights(self.old_model, old)
        if updates is not None:
            self.received_updates = int(updates)

    @register("rank0")
    def send_weights(self, version: int, transport):
        """Send the current version — the flow model's weights (LoRA layers included, by the names
        a rollout worker's model has) and what sampling depends on beside them (the old copy, the
        update count: ``_sampling_extras``) — with ``transport``
        (``groupflow.distributed.transport``); returns rank 0's ticket — for Ray or the filesystem
        references, not weights. The collective transport: every rank broadcasts what it holds —
        its FSDP2 rows when sharded; replicated, rank 0's tensors go and the others' are skipped
        (the update count, a plain tensor, is rank 0's) —, nothing is gathered. Other transports
        send from rank 0: replicated, its own weights; sharded, gathered first (a collective)."""
        if transport.every_rank_sends:
            return transport.send(version, self._sampling_state(), rank=self.rank)
        weights = self._sampling_state(full=True)
        if self.rank != 0:
            return None
        if transport.ticket_holds_tensors:  # the ticket is the weights: a copy
            weights = {k: v.cpu().clone() for k, v in weights.items()}
        return transport.send(version, weights)

    @register("all")
    def receive_weights(self, ticket, transport) -> int:
        """Fetch a version's weights with ``transport`` (checked; a timeout names this role, rank
        and version) into the flow model (and the old copy, the update count) in place, one
        bucket of extra memory at a time; the bytes received."""
        dest = self._sampling_state()
        receive_into(transport, ticket, dest, role=self.role, rank=self.rank)
        if UPDATES_KEY in dest:
            self.received_updates = int(dest[UPDATES_KEY])
        return tensors_nbytes(dest)

    @register("rank0")
    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.flow.parameters() if p.requires_grad)
