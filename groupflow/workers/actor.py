"""The actor-rollout worker: one object holding the policy, its optimizer and the rollout engine.

Design decision: colocation, as in verl's ActorRolloutRefWorker — generation, log-prob
recomputation, the reference model and the update live in one worker, so weights are never copied
between a "trainer" and a "generator" in one process. The driver never touches tensor math: it
calls ``generate``, ``compute_logprobs`` and ``update`` with Batches through a WorkerGroup, which
splits them across data-parallel ranks (dispatch mode ``dp``).

The update follows algorithms.md: μ epochs × mini-batches (one optimizer step each) ×
micro-batches (gradient accumulation), with loss denominators computed once per mini-batch and
summed over ranks, so the gradient depends neither on the micro-batch size nor on the number of
ranks. With several ranks the policy is sharded with FSDP2 (its reducer averages gradients, so each
rank's loss is scaled by the world size), and generation runs on a full, unsharded copy that is
refreshed after every update — ranks then generate independently, without collectives inside a
decode loop whose length differs per rank.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence

import torch
from torch import nn

from groupflow.algorithms import (
    POLICY_LOSSES,
    aggregate,
    kl_penalty,
    loss_denominators,
    policy_loss,
    zero_advantage_inert,
)
from groupflow.algorithms.registry import option_names
from groupflow.batch import Batch
from groupflow.config import ActorConfig
from groupflow.distributed import PAD_KEY, register
from groupflow.distributed.parallel import (
    all_reduce,
    clip_grad_norm,
    full_model_state,
    init_process_group,
    load_sharded_state,
    save_sharded_state,
    shard,
)
from groupflow.models.causal_lm import prompt_sharing_applies
from groupflow.models.logprobs import response_logprobs
from groupflow.rollout.hf import SamplingParams, generate, left_pad
from groupflow.rollout.vllm_engine import VLLMEngine, VLLMOptions

__all__ = [
    "ActorRolloutWorker",
    "ModelSpec",
    "prompts_batch",
    "NonFiniteLossError",
    "lr_lambda",
    "micro_batches",
]


class NonFiniteLossError(RuntimeError):
    """Too many consecutive updates produced NaN/inf losses or gradients."""


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """Multiplier of the base LR at a given (0-based) step: linear warm-up, then constant or cosine."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def loss_options(cfg: ActorConfig) -> dict:
    """The typed PPO options the chosen loss declares, plus its free-form extras (``loss_options``)."""
    accepted = option_names(POLICY_LOSSES.get(cfg.loss_fn))
    typed = ("ratio_level", "clip_eps_low", "clip_eps_high", "clip_ratio_c", "delta")
    chosen = {k: getattr(cfg, k) for k in typed if accepted is None or k in accepted}
    return {**chosen, **cfg.loss_options}


def micro_batches(
    lengths: Sequence[int | tuple[int, int]], max_samples: int | None, max_tokens: int | None
) -> list[list[int]]:
    """Consecutive index groups: by sample count, or packed greedily under a token budget.

    ``lengths`` are per-sample token counts, or (prompt, response) pairs: a trimmed micro-batch is
    padded to its longest prompt plus its longest response, so that is the width charged against
    the budget. A single sample longer than the budget gets a micro-batch of its own.
    """
    n = len(lengths)
    if n == 0:
        return []
    if max_tokens is None:
        size = max_samples or n
        return [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    pairs = [
        (int(x), 0) if isinstance(x, (int, float)) else (int(x[0]), int(x[1])) for x in lengths
    ]
    out: list[list[int]] = []
    cur: list[int] = []
    p_max = r_max = 0
    for i, (p, r) in enumerate(pairs):
        new_p, new_r = max(p_max, p), max(r_max, r)
        if cur and (new_p + new_r) * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, new_p, new_r = [], p, r
        cur.append(i)
        p_max, r_max = new_p, new_r
    if cur:
        out.append(cur)
    return out


# Metrics that are extremes combine by max/min; the rest are sums of micro-batch contributions
# (losses with global denominators, token-weighted means) and means over optimizer steps.
_EXTREMES = {"actor/ratio_max": max, "actor/ratio_min": min}
_REDUCE_OP = {"actor/ratio_max": "max", "actor/ratio_min": "min"}


def _accumulate(stats: dict[str, float], key: str, value: float, weight: float = 1.0) -> None:
    op = _EXTREMES.get(key)
    if op is not None:
        stats[key] = op(stats[key], value) if key in stats else value
    else:
        stats[key] = stats.get(key, 0.0) + value * weight


def _combine_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for s in steps for k in s):
        values = [s[key] for s in steps if key in s]
        op = _EXTREMES.get(key)
        out[key] = op(values) if op is not None else sum(values) / len(values)
    return out


