"""The actor-rollout worker: one object holding the policy, its optimizer and the rollout engine.

Design decision: colocation, as in verl's ActorRolloutRefWorker — generation, log-prob
recomputation, the reference model and the update live in one worker, so weights are never copied
between a "trainer" and a "generator" in one process. The driver never touches tensor math: it
calls ``generate``, ``compute_logprobs`` and ``update`` with Batches through a WorkerGroup, which
splits them across data-parallel ranks (dispatch mode ``dp``).

The update follows algorithms.md: μ epochs × mini-batches (one optimizer step each) ×
micro-batches (gradient accumulation), with loss denominators computed once per mini-batch and
summed over ranks, so the gradient depends neither on the micro-batch size nor on the number of
ranks (``local_token_mean``, TRL's bnpo, is by definition the mean of the micro-batches' own token
means: its denominator is the number of micro-batches over all ranks). ``response_mask`` marks
actions and may have gaps (tool/observation tokens): widths, attention and micro-batch budgets
reach to each response's last action (``groupflow.algorithms.masks``); that bookkeeping is
``groupflow.workers.update``'s. With several ranks the policy is sharded with FSDP2 (its reducer
averages gradients, so each rank's loss is scaled by the world size), and so is the reference:
per-rank weight memory is 1/world of each. Log-probs are computed through the sharded roots in
lockstep (every rank runs as many forwards as the rank with the most micro-batches,
``update.lockstep_logprobs``). Generation (``actor.generation_weights``) runs on the sharded policy
by default — each layer all-gathered when it runs and freed after, the ranks decoding in lockstep
(as many steps as the longest) — or on a full unsharded copy per rank refreshed after every
update (``copy``: no collectives while decoding, a whole model of memory per rank); an engine
with weights of its own (vLLM) needs neither. ``actor.cpu_offload`` keeps the FSDP2 shards, their
gradients and AdamW's state in CPU memory. With ``parallel.sequence_parallel`` N, groups of N
ranks pool their rows for the update, log-probs and the warm start and split every sequence
(``groupflow.models.sequence_parallel``): the data-parallel replicas are then world_size / N, and
sums over ranks count each row N times (denominators and metrics divide by N); generation stays
per rank.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch import nn

from groupflow.algorithms import (
    aggregate,
    importance_weighted_kl,
    kl_penalty,
    logprob_mismatch,
    policy_loss,
)
from groupflow.assembly.models import eos_ids
from groupflow.batch import Batch
from groupflow.config import ActorConfig
from groupflow.distributed import PAD_KEY, register
from groupflow.distributed.parallel import (
    agree,
    all_reduce,
    clip_grad_norm,
    cpu_offload_policy,
    full_model_state,
    gathered_root,
    init_process_group,
    load_full_state,
    load_full_weights,
    prepare_unsharded_use,
    shard,
)
from groupflow.distributed.ulysses import gather_rows, sequence_groups
from groupflow.models.causal_lm import hf_model
from groupflow.models.sequence_parallel import check_heads
from groupflow.rollout.engines.base import HF
from groupflow.rollout.engines.batching import generate_batch
from groupflow.rollout.engines.hf import SamplingParams, left_pad
from groupflow.workers.common import (
    ModelSpec,
    NonFiniteGuard,
    decoder_layers,
    loss_options,
    optimizer_and_schedule,
    optimizer_state_by_name,
    worker_device,
)
from groupflow.workers.lora import apply_lora, merged_lora_copy, set_adapters
from groupflow.workers.policy_forward import PolicyForward, meta_template
from groupflow.workers.reference import FrozenReference
from groupflow.workers.state import CheckpointMethods, TrainedState
from groupflow.workers.update import (
    EXTREMES,
    accumulate,
    batch_logprobs,
    combine_steps,
    drop_padding,
    forward_groups,
    global_denominators,
    lockstep_logprobs,
    reduce_stats,
    skips_zero_advantage,
    trim,
    update_rows,
)

__all__ = ["ActorRolloutWorker"]


def _vision(batch: Batch):
    """The rows' images (``models.vision.VisionInputs`` per row), None for a text batch."""
    return list(batch["vision"]) if "vision" in batch else None


