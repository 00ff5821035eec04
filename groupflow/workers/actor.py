"""The actor-rollout worker: one object holding the policy, its optimizer and the rollout engine.

Design decision: colocation, as in verl's ActorRolloutRefWorker — generation, log-prob
recomputation, the reference model and the update live in one worker, so weights are never copied
between a "trainer" and a "generator". The driver never touches tensors math: it calls
``generate``, ``compute_logprobs`` and ``update`` with Batches. The update follows algorithms.md:
μ epochs × mini-batches (one optimizer step each) × micro-batches (gradient accumulation), with
loss denominators computed once per mini-batch so the gradient does not depend on how the
mini-batch is cut into micro-batches.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from torch import nn

from groupflow.algorithms import (
    POLICY_LOSSES,
    aggregate,
    kl_penalty,
    loss_denominators,
    policy_loss,
)
from groupflow.algorithms.registry import option_names
from groupflow.batch import Batch
from groupflow.config import ActorConfig
from groupflow.models.logprobs import response_logprobs
from groupflow.rollout.hf import GenerationOutput, SamplingParams, generate

__all__ = ["ActorRolloutWorker", "NonFiniteLossError", "lr_lambda", "micro_batches"]


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
    for k in ("responses", "response_mask", "old_logprobs", "ref_logprobs", "rollout_logprobs"):
        if k in batch.tensors:
            out[k] = batch[k][:, :t_keep]
    if "advantages" in batch.tensors and batch["advantages"].dim() == 2:
        out["advantages"] = batch["advantages"][:, :t_keep]
    return out


class ActorRolloutWorker:
    """Policy + optional frozen reference + AdamW + LR schedule + HF rollout engine."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        cfg: ActorConfig,
        *,
        total_steps: int,
        pad_id: int,
        eos_ids: Sequence[int],
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.pad_id, self.eos_ids = pad_id, list(eos_ids)
        # β = 0 never builds a reference model (algorithms.md §4).
        self.ref_model = None
        if cfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps, cfg.min_lr_ratio),
        )
        self.loss_options = loss_options(cfg)
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0

    # ----- rollout ----------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> GenerationOutput:
        return generate(
            self.model,
            prompts,
            params,
            seeds=seeds,
            pad_id=self.pad_id,
            eos_ids=self.eos_ids,
            tokenizer=self.tokenizer,
        )

    # ----- log-probs --------------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(
        self, batch: Batch, *, temperature: float, reference: bool = False
    ) -> torch.Tensor:
        """Log-probs [B, T] of the batch's responses (policy or reference), 0 where masked."""
        model = self.ref_model if reference else self.model
        if model is None:
            raise RuntimeError(
                "compute_logprobs(reference=True) needs actor.kl_coef > 0 (no reference model)"
            )
        was_training = model.training
        model.eval()
        out = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
        lengths = _lengths(batch)
        try:
            for idx in micro_batches(
                lengths, self.cfg.micro_batch_samples, self.cfg.micro_batch_tokens
            ):
                mb = _trim(batch.index(idx))
                lp, _ = response_logprobs(
                    model,
                    mb["prompt_ids"],
                    mb["prompt_mask"],
                    mb["responses"],
                    mb["response_mask"],
                    temperature=temperature,
                    chunk_tokens=self.cfg.logprob_chunk_tokens,
                )
                out[idx, : lp.shape[1]] = lp * mb["response_mask"]
        finally:
            model.train(was_training)
        return out

    # ----- update -----------------------------------------------------------------------------
    def update(
        self, batch: Batch, *, temperature: float, generator: torch.Generator | None = None
    ) -> dict[str, float]:
        """μ epochs over shuffled mini-batches; one optimizer step per mini-batch."""
        cfg = self.cfg
        self.model.train()
        n = len(batch)
        mb_size = cfg.mini_batch_samples or n
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
        metrics = _combine_steps(per_step)
        metrics["actor/lr"] = lr
        metrics["actor/nonfinite_skipped_total"] = float(self.nonfinite_total)
        return metrics

    def _optimizer_step(self, mini: Batch, temperature: float) -> dict[str, float]:
        cfg = self.cfg
        denominators = loss_denominators(mini["response_mask"])
        lengths = _lengths(mini)
        stats: dict[str, float] = {}
        want_entropy = True  # logged every step; the cost is one logsumexp per chunk
        self.optimizer.zero_grad(set_to_none=True)
        total_loss = 0.0
        for idx in micro_batches(lengths, cfg.micro_batch_samples, cfg.micro_batch_tokens):
            mb = _trim(mini.index(idx))
            mask = mb["response_mask"]
            logp, entropy = response_logprobs(
                self.model,
                mb["prompt_ids"],
                mb["prompt_mask"],
                mb["responses"],
                mask,
                temperature=temperature,
                chunk_tokens=cfg.logprob_chunk_tokens,
                with_entropy=want_entropy,
            )
            old = mb["old_logprobs"] if "old_logprobs" in mb else logp.detach()
            loss, pg_metrics = policy_loss(
                logp,
                old,
                mb["advantages"],
                mask,
                loss_fn=cfg.loss_fn,
                agg=cfg.loss_agg,
                **self.loss_options,
                **denominators,
            )
            share = float(mask.sum()) / max(
                1, denominators["num_tokens"]
            )  # token weight of this micro-batch
            _accumulate(stats, "actor/pg_loss", float(loss.detach()))
            ent = aggregate(entropy, mask, cfg.loss_agg, **denominators)
            _accumulate(stats, "actor/entropy", float(ent.detach()))
            if cfg.entropy_coef:
                loss = loss - cfg.entropy_coef * ent
            if self.ref_model is not None:
                kl = aggregate(
                    kl_penalty(logp, mb["ref_logprobs"], cfg.kl_kind),
                    mask,
                    cfg.loss_agg,
                    **denominators,
                )
                _accumulate(stats, "actor/kl_loss", float(kl.detach()))
                loss = loss + cfg.kl_coef * kl
            for k, v in pg_metrics.items():
                _accumulate(stats, f"actor/{k}", float(v), share)
            loss.backward()
            total_loss += float(loss.detach())
        grad_norm = self._clip_grad()
        stats["actor/grad_norm"] = grad_norm
        stats["actor/loss"] = total_loss
        if not (math.isfinite(total_loss) and math.isfinite(grad_norm)):
            self._skip_nonfinite()
            stats["actor/nonfinite_skipped"] = 1.0
            return dict(stats)
        self.nonfinite_in_a_row = 0
        self.optimizer.step()
        stats["actor/nonfinite_skipped"] = 0.0
        return dict(stats)

    def _clip_grad(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip is not None else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def _skip_nonfinite(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_in_a_row += 1
        self.nonfinite_total += 1
        if self.nonfinite_in_a_row >= self.cfg.max_nonfinite_steps:
            raise NonFiniteLossError(
                f"{self.nonfinite_in_a_row} consecutive updates had a non-finite loss or gradient norm; "
                "lower actor.lr, check rewards/advantages for extreme values, or raise actor.max_nonfinite_steps"
            )

    # ----- supervised warm start --------------------------------------------------------------
    def sft_step(
        self, prompts: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], optimizer
    ) -> float:
        """One cross-entropy step on (prompt, target) token pairs; loss over target tokens only."""
        from groupflow.rollout.hf import left_pad

        prompt_ids, prompt_mask = left_pad(prompts, self.pad_id)
        width = max(len(t) for t in targets)
        responses = torch.full((len(targets), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(responses)
        for i, t in enumerate(targets):
            responses[i, : len(t)] = torch.as_tensor(list(t))
            mask[i, : len(t)] = 1
        self.model.train()
        logp, _ = response_logprobs(
            self.model,
            prompt_ids,
            prompt_mask,
            responses,
            mask,
            chunk_tokens=self.cfg.logprob_chunk_tokens,
        )
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        optimizer.step()
        return float(loss.detach())

    # ----- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "ref_model": None if self.ref_model is None else self.ref_model.state_dict(),
            "nonfinite": [self.nonfinite_in_a_row, self.nonfinite_total],
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.ref_model is not None and state.get("ref_model") is not None:
            self.ref_model.load_state_dict(state["ref_model"])
        self.nonfinite_in_a_row, self.nonfinite_total = state.get("nonfinite", [0, 0])