def _lengths(batch: Batch) -> list[tuple[int, int]]:
    return list(zip(batch["prompt_mask"].sum(1).tolist(), batch["response_mask"].sum(1).tolist()))


def _trim(batch: Batch) -> Batch:
    """Drop all-padding columns (left of prompts, right of responses) to save compute."""
    pm, rm = batch["prompt_mask"], batch["response_mask"]
    p_keep = int(pm.sum(1).max())
    t_keep = max(1, int(rm.sum(1).max()))
    out = batch.copy()
    for k in ("prompt_ids", "prompt_mask"):
        out[k] = batch[k][:, pm.shape[1] - p_keep :]
    for k in ("responses", "response_mask", "old_logprobs", "ref_logprobs", "rollout_logprobs",
              "values", "returns"):  # fmt: skip
        if k in batch.tensors:
            out[k] = batch[k][:, :t_keep]
    if "advantages" in batch.tensors and batch["advantages"].dim() == 2:
        out["advantages"] = batch["advantages"][:, :t_keep]
    return out


def global_denominators(mini: Batch) -> dict[str, int]:
    """Loss denominators of a whole mini-batch summed over ranks (algorithms.md §3), so the
    gradient depends neither on micro-batching nor on the number of ranks; dispatch padding rows
    (zero masks) count as no tokens and no sequences. A collective: every rank calls it."""
    local = loss_denominators(mini["response_mask"])
    real_rows = int((~mini[PAD_KEY]).sum()) if PAD_KEY in mini else len(mini)
    return {
        "num_tokens": int(all_reduce(local["num_tokens"])),
        "num_seqs": int(all_reduce(real_rows)),
        "max_len": int(all_reduce(local["max_len"], op="max")),
    }


def skips_zero_advantage(cfg: ActorConfig) -> bool:
    """Whether the update may leave zero-advantage samples out: only when nothing else gives them
    a gradient and the loss denominators do not depend on which samples are run."""
    return (
        cfg.skip_zero_advantage
        and cfg.kl_coef == 0
        and cfg.entropy_coef == 0
        and cfg.loss_agg != "local_token_mean"
        and zero_advantage_inert(cfg.loss_fn)
    )


def update_rows(mini: Batch, cfg: ActorConfig) -> list[int]:
    """The mini-batch rows the update runs: all of them, or (``skips_zero_advantage``) those with a
    non-zero advantage on a valid token — in GRPO, the groups whose rewards were not all equal.
    Rows are ordered by group so micro-batches hold whole groups (an order the global-denominator
    losses are invariant to)."""
    order = list(range(len(mini)))
    if "group_ids" in mini and cfg.loss_agg != "local_token_mean":
        order = torch.argsort(mini["group_ids"].cpu(), stable=True).tolist()
    if not skips_zero_advantage(cfg):
        return order
    valid = mini["response_mask"] != 0
    adv = mini["advantages"]
    adv = adv[:, None].expand_as(valid) if adv.dim() == 1 else adv[:, : valid.shape[1]]
    carries = ((adv != 0) & valid).any(dim=1).cpu().tolist()  # NaN != 0: kept, guard sees it
    return [r for r in order if carries[r]]