class ActorRolloutWorker(CheckpointMethods):
    """Policy (FSDP2-sharded when world_size > 1) + frozen reference + AdamW + schedule + rollout."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        cfg: ActorConfig,
        *,
        total_steps: int,
        pad_id: int,
        eos_ids: Sequence[int],
        rank: int = 0,
        world_size: int = 1,
        reference: bool | None = None,
        engine=HF,
        sequence_parallel: int = 1,
    ):
        self.rank, self.world_size = rank, world_size
        # Ulysses sequence parallelism: groups of ``sequence_parallel`` ranks share their rows
        # (``gather_rows``), so each sample is held by that many ranks and the data-parallel
        # replicas are world_size / sequence_parallel (sums over ranks are divided accordingly).
        if sequence_parallel > 1:
            check_heads(model.config, sequence_parallel)
        self.sp = sequence_groups(rank, world_size, sequence_parallel)
        self.sp_size = sequence_parallel
        self.dp_size = world_size // sequence_parallel
        # Tensors cross the worker boundary on the CPU; inside, they live where the model does.
        self.device = next(model.parameters()).device
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.pad_id, self.eos_ids = pad_id, list(eos_ids)
        # β = 0 never builds a reference model (algorithms.md §4); ``reference`` asks for one
        # without a KL loss (KL in the reward). With LoRA the reference is the base model with
        # the adapters switched off: no second copy in memory. A reference placed in its own pool
        # is asked for with ``reference=False`` (``ref_logprobs`` then arrive with the batch).
        self.has_reference = cfg.kl_coef > 0 if reference is None else reference
        self.sharded = world_size > 1
        offload = cpu_offload_policy(cfg.cpu_offload and self.sharded)
        self.reference: FrozenReference | None = None
        if self.has_reference and cfg.lora is None:  # sharded like the policy (and with it)
            forward = dict(share_prompt_prefix=cfg.share_prompt_prefix, sharded=True, sp=self.sp,
                           packing=cfg.packing)  # fmt: skip
            self.reference = FrozenReference(model, forward if self.sharded else None, offload)
        if cfg.lora is not None:
            apply_lora(model, cfg.lora)
        # actor.generation_weights "copy": a full copy for generation on every sharded rank (see
        # the module docstring); "gather": none, the HF engine decodes with the sharded policy.
        self.rollout_model = (
            copy.deepcopy(model).eval().requires_grad_(False)
            if self.sharded and cfg.generation_weights == "copy"
            else None
        )
        # The rollout engine (rollout.engine): HF decodes with the unsharded copy, or the training
        # model itself; vLLM keeps a copy of its own, fed the weights after every update (built
        # before sharding, from the full initial weights).
        decoder = self.rollout_model if self.rollout_model is not None else model
        self.engine = engine.build(decoder, tokenizer, eos_ids=self.eos_ids, pad_id=pad_id)
        # An engine decoding with the sharded policy: each layer is gathered when it runs, so the
        # ranks decode in lockstep (same path, as many steps as the longest; rollout.hf).
        self.lockstep = (
            self.sharded and self.rollout_model is None and not self.engine.separate_weights
        )
        if self.lockstep:
            self.engine.lockstep = agree
        # plain-weights exports (save_pretrained, full_weights) rebuild an unsharded model from
        # this weightless (meta) template when there is no copy to load into
        self._template = (
            meta_template(model) if self.sharded and self.rollout_model is None else None
        )
        self.weight_sync_s = 0.0
        self.generated_samples = 0  # what this worker's engine generated (placement checks)
        self.model = model
        # actor.cpu_offload: shards, gradients and AdamW state in CPU memory (config: FSDP only)
        self.policy = shard(
            PolicyForward(
                model,
                cfg.share_prompt_prefix,
                sharded=self.sharded,
                sp=self.sp,
                packing=cfg.packing,
            ),
            list(decoder_layers(model)),
            offload_policy=offload,
        )
        if self.lockstep:
            prepare_unsharded_use(self.policy)
        self.optimizer, self.scheduler = optimizer_and_schedule(
            self.policy, cfg, total_steps, cfg.warmup_steps
        )
        self.loss_options = loss_options(cfg)
        self.sft_optimizer: torch.optim.Optimizer | None = None
        self.nonfinite = NonFiniteGuard(
            cfg.max_nonfinite_steps, "updates",
            "lower actor.lr, check rewards/advantages for extreme values, or raise "
            "actor.max_nonfinite_steps",
        )  # fmt: skip
        self.trained = TrainedState(
            self.policy, self.optimizer, self.scheduler, self.nonfinite, sharded=self.sharded
        )

    @classmethod
    def create(
        cls,
        rank: int,
        world_size: int,
        *,
        spec: ModelSpec,
        cfg: ActorConfig,
        total_steps: int,
        pg_timeout_s: float = 600.0,
        reference: bool | None = None,
        engine=HF,
        sequence_parallel: int = 1,
    ):
        """Factory used by WorkerGroup: join the process group, then build the model in this process."""
        init_process_group(rank, world_size, pg_timeout_s)
        model, tok = spec.build()
        model.to(worker_device(rank))
        return cls(model, tok, cfg, total_steps=total_steps, pad_id=tok.pad_token_id, eos_ids=eos_ids(tok, model),
                   rank=rank, world_size=world_size, reference=reference, engine=engine,
                   sequence_parallel=sequence_parallel)  # fmt: skip

    # ----- rollout ----------------------------------------------------------------------------
    @register("dp")
    def generate(self, prompts: Batch, params: SamplingParams, prompt_width: int = 0) -> Batch:
        """``params.n`` samples per prompt row (``prompt_token_ids``, ``seeds``, ``group_ids``).

        Output widths are fixed — prompts left-padded to ``prompt_width``, responses right-padded
        to ``params.max_new_tokens`` — so parts generated on different ranks concatenate.
        """
        # lockstep: the root's weights gathered for the call, each layer's at its use
        with gathered_root(self.policy) if self.lockstep else nullcontext():
            out = generate_batch(self.engine, self.pad_id, prompts, params, prompt_width)
        self.generated_samples += len(out)
        return out

    @register("all")
    def generated(self) -> int:
        """Samples this rank generated so far."""
        return self.generated_samples

    @register("all")
    def engine_name(self) -> str:
        """Which rollout engine this rank decodes with (``hf``, ``vllm``)."""
        return self.engine.name

    # ----- log-probs --------------------------------------------------------------------------
    @register("dp")
    @torch.no_grad()
    def compute_logprobs(
        self, batch: Batch, *, temperature: float, reference: bool = False
    ) -> Batch:
        """``logprobs`` [B, T] of the batch's responses under the policy or the reference; 0 where masked."""
        if reference and not self.has_reference:
            raise RuntimeError(
                "compute_logprobs(reference=True) needs actor.kl_coef > 0 or "
                "algorithm.kl_in_reward (no reference model)"
            )
        ref = self.reference if reference else None
        lora_off = reference and ref is None  # LoRA: the base model is the reference
        mine = None
        if self.sp is not None:  # the group's rows, 1/N of each sequence here; this rank's back
            batch, mine = gather_rows(batch, self.sp)
        model = ref.model if ref is not None else self.model
        try:
            set_adapters(model, enabled=not lora_off)
            if self.sharded:  # the FSDP2 roots, every rank running as many forwards as the others
                forward = ref.root if ref is not None else self.policy
                assert forward is not None  # a sharded worker's reference is sharded too
                out = lockstep_logprobs(forward, batch, temperature, self.cfg, self.device)
            else:
                out = batch_logprobs(model, batch, temperature, self.cfg, self.device, self.sp)
            return out if mine is None else Batch({"logprobs": out["logprobs"][mine]})
        finally:
            set_adapters(model, enabled=True)

    # ----- update -----------------------------------------------------------------------------
    @register("dp")
    def update(
        self, batch: Batch, *, temperature: float, shuffle_seed: int | None = None
    ) -> dict[str, float]:
        """μ epochs over shuffled mini-batches; one optimizer step per mini-batch (all ranks in step)."""
        cfg = self.cfg
        if self.sp is not None:  # a sequence-parallel group trains on its members' rows together
            batch, _ = gather_rows(batch, self.sp)
        batch = drop_padding(batch.to(self.device))
        self.policy.train()
        n = len(batch)
        # mini_batch_samples counts samples over all replicas; each holds an equal share
        mb_size = max(1, (cfg.mini_batch_samples or n * self.dp_size) // self.dp_size)
        generator = (
            torch.Generator().manual_seed(shuffle_seed) if shuffle_seed is not None else None
        )
        lr = self.optimizer.param_groups[0][
            "lr"
        ]  # the LR this update uses (logged before stepping the schedule)
        per_step: list[dict[str, float]] = []
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(n, generator=generator) if n > mb_size else torch.arange(n)
            for start in range(0, n, mb_size):
                per_step.append(
                    self._optimizer_step(batch.index(order[start : start + mb_size]), temperature)
                )
        self.scheduler.step()
        self._sync_rollout_weights()
        metrics = combine_steps(per_step)
        metrics["actor/lr"] = lr
        if self.engine.separate_weights:
            metrics["perf/weight_sync_s"] = self.weight_sync_s
        metrics["actor/nonfinite_skipped_total"] = float(self.nonfinite.total)
        return metrics

    def _optimizer_step(self, mini: Batch, temperature: float) -> dict[str, float]:
        cfg = self.cfg
        rows = update_rows(mini, cfg)
        groups = forward_groups(mini, cfg, rows)
        denominators = global_denominators(mini, groups, replicas=self.sp_size)
        # Ratio/clip/entropy metrics average over the samples that are run (all, unless skipped).
        # (decided by config, not by this rank's rows: global_denominators is a collective)
        metric_denominators = (
            global_denominators(mini.index(rows), replicas=self.sp_size)
            if skips_zero_advantage(cfg)
            else denominators
        )
        # Every rank runs the same number of forward/backward passes (FSDP collectives), at least
        # one (so every parameter the forward touches gets a gradient, zero if need be, and AdamW
        # steps it exactly as when nothing is skipped): a rank with fewer micro-batches repeats
        # its last one, or row 0, with a zero mask (no loss, no gradient).
        n_micro = max(1, int(all_reduce(len(groups), op="max")))
        stats: dict[str, float] = {}
        self.optimizer.zero_grad(set_to_none=True)
        total_loss = 0.0
        for i in range(n_micro):
            mb = trim(mini.index(groups[min(i, len(groups) - 1)] if groups else [0]))
            mask = mb["response_mask"] if i < len(groups) else torch.zeros_like(mb["response_mask"])
            loss, contrib = self._micro_loss(
                mb, mask, temperature, denominators, metric_denominators
            )
            for k, (v, w) in contrib.items():
                accumulate(stats, k, v, w)
            # FSDP2 averages gradients over ranks; the losses already use global denominators.
            (loss * self.world_size).backward()
            total_loss += float(loss.detach())
        grad_norm = clip_grad_norm(list(self.policy.parameters()), cfg.grad_clip)
        # Same keys on every rank (see _micro_loss), reduced in a fixed order; a sum counts each
        # sample once per rank holding it (sequence parallelism: sp_size ranks).
        stats = reduce_stats(stats, self.sp_size)
        for k, neutral in (("actor/ratio_max", 1.0), ("actor/ratio_min", 1.0)):
            if k in stats and not math.isfinite(stats[k]):
                stats[k] = neutral  # no valid token anywhere
        total_loss = all_reduce(total_loss) / self.sp_size
        stats["actor/grad_norm"] = grad_norm
        stats["actor/loss"] = total_loss
        if skips_zero_advantage(cfg):
            skipped = denominators["num_seqs"] - metric_denominators["num_seqs"]
            stats["actor/zero_adv_skipped"] = skipped / max(1, denominators["num_seqs"])
        stats["actor/nonfinite_skipped"] = self.nonfinite.step(
            self.optimizer, total_loss, grad_norm
        )
        return stats

    def _micro_loss(self, mb: Batch, mask: torch.Tensor, temperature: float, denominators: dict,
                    metric_denominators: dict):  # fmt: skip
        """Loss of one micro-batch and its metric contributions {key: (value, weight)}."""
        cfg = self.cfg
        logp, entropy = self.policy(
            mb["prompt_ids"], mb["prompt_mask"], mb["responses"], mb["response_mask"],
            temperature, cfg.logprob_chunk_tokens, True, bool(cfg.entropy_coef),
            _vision(mb),
        )  # fmt: skip
        # token weight of this micro-batch among the tokens the metrics cover
        share = float(mask.sum()) / max(1, metric_denominators["num_tokens"])
        gap = {}
        if "old_logprobs" in mb:
            old = mb["old_logprobs"]
        else:  # one optimizer step on the current weights: this forward is the proximal policy
            old = logp.detach()  # (policies.llm.old_logprobs_source "forward")
            if "rollout_logprobs" in mb:  # the behaviour/proximal gap, as a recompute logs it
                diff = logprob_mismatch(old, mb["rollout_logprobs"], mask)
                gap = {"rollout/logprob_diff_max": (diff["max"], 1.0),
                       "rollout/logprob_diff_mean": (diff["mean"], share)}  # fmt: skip
        tis = {}
        if cfg.tis_cap is not None:  # truncated IS against the rollout engine's log-probs
            tis = {"tis_cap": cfg.tis_cap, "rollout_logprobs": mb["rollout_logprobs"]}
        elif cfg.off_policy == "decoupled":  # AReaL: proximal anchor, behaviour-weighted loss
            tis = {"decoupled": True, "behav_weight_cap": cfg.behav_weight_cap,
                   "rollout_logprobs": mb["rollout_logprobs"]}  # fmt: skip
        loss, pg_metrics = policy_loss(
            logp, old, mb["advantages"], mask, loss_fn=cfg.loss_fn, agg=cfg.loss_agg,
            **self.loss_options, **denominators, **tis,
        )  # fmt: skip
        ent = aggregate(entropy, mask, cfg.loss_agg, **metric_denominators)
        contrib = {
            "actor/pg_loss": (float(loss.detach()), 1.0),
            "actor/entropy": (float(ent.detach()), 1.0),
            **gap,
        }
        if cfg.entropy_coef:  # never with skipped samples: the metric's denominators are the loss's
            loss = loss - cfg.entropy_coef * ent
        if cfg.kl_coef > 0:
            if "ref_logprobs" not in mb:
                raise ValueError("actor.kl_coef > 0 but the batch has no 'ref_logprobs'")
            per_token = kl_penalty(logp, mb["ref_logprobs"], cfg.kl_kind)
            if cfg.kl_bias_correction:  # TRL's use_bias_correction_kl: × π/π_old
                per_token = importance_weighted_kl(
                    per_token, logp, old, mask, ratio_level=cfg.ratio_level
                )
            kl = aggregate(per_token, mask, cfg.loss_agg, **denominators)
            contrib["actor/kl_loss"] = (float(kl.detach()), 1.0)
            loss = loss + cfg.kl_coef * kl
        has_tokens = bool(mask.sum() > 0)
        for k, v in pg_metrics.items():
            value = float(v)
            if not has_tokens and f"actor/{k}" in EXTREMES:
                value = -math.inf if k.endswith("max") else math.inf  # ignored by max/min
            contrib[f"actor/{k}"] = (value, share)
        return loss, contrib

    def _sync_rollout_weights(self) -> None:
        """Refresh the unsharded generation copy and/or the vLLM engine from the current (FSDP:
        gathered) weights (a collective when sharded: all ranks call it)."""
        if self.rollout_model is None and not self.engine.separate_weights:
            return
        start = time.perf_counter()
        full = {k.removeprefix("lm."): v for k, v in full_model_state(self.policy).items()}
        if self.rollout_model is not None:
            self.rollout_model.load_state_dict(full)
        if self.engine.separate_weights:
            self.engine.load_weights(full.items())
        self.weight_sync_s = time.perf_counter() - start

    # ----- supervised warm start --------------------------------------------------------------
    @register("dp")
    def sft_step(self, batch: Batch, lr: float) -> float:
        """One cross-entropy step on (``prompt_token_ids``, ``target_ids``) rows; loss over target
        tokens whose ``target_mask`` is 1 (all of them without one; a multi-turn demonstration
        masks its observation tokens, which the model reads but is not trained to write)."""
        if self.sft_optimizer is None:
            self.sft_optimizer = torch.optim.AdamW(self.policy.parameters(), lr=lr)
        if self.sp is not None:  # as in update: the group's rows together
            batch, _ = gather_rows(batch, self.sp)
        prompt_ids, prompt_mask = left_pad(list(batch["prompt_token_ids"]), self.pad_id)
        targets = list(batch["target_ids"])
        masks = (
            list(batch["target_mask"])
            if "target_mask" in batch
            else [[1] * len(t) for t in targets]
        )
        width = int(all_reduce(max(len(t) for t in targets), op="max"))
        responses = torch.full((len(targets), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(responses)
        for i, (t, m) in enumerate(zip(targets, masks)):
            responses[i, : len(t)] = torch.as_tensor(list(t))
            mask[i, : len(t)] = torch.as_tensor(list(m))
        if PAD_KEY in batch:
            mask = mask * (~batch[PAD_KEY]).long()[:, None]
        prompt_ids, prompt_mask, responses, mask = (
            t.to(self.device) for t in (prompt_ids, prompt_mask, responses, mask)
        )
        self.policy.train()
        logp, _ = self.policy(
            prompt_ids, prompt_mask, responses, mask, 1.0, self.cfg.logprob_chunk_tokens, False,
            True, _vision(batch),
        )  # fmt: skip
        tokens = all_reduce(float(mask.sum())) / self.sp_size
        loss = -(logp * mask).sum() / max(tokens, 1.0)
        self.sft_optimizer.zero_grad(set_to_none=True)
        (loss * self.world_size).backward()
        clip_grad_norm(list(self.policy.parameters()), 1.0)
        self.sft_optimizer.step()
        self._sync_rollout_weights()
        return all_reduce(float(loss.detach())) / self.sp_size

    # ----- state ------------------------------------------------------------------------------
    def _loaded(self) -> None:
        self._sync_rollout_weights()

    @register("rank0")
    def load_state_dict(self, state: dict) -> None:
        self.trained.load_local_state(self.model, state)
        if self.reference is not None and state.get("ref_model") is not None:  # older checkpoints
            self.reference.model.load_state_dict(state["ref_model"])
        self._sync_rollout_weights()

    @register("all")
    def load_full_state(self, state: dict) -> None:
        """Resume a single-worker checkpoint on any number of ranks: the full weights and the
        optimizer state (re-keyed from parameter indices to names) are sharded on load."""
        names = [n for n, p in self.policy.named_parameters() if p.requires_grad]
        load_full_state(
            self.policy, self.optimizer, {f"lm.{k}": v for k, v in state["model"].items()},
            optimizer_state_by_name(state["optimizer"], names),
        )  # fmt: skip
        self.trained.load_train_state(state)
        self._sync_rollout_weights()

    @register("all")
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load full (unsharded) policy weights, e.g. from a single-worker checkpoint."""
        load_full_weights(self.policy, {f"lm.{k}": v for k, v in weights.items()})
        self._sync_rollout_weights()

    @register("all")
    def reset_reference(self) -> None:
        """Make the current policy the reference (after a supervised warm start: RL starts there)."""
        if self.reference is not None:
            self.reference.reset_from(self.policy)

    @register("rank0")
    def reference_weights(self) -> dict[str, torch.Tensor] | None:
        return self.reference.weights() if self.reference is not None else None

    @register("all")
    def load_reference(self, weights: dict[str, torch.Tensor]) -> None:
        if self.reference is not None:
            self.reference.load(weights)

    @register("rank0")
    def save_pretrained(self, out_dir: str) -> None:
        """Write a plain HF directory (safetensors + config + tokenizer) from the (gathered) weights;
        LoRA adapters are merged into the base weights, so the directory needs no PEFT to load."""
        target = self._plain_model()
        if target is not None:  # rank 0
            hf_model(target).save_pretrained(out_dir, safe_serialization=True)
            self.tokenizer.save_pretrained(out_dir)

    @register("rank0")
    def send_weights(self, version: int, transport):
        """Send the current full weights from rank 0 with ``transport``
        (``groupflow.distributed.transport``); returns rank 0's ticket — for a Ray or filesystem
        transport a few references, not the weights. The collective transport: every rank
        broadcasts the rows it holds (its FSDP2 shard), nothing is gathered."""
        if transport.every_rank_sends:
            held = self.model.state_dict() if self.cfg.lora is None else self.full_weights(False)
            return transport.send(version, held, rank=self.rank)  # LoRA: merged, from rank 0
        in_process = transport.ticket_holds_tensors  # the ticket is the weights: a copy
        if self.cfg.lora is None and self._template is None:
            # The unsharded generation copy (sharded training) or the training model itself is
            # current after every weight change (_sync_rollout_weights): rank 0 sends from it, no
            # gather, no second copy — the transport holds one bucket at a time.
            if self.rank != 0:
                return None
            source = self.rollout_model if self.rollout_model is not None else self.model
            weights = {k: v.detach() for k, v in source.state_dict().items()}
            if in_process:
                weights = {k: v.cpu().clone() for k, v in weights.items()}
            return transport.send(version, weights)
        # LoRA, or sharded with no copy: gathered (and merged) on rank 0, a collective
        weights = self.full_weights(copy=in_process)
        return transport.send(version, weights) if self.rank == 0 else None

    @register("rank0")
    def full_weights(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """The policy's full weights with plain HF names (LoRA merged), on rank 0 (a collective):
        for a rollout or reference pool, or to initialise a critic. ``copy=False``: in-process,
        CPU weights may come as the live tensors (for a caller that copies them at once)."""
        target = self._plain_model()
        if target is None:  # not rank 0
            return {}
        weights = {k: v.detach().cpu() for k, v in target.state_dict().items()}
        return {k: v.clone() for k, v in weights.items()} if copy else weights

    def _plain_model(self) -> nn.Module | None:
        """An unsharded model with the current weights (LoRA merged) on rank 0; a collective."""
        full = full_model_state(self.policy)
        if self.rank != 0:
            return None
        target = self.model
        full = {k.removeprefix("lm."): v for k, v in full.items()}
        if self.rollout_model is not None:
            target = copy.deepcopy(self.rollout_model)
            target.load_state_dict(full)
        elif self._template is not None:
            target = copy.deepcopy(self._template)
            target.load_state_dict(full, assign=True)
            if hasattr(target, "tie_weights"):  # assign gives tied names tensors of their own
                hf_model(target).tie_weights()
        return merged_lora_copy(target) if self.cfg.lora is not None else target
