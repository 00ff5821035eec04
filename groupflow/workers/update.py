"""The update loop's bookkeeping, shared by the actor, critic and diffusion workers: micro-batches,
trimmed widths, global loss denominators, which rows run, metric accumulation, and log-probs of a
batch under an unsharded model or, in lockstep across ranks, under an FSDP2-sharded one.

Design decision: everything here is a plain function of a Batch (and the config), so the three
workers run one mini-batch / micro-batch scheme with the same denominators — the gradient depends
neither on micro-batching nor on the number of ranks (algorithms.md §3) — and it is tested once.
``response_mask`` marks actions and may have gaps (tool/observation tokens): widths, attention
and budgets reach to each response's last action (``groupflow.algorithms.masks``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from groupflow.algorithms import (
    loss_denominators,
    prompt_widths,
    response_widths,
    zero_advantage_inert,
)
from groupflow.batch import Batch
from groupflow.config import ActorConfig
from groupflow.distributed import PAD_KEY
from groupflow.distributed.parallel import all_reduce
from groupflow.distributed.ulysses import SequenceGroup
from groupflow.models.logprobs import response_logprobs
from groupflow.models.packing import packed_logprobs
from groupflow.models.sequence_parallel import sequence_parallel_logprobs
from groupflow.workers.packing import consecutive_groups, packed_micro_batches

__all__ = [
    "micro_batches",
    "sample_tokens",
    "forward_groups",
    "accumulate",
    "reduce_stats",
    "combine_steps",
    "row_widths",
    "trim",
    "global_denominators",
    "skips_zero_advantage",
    "update_rows",
    "drop_padding",
    "batch_logprobs",
    "lockstep_logprobs",
    "EXTREMES",
    "REDUCE_OP",
]


def check_text_only(vision) -> None:
    """Sequence parallelism splits token sequences; image rows are not implemented for it."""
    if vision is not None and any(v is not None for v in vision):
        raise ValueError(
            "parallel.sequence_parallel > 1 does not support prompts with images yet; "
            "set parallel.sequence_parallel: 1 for a vision-language model"
        )


def check_no_images(vision) -> None:
    """Packed forwards concatenate token sequences; image rows take the padded forward."""
    if vision is not None and any(v is not None for v in vision):
        raise ValueError(
            "actor.packing does not support prompts with images; set actor.packing: false for a "
            "vision-language model"
        )


def micro_batches(
    lengths: Sequence[int | tuple[int, int]], max_samples: int | None, max_tokens: int | None
) -> list[list[int]]:
    """Consecutive index groups: by sample count, or packed greedily under a token budget.

    ``lengths`` are per-sample token counts, or (prompt, response) pairs: a trimmed micro-batch is
    padded to its longest prompt plus its longest response, so that is the width charged against
    the budget. A single sample longer than the budget gets a micro-batch of its own.
    """
    if max_tokens is None:
        return consecutive_groups(len(lengths), max_samples)
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


def sample_tokens(batch: Batch) -> list[int]:
    """Tokens each sample puts in a packed row: its attended prompt tokens and its response up to
    its last action (``models.packing.pack``)."""
    prompts = (batch["prompt_mask"] != 0).sum(1)
    return (prompts + response_widths(batch["response_mask"])).tolist()


def forward_groups(batch: Batch, cfg, rows: Sequence[int] | None = None, *,
                   section: str = "actor") -> list[list[int]]:  # fmt: skip
    """The micro-batches (lists of row indices into ``batch``) of ``rows`` (None: all rows, in
    order) under ``cfg`` (``ActorConfig`` or ``CriticConfig``): budgeted by padded width, or with
    ``cfg.packing`` by real tokens (``workers.packing.packed_micro_batches``; a sample over the
    budget is an error naming its uid and ``<section>.micro_batch_tokens``)."""
    rows = list(range(len(batch))) if rows is None else list(rows)
    if getattr(cfg, "packing", False):
        lengths = sample_tokens(batch)
        uids = list(batch["uid"]) if "uid" in batch else None
        groups = packed_micro_batches(
            [lengths[r] for r in rows], cfg.micro_batch_tokens, cfg.micro_batch_samples,
            key=f"{section}.micro_batch_tokens",
            names=None if uids is None else [uids[r] for r in rows],
        )  # fmt: skip
    else:
        widths = row_widths(batch)
        groups = micro_batches(
            [widths[r] for r in rows], cfg.micro_batch_samples, cfg.micro_batch_tokens
        )
    return [[rows[j] for j in g] for g in groups]


# Metrics that are extremes combine by max/min; the rest are sums of micro-batch contributions
# (losses with global denominators, token-weighted means) and means over optimizer steps.
EXTREMES = {"actor/ratio_max": max, "actor/ratio_min": min, "rollout/logprob_diff_max": max}
REDUCE_OP = {"actor/ratio_max": "max", "actor/ratio_min": "min", "rollout/logprob_diff_max": "max"}


def accumulate(stats: dict[str, float], key: str, value: float, weight: float = 1.0) -> None:
    op = EXTREMES.get(key)
    if op is not None:
        stats[key] = op(stats[key], value) if key in stats else value
    else:
        stats[key] = stats.get(key, 0.0) + value * weight


def reduce_stats(stats: dict[str, float], replicas: int = 1) -> dict[str, float]:
    """``accumulate``d micro-batch stats summed (extremes: max/min) over ranks, in a fixed key
    order (a collective: every rank holds the same keys and calls it). A sum counts each sample
    once per rank holding it, so it is divided by ``replicas`` (sequence parallelism: the group
    size)."""
    out = {k: all_reduce(stats[k], REDUCE_OP.get(k, "sum")) for k in sorted(stats)}
    return {k: v if k in REDUCE_OP else v / replicas for k, v in out.items()}


def combine_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for s in steps for k in s):
        values = [s[key] for s in steps if key in s]
        op = EXTREMES.get(key)
        out[key] = op(values) if op is not None else sum(values) / len(values)
    return out


def row_widths(batch: Batch) -> list[tuple[int, int]]:
    """(prompt, response) widths per sample: the columns a trimmed forward keeps for it. A response
    reaches to its last action, gaps included (``groupflow.algorithms.masks``)."""
    return list(
        zip(
            prompt_widths(batch["prompt_mask"]).tolist(),
            response_widths(batch["response_mask"]).tolist(),
        )
    )


def trim(batch: Batch) -> Batch:
    """Drop all-padding columns (left of prompts, right of responses) to save compute. A response
    keeps every column up to its last action: a gap (mask 0 between actions) is not padding."""
    pm, rm = batch["prompt_mask"], batch["response_mask"]
    p_keep = int(prompt_widths(pm).max())
    t_keep = max(1, int(response_widths(rm).max()))
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


def global_denominators(
    mini: Batch, groups: Sequence[Sequence[int]] | None = None, replicas: int = 1
) -> dict[str, int]:
    """Loss denominators of a whole mini-batch summed over ranks (algorithms.md §3), so the
    gradient depends neither on micro-batching nor on the number of ranks; dispatch padding rows
    (zero masks) count as no tokens and no sequences. A collective: every rank calls it.

    ``groups`` are this rank's micro-batches (row indices into ``mini``; None: one of all rows).
    ``num_micro_batches`` counts those with a real row on all ranks: ``local_token_mean`` divides
    each micro-batch's token mean by it (TRL's division by the accumulation steps, with DDP's mean
    over ranks), and the zero-mask passes that keep ranks in step do not count.

    ``replicas``: how many ranks hold each row (sequence parallelism: the group size); the sums
    count each row once.
    """
    local = loss_denominators(mini["response_mask"])
    real = ~mini[PAD_KEY].cpu() if PAD_KEY in mini else torch.ones(len(mini), dtype=torch.bool)
    groups = [range(len(mini))] if groups is None else groups
    micro = sum(1 for g in groups if bool(real[list(g)].any()))
    return {
        "num_tokens": int(all_reduce(local["num_tokens"])) // replicas,
        "num_seqs": int(all_reduce(int(real.sum()))) // replicas,
        "max_len": int(all_reduce(local["max_len"], op="max")),
        "num_micro_batches": int(all_reduce(micro)) // replicas,
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


def drop_padding(batch: Batch) -> Batch:
    """Zero the masks of dispatch padding so those samples count nowhere (losses, denominators)."""
    if PAD_KEY not in batch:
        return batch
    out = batch.copy()
    keep = (~batch[PAD_KEY]).to(batch["response_mask"].dtype)[:, None]
    out["response_mask"] = batch["response_mask"] * keep
    return out


@torch.no_grad()
def batch_logprobs(model: nn.Module, batch: Batch, temperature: float, cfg: ActorConfig,
                   device: torch.device, sp: SequenceGroup | None = None) -> Batch:  # fmt: skip
    """``logprobs`` [B, T] of the batch's responses under an unsharded ``model``; 0 where masked.
    ``sp``: a sequence-parallel group whose members all hold ``batch`` (a collective there)."""
    batch = batch.to(device)
    was_training = model.training
    model.eval()
    out = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    try:
        for idx in forward_groups(batch, cfg):
            mb = trim(batch.index(idx))
            rows = mb["prompt_ids"], mb["prompt_mask"], mb["responses"], mb["response_mask"]
            vision = list(mb["vision"]) if "vision" in mb else None
            if cfg.packing:
                check_no_images(vision)
                lp, _ = packed_logprobs(
                    model, *rows, temperature=temperature, chunk_tokens=cfg.logprob_chunk_tokens
                )
            elif sp is not None:
                check_text_only(vision)
                lp, _ = sequence_parallel_logprobs(
                    model, *rows, sp, temperature=temperature, chunk_tokens=cfg.logprob_chunk_tokens
                )
            else:
                lp, _ = response_logprobs(
                    model, *rows, temperature=temperature, chunk_tokens=cfg.logprob_chunk_tokens,
                    share_prompt=cfg.share_prompt_prefix, vision=vision,
                )  # fmt: skip
            out[idx, : lp.shape[1]] = lp * mb["response_mask"]
    finally:
        model.train(was_training)
    return Batch({"logprobs": out.cpu()})


def lockstep_logprobs(forward: nn.Module, batch: Batch, temperature: float, cfg: ActorConfig,
                      device: torch.device) -> Batch:  # fmt: skip
    """``logprobs`` [B, T] like ``batch_logprobs``, through an FSDP2-sharded ``forward``
    (``workers.policy_forward.PolicyForward``: ``forward(prompt_ids, prompt_mask, responses,
    response_mask, temperature, chunk_tokens, with_entropy, entropy_grad, vision) -> (logp,
    entropy)``).

    A collective: each layer's parameters are all-gathered once per forward, so every rank must
    run the same number of forwards whatever its rows and token budget — a rank with fewer
    micro-batches repeats its last one and discards the result. Afterwards the root's parameters
    (embeddings, final norm, head), which FSDP2 keeps gathered after a forward for the backward
    that follows in training, are freed again: no backward follows here.
    """
    batch = batch.to(device)
    was_training = forward.training
    forward.eval()
    out = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    groups = forward_groups(batch, cfg)
    n_micro = max(1, int(all_reduce(len(groups), op="max")))
    try:
        for i in range(n_micro):
            idx = groups[min(i, len(groups) - 1)]
            mb = trim(batch.index(idx))
            vision = list(mb["vision"]) if "vision" in mb else None
            lp, _ = forward(
                mb["prompt_ids"], mb["prompt_mask"], mb["responses"], mb["response_mask"],
                temperature, cfg.logprob_chunk_tokens, False, False, vision,
            )  # fmt: skip
            if i < len(groups):  # a repeat only keeps the ranks' collectives in step
                out[idx, : lp.shape[1]] = lp * mb["response_mask"]
    finally:
        forward.train(was_training)
        if callable(reshard := getattr(forward, "reshard", None)):  # FSDP2's root: free its
            reshard()  # gathered parameters
    return Batch({"logprobs": out.cpu()})