class _PolicyForward(nn.Module):
    """The FSDP root: its forward computes response log-probs, so root-level parameters (embeddings,
    final norm, LM head) are gathered by FSDP2's hooks around the whole chunked computation."""

    def __init__(self, lm: nn.Module, share_prompt_prefix: bool = True, sharded: bool = False):
        super().__init__()
        self.lm = lm
        self.share_prompt_prefix = share_prompt_prefix
        self.sharded = sharded

    def forward(
        self,
        prompt_ids,
        prompt_mask,
        responses,
        response_mask,
        temperature,
        chunk_tokens,
        with_entropy,
    ):
        share: bool | str = self.share_prompt_prefix
        if share and self.sharded:
            # FSDP2 gathers each layer once per call: every rank must make the same decoder calls,
            # so the ranks share the prompt pass only if it applies on all of them.
            applies = prompt_sharing_applies(self.lm, prompt_ids, prompt_mask, responses)
            share = "always" if all_reduce(int(applies), op="min") else False
        return response_logprobs(
            self.lm, prompt_ids, prompt_mask, responses, response_mask,
            temperature=temperature, chunk_tokens=chunk_tokens, with_entropy=with_entropy,
            share_prompt=share,
        )  # fmt: skip


class ModelSpec:
    """How a worker builds its model and tokenizer inside its own process (picklable for Ray)."""

    def __init__(self, model_cfg, tokenizer_dir: str, seed: int):
        self.model_cfg, self.tokenizer_dir, self.seed = model_cfg, tokenizer_dir, seed

    def build(self):
        from transformers import AutoTokenizer

        from groupflow.builders import build_model

        tok = AutoTokenizer.from_pretrained(
            self.tokenizer_dir,
            local_files_only=True,
            trust_remote_code=self.model_cfg.trust_remote_code,
        )
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return build_model(self.model_cfg, tok, self.seed), tok


def prompts_batch(
    token_ids: Sequence[Sequence[int]], seeds: Sequence[Sequence[int]], group_ids: Sequence[int]
) -> Batch:
    """The input of ``generate``: one row per prompt with its token ids and one seed per sample."""
    return Batch(
        {"group_ids": torch.as_tensor(list(group_ids), dtype=torch.long)},
        {"prompt_token_ids": [list(t) for t in token_ids], "seeds": [list(s) for s in seeds]},
    )


def _pad_to(t: torch.Tensor, width: int, value: int | float, left: bool) -> torch.Tensor:
    extra = width - t.shape[1]
    if extra <= 0:
        return t
    filler = torch.full((t.shape[0], extra), value, dtype=t.dtype, device=t.device)
    return torch.cat([filler, t] if left else [t, filler], dim=1)


def _drop_padding(batch: Batch) -> Batch:
    """Zero the masks of dispatch padding so those samples count nowhere (losses, denominators)."""
    if PAD_KEY not in batch:
        return batch
    out = batch.copy()
    keep = (~batch[PAD_KEY]).to(batch["response_mask"].dtype)[:, None]
    out["response_mask"] = batch["response_mask"] * keep
    return out


def generate_batch(model, tokenizer, pad_id: int, eos_ids, prompts: Batch, params: SamplingParams,
                   prompt_width: int = 0, engine=None) -> Batch:  # fmt: skip
    """Generate ``params.n`` samples per prompt row into fixed-width, CPU tensors (see
    ``ActorRolloutWorker.generate``), with our HF decode loop or a vLLM ``engine``."""
    seeds = [s for per_prompt in prompts["seeds"] for s in per_prompt]
    if engine is not None:
        out = engine.generate(list(prompts["prompt_token_ids"]), params, seeds=seeds)
    else:
        out = generate(
            model, list(prompts["prompt_token_ids"]), params, seeds=seeds,
            pad_id=pad_id, eos_ids=eos_ids, tokenizer=tokenizer,
        )  # fmt: skip
    width = max(prompt_width, out.prompt_ids.shape[1])
    tensors = {
        "prompt_ids": _pad_to(out.prompt_ids, width, pad_id, left=True),
        "prompt_mask": _pad_to(out.prompt_mask, width, 0, left=True),
        "responses": _pad_to(out.responses, params.max_new_tokens, pad_id, left=False),
        "response_mask": _pad_to(out.response_mask, params.max_new_tokens, 0, left=False),
        "rollout_logprobs": _pad_to(out.logprobs, params.max_new_tokens, 0.0, left=False),
    }
    tensors = {k: v.cpu() for k, v in tensors.items()}
    tensors["group_ids"] = prompts["group_ids"].repeat_interleave(params.n)
    return Batch(tensors, {"finish_reason": out.finish_reasons})


@torch.no_grad()
def batch_logprobs(model: nn.Module, batch: Batch, temperature: float, cfg: ActorConfig,
                   device: torch.device) -> Batch:  # fmt: skip
    """``logprobs`` [B, T] of the batch's responses under an unsharded ``model``; 0 where masked."""
    batch = batch.to(device)
    was_training = model.training
    model.eval()
    out = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    try:
        for idx in micro_batches(_lengths(batch), cfg.micro_batch_samples, cfg.micro_batch_tokens):
            mb = _trim(batch.index(idx))
            lp, _ = response_logprobs(
                model, mb["prompt_ids"], mb["prompt_mask"], mb["responses"], mb["response_mask"],
                temperature=temperature, chunk_tokens=cfg.logprob_chunk_tokens,
                share_prompt=cfg.share_prompt_prefix,
            )  # fmt: skip
            out[idx, : lp.shape[1]] = lp * mb["response_mask"]
    finally:
        model.train(was_training)
    return Batch({"logprobs": out.cpu()})


class ActorRolloutWorker:
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
        engine: VLLMOptions | None = None,
    ):
        self.rank, self.world_size = rank, world_size
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
        self.ref_model = None
        if self.has_reference and cfg.lora is None:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if cfg.lora is not None:
            apply_lora(model, cfg.lora)
        # Sharded training needs a full copy for generation (see the module docstring).
        self.rollout_model = (
            copy.deepcopy(model).eval().requires_grad_(False) if world_size > 1 else None
        )
        # rollout.engine=vllm: a colocated vLLM engine generates, fed the weights after every
        # update (built before sharding, from the full initial weights).
        self.engine = (
            None
            if engine is None
            else VLLMEngine(model, tokenizer, engine, eos_ids=self.eos_ids, pad_id=pad_id)
        )
        self.weight_sync_s = 0.0
        self.model = model
        self.policy = shard(
            _PolicyForward(model, cfg.share_prompt_prefix, sharded=self.world_size > 1),
            list(_decoder_layers(model)),
        )
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps, cfg.min_lr_ratio),
        )
        self.loss_options = loss_options(cfg)
        self.sft_optimizer: torch.optim.Optimizer | None = None
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0

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
        engine: VLLMOptions | None = None,
    ):
        """Factory used by WorkerGroup: join the process group, then build the model in this process."""
        init_process_group(rank, world_size, pg_timeout_s)
        model, tok = spec.build()
        model.to(worker_device(rank))
        from groupflow.builders import eos_ids

        return cls(model, tok, cfg, total_steps=total_steps, pad_id=tok.pad_token_id, eos_ids=eos_ids(tok, model),
                   rank=rank, world_size=world_size, reference=reference, engine=engine)  # fmt: skip

    # ----- rollout ----------------------------------------------------------------------------
    @register("dp")
    def generate(self, prompts: Batch, params: SamplingParams, prompt_width: int = 0) -> Batch:
        """``params.n`` samples per prompt row (``prompt_token_ids``, ``seeds``, ``group_ids``).

        Output widths are fixed — prompts left-padded to ``prompt_width``, responses right-padded
        to ``params.max_new_tokens`` — so parts generated on different ranks concatenate.
        """
        model = self.rollout_model if self.rollout_model is not None else self.model
        return generate_batch(model, self.tokenizer, self.pad_id, self.eos_ids, prompts, params,
                              prompt_width, engine=self.engine)  # fmt: skip

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
        # Unsharded models only: the number of micro-batches may differ per rank (token budgets),
        # and a forward without gradients must not wait on collectives.
        model = self.rollout_model or self.model
        if reference and self.ref_model is not None:
            model = self.ref_model
        lora_off = reference and self.ref_model is None  # LoRA: the base model is the reference
        try:
            set_adapters(model, enabled=not lora_off)
            return batch_logprobs(model, batch, temperature, self.cfg, self.device)
        finally:
            set_adapters(model, enabled=True)

    # ----- update -----------------------------------------------------------------------------
    @register("dp")
    def update(
        self, batch: Batch, *, temperature: float, shuffle_seed: int | None = None
    ) -> dict[str, float]:
        """μ epochs over shuffled mini-batches; one optimizer step per mini-batch (all ranks in step)."""
        cfg = self.cfg
        batch = _drop_padding(batch.to(self.device))
        self.policy.train()
        n = len(batch)
        # mini_batch_samples counts samples over all ranks; each rank holds an equal share
        mb_size = max(1, (cfg.mini_batch_samples or n * self.world_size) // self.world_size)
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
        metrics = _combine_steps(per_step)
        metrics["actor/lr"] = lr
        if self.engine is not None:
            metrics["perf/weight_sync_s"] = self.weight_sync_s
        metrics["actor/nonfinite_skipped_total"] = float(self.nonfinite_total)
        return metrics

    def _optimizer_step(self, mini: Batch, temperature: float) -> dict[str, float]:
        cfg = self.cfg
        denominators = global_denominators(mini)
        rows = update_rows(mini, cfg)
        # Ratio/clip/entropy metrics average over the samples that are run (all, unless skipped).
        # (decided by config, not by this rank's rows: global_denominators is a collective)
        metric_denominators = (
            global_denominators(mini.index(rows)) if skips_zero_advantage(cfg) else denominators
        )
        lengths = _lengths(mini)
        groups = [
            [rows[j] for j in group]
            for group in micro_batches(
                [lengths[r] for r in rows], cfg.micro_batch_samples, cfg.micro_batch_tokens
            )
        ]
        # Every rank runs the same number of forward/backward passes (FSDP collectives), at least
        # one (so every parameter the forward touches gets a gradient, zero if need be, and AdamW
        # steps it exactly as when nothing is skipped): a rank with fewer micro-batches repeats
        # its last one, or row 0, with a zero mask (no loss, no gradient).
        n_micro = max(1, int(all_reduce(len(groups), op="max")))
        stats: dict[str, float] = {}
        self.optimizer.zero_grad(set_to_none=True)
        total_loss = 0.0
        for i in range(n_micro):
            mb = _trim(mini.index(groups[min(i, len(groups) - 1)] if groups else [0]))
            mask = mb["response_mask"] if i < len(groups) else torch.zeros_like(mb["response_mask"])
            loss, contrib = self._micro_loss(
                mb, mask, temperature, denominators, metric_denominators
            )
            for k, (v, w) in contrib.items():
                _accumulate(stats, k, v, w)
            # FSDP2 averages gradients over ranks; the losses already use global denominators.
            (loss * self.world_size).backward()
            total_loss += float(loss.detach())
        grad_norm = clip_grad_norm(list(self.policy.parameters()), cfg.grad_clip)
        # Same keys on every rank (see _micro_loss), reduced in a fixed order.
        stats = {k: all_reduce(stats[k], _REDUCE_OP.get(k, "sum")) for k in sorted(stats)}
        for k, neutral in (("actor/ratio_max", 1.0), ("actor/ratio_min", 1.0)):
            if k in stats and not math.isfinite(stats[k]):
                stats[k] = neutral  # no valid token anywhere
        total_loss = all_reduce(total_loss)
        stats["actor/grad_norm"] = grad_norm
        stats["actor/loss"] = total_loss
        if skips_zero_advantage(cfg):
            skipped = denominators["num_seqs"] - metric_denominators["num_seqs"]
            stats["actor/zero_adv_skipped"] = skipped / max(1, denominators["num_seqs"])
        if not (math.isfinite(total_loss) and math.isfinite(grad_norm)):
            self._skip_nonfinite()
            stats["actor/nonfinite_skipped"] = 1.0
            return stats
        self.nonfinite_in_a_row = 0
        self.optimizer.step()
        stats["actor/nonfinite_skipped"] = 0.0
        return stats

    def _micro_loss(self, mb: Batch, mask: torch.Tensor, temperature: float, denominators: dict,
                    metric_denominators: dict):  # fmt: skip
        """Loss of one micro-batch and its metric contributions {key: (value, weight)}."""
        cfg = self.cfg
        logp, entropy = self.policy(
            mb["prompt_ids"], mb["prompt_mask"], mb["responses"], mb["response_mask"],
            temperature, cfg.logprob_chunk_tokens, True,
        )  # fmt: skip
        old = mb["old_logprobs"] if "old_logprobs" in mb else logp.detach()
        tis = {}
        if cfg.tis_cap is not None:  # truncated IS against the rollout engine's log-probs
            tis = {"tis_cap": cfg.tis_cap, "rollout_logprobs": mb["rollout_logprobs"]}
        loss, pg_metrics = policy_loss(
            logp, old, mb["advantages"], mask, loss_fn=cfg.loss_fn, agg=cfg.loss_agg,
            **self.loss_options, **denominators, **tis,
        )  # fmt: skip
        # token weight of this micro-batch among the tokens the metrics cover
        share = float(mask.sum()) / max(1, metric_denominators["num_tokens"])
        ent = aggregate(entropy, mask, cfg.loss_agg, **metric_denominators)
        contrib = {
            "actor/pg_loss": (float(loss.detach()), 1.0),
            "actor/entropy": (float(ent.detach()), 1.0),
        }
        if cfg.entropy_coef:  # never with skipped samples: the metric's denominators are the loss's
            loss = loss - cfg.entropy_coef * ent
        if cfg.kl_coef > 0:
            if "ref_logprobs" not in mb:
                raise ValueError("actor.kl_coef > 0 but the batch has no 'ref_logprobs'")
            kl = aggregate(
                kl_penalty(logp, mb["ref_logprobs"], cfg.kl_kind),
                mask,
                cfg.loss_agg,
                **denominators,
            )
            contrib["actor/kl_loss"] = (float(kl.detach()), 1.0)
            loss = loss + cfg.kl_coef * kl
        has_tokens = bool(mask.sum() > 0)
        for k, v in pg_metrics.items():
            value = float(v)
            if not has_tokens and f"actor/{k}" in _EXTREMES:
                value = -math.inf if k.endswith("max") else math.inf  # ignored by max/min
            contrib[f"actor/{k}"] = (value, share)
        return loss, contrib

    def _skip_nonfinite(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_in_a_row += 1
        self.nonfinite_total += 1
        if self.nonfinite_in_a_row >= self.cfg.max_nonfinite_steps:
            raise NonFiniteLossError(
                f"{self.nonfinite_in_a_row} consecutive updates had a non-finite loss or gradient norm; "
                "lower actor.lr, check rewards/advantages for extreme values, or raise actor.max_nonfinite_steps"
            )

    def _sync_rollout_weights(self) -> None:
        """Refresh the unsharded generation copy and/or the vLLM engine from the current (FSDP:
        gathered) weights (a collective when sharded: all ranks call it)."""
        if self.rollout_model is None and self.engine is None:
            return
        start = time.perf_counter()
        full = {k.removeprefix("lm."): v for k, v in full_model_state(self.policy).items()}
        if self.rollout_model is not None:
            self.rollout_model.load_state_dict(full)
        if self.engine is not None:
            self.engine.load_weights(full.items())
        self.weight_sync_s = time.perf_counter() - start

    # ----- supervised warm start --------------------------------------------------------------
    @register("dp")
    def sft_step(self, batch: Batch, lr: float) -> float:
        """One cross-entropy step on (``prompt_token_ids``, ``target_ids``) rows; loss over target tokens."""
        if self.sft_optimizer is None:
            self.sft_optimizer = torch.optim.AdamW(self.policy.parameters(), lr=lr)
        prompt_ids, prompt_mask = left_pad(list(batch["prompt_token_ids"]), self.pad_id)
        targets = list(batch["target_ids"])
        width = int(all_reduce(max(len(t) for t in targets), op="max"))
        responses = torch.full((len(targets), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(responses)
        for i, t in enumerate(targets):
            responses[i, : len(t)] = torch.as_tensor(list(t))
            mask[i, : len(t)] = 1
        if PAD_KEY in batch:
            mask = mask * (~batch[PAD_KEY]).long()[:, None]
        prompt_ids, prompt_mask, responses, mask = (
            t.to(self.device) for t in (prompt_ids, prompt_mask, responses, mask)
        )
        self.policy.train()
        logp, _ = self.policy(
            prompt_ids, prompt_mask, responses, mask, 1.0, self.cfg.logprob_chunk_tokens, False
        )
        tokens = all_reduce(float(mask.sum()))
        loss = -(logp * mask).sum() / max(tokens, 1.0)
        self.sft_optimizer.zero_grad(set_to_none=True)
        (loss * self.world_size).backward()
        clip_grad_norm(list(self.policy.parameters()), 1.0)
        self.sft_optimizer.step()
        self._sync_rollout_weights()
        return all_reduce(float(loss.detach()))

    # ----- state ------------------------------------------------------------------------------
    @register("rank0")
    def state_dict(self) -> dict:
        if self.world_size > 1:
            raise RuntimeError("state_dict() is for one worker; sharded workers use save_sharded()")
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "nonfinite": [self.nonfinite_in_a_row, self.nonfinite_total],
        }

    @register("rank0")
    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.ref_model is not None and state.get("ref_model") is not None:  # older checkpoints
            self.ref_model.load_state_dict(state["ref_model"])
        self.nonfinite_in_a_row, self.nonfinite_total = state.get("nonfinite", [0, 0])
        self._sync_rollout_weights()

    @register("all")
    def load_full_state(self, state: dict) -> None:
        """Resume a single-worker checkpoint on any number of ranks: the full weights and the
        optimizer state (re-keyed from parameter indices to names) are sharded on load."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        names = [n for n, p in self.policy.named_parameters() if p.requires_grad]
        set_state_dict(
            self.policy,
            self.optimizer,
            model_state_dict={f"lm.{k}": v for k, v in state["model"].items()},
            optim_state_dict=optimizer_state_by_name(state["optimizer"], names),
            options=StateDictOptions(full_state_dict=True),
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self.nonfinite_in_a_row, self.nonfinite_total = state.get("nonfinite", [0, 0])
        self._sync_rollout_weights()

    @register("rank0")
    def train_state(self) -> dict:
        """The small, rank-identical part of the training state (schedule, guards)."""
        return {
            "scheduler": self.scheduler.state_dict(),
            "nonfinite": [self.nonfinite_in_a_row, self.nonfinite_total],
        }

    @register("rank0")
    def save_sharded(self, path: str) -> None:
        """Every rank writes its shards of model and optimizer (torch.distributed.checkpoint)."""
        save_sharded_state(self.policy, self.optimizer, path)

    @register("rank0")
    def load_sharded(self, path: str, train_state: dict | None = None) -> None:
        """Load a sharded checkpoint written by any number of ranks (DCP reshards on load)."""
        load_sharded_state(self.policy, self.optimizer, path)
        if train_state:
            self.scheduler.load_state_dict(train_state["scheduler"])
            self.nonfinite_in_a_row, self.nonfinite_total = train_state["nonfinite"]
        self._sync_rollout_weights()

    @register("all")
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load full (unsharded) policy weights, e.g. from a single-worker checkpoint."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(
            self.policy,
            {f"lm.{k}": v for k, v in weights.items()},
            options=StateDictOptions(full_state_dict=True),
        )
        self._sync_rollout_weights()

    @register("all")
    def reset_reference(self) -> None:
        """Make the current policy the reference (after a supervised warm start: RL starts there)."""
        if self.ref_model is None:
            return
        full = full_model_state(self.policy)
        self.ref_model.load_state_dict({k.removeprefix("lm."): v for k, v in full.items()})

    @register("rank0")
    def reference_weights(self) -> dict[str, torch.Tensor] | None:
        if self.ref_model is None:
            return None
        return {k: v.detach().cpu() for k, v in self.ref_model.state_dict().items()}

    @register("all")
    def load_reference(self, weights: dict[str, torch.Tensor]) -> None:
        if self.ref_model is not None:
            self.ref_model.load_state_dict(weights)

    @register("rank0")
    def save_pretrained(self, out_dir: str) -> None:
        """Write a plain HF directory (safetensors + config + tokenizer) from the (gathered) weights;
        LoRA adapters are merged into the base weights, so the directory needs no PEFT to load."""
        target = self._plain_model()
        if self.rank == 0:
            target.save_pretrained(out_dir, safe_serialization=True)
            self.tokenizer.save_pretrained(out_dir)

    @register("rank0")
    def full_weights(self) -> dict[str, torch.Tensor]:
        """The policy's full weights with plain HF names (LoRA merged), on rank 0 (a collective):
        for a rollout or reference pool, or to initialise a critic."""
        target = self._plain_model()
        return (
            {k: v.detach().cpu().clone() for k, v in target.state_dict().items()}
            if self.rank == 0
            else {}
        )

    def _plain_model(self) -> nn.Module | None:
        """An unsharded model with the current weights (LoRA merged) on rank 0; a collective."""
        full = full_model_state(self.policy)
        if self.rank != 0:
            return None
        target = self.model
        if self.rollout_model is not None:
            target = copy.deepcopy(self.rollout_model)
            target.load_state_dict({k.removeprefix("lm."): v for k, v in full.items()})
        return merged_lora_copy(target) if self.cfg.lora is not None else target


def apply_lora(model: nn.Module, lora) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place (PEFT) and freeze everything else.

    The model stays a plain HF model whose adapted Linear layers are LoRA layers, so generation,
    log-probs and FSDP see the same object as without LoRA. The adapters' random init (A; B is 0,
    so the policy starts equal to the base) uses a fixed seed outside the caller's RNG stream.
    """
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=lora.target_modules, bias="none",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            inject_adapter_in_model(config, model)
        except ValueError as e:  # PEFT's message does not name our config key
            raise ValueError(
                f"actor.lora.target_modules={lora.target_modules!r}: {e} Use names of "
                f"{type(model).__name__}'s Linear layers (e.g. q_proj, v_proj) or 'all-linear'"
            ) from e
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"actor.lora.target_modules={lora.target_modules!r} matched no module of "
            f"{type(model).__name__}; use names of its Linear layers (e.g. q_proj, v_proj) or 'all-linear'"
        )
    return model


def set_adapters(model: nn.Module, enabled: bool) -> None:
    """Switch every LoRA layer of ``model`` on or off (off: the base model); no-op without LoRA."""
    for module in model.modules():
        if hasattr(module, "enable_adapters") and hasattr(module, "base_layer"):
            module.enable_adapters(enabled)


def merged_lora_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with LoRA merged into the base weights and the LoRA layers removed."""
    out = copy.deepcopy(model)
    for name, module in list(out.named_modules()):
        if hasattr(module, "merge") and hasattr(module, "base_layer"):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(
                out.get_submodule(parent_name) if parent_name else out,
                child,
                module.get_base_layer(),
            )
    out.requires_grad_(True)
    return out


def optimizer_state_by_name(osd: dict, names: Sequence[str]) -> dict:
    """A ``torch.optim`` state dict keyed by parameter index, re-keyed by parameter name (the form
    ``torch.distributed.checkpoint.state_dict`` shards from); indices follow ``names``' order."""
    count = sum(len(g["params"]) for g in osd["param_groups"])
    if count != len(names):
        raise ValueError(
            f"the checkpoint's optimizer holds {count} parameters but the model has {len(names)}; "
            "was it written for a different model?"
        )
    return {
        "state": {names[i]: v for i, v in osd["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]
        ],
    }


def worker_device(rank: int) -> torch.device:
    """This worker's GPU (by local rank) when CUDA is available, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    import os

    local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _decoder_layers(model: nn.Module):
    """The transformer blocks of an HF causal LM (FSDP2 shards each as a unit)."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None)
    if layers is None:
        raise ValueError(f"cannot find the transformer layers of {type(model).__name__} to shard")
    return list(layers)
