"""Supervised warm start: a few cross-entropy steps on (prompt, answer) pairs before RL.

Design decision: RL needs a policy that is right *sometimes* — with zero successes every group
has equal rewards and GRPO has no signal. The demo therefore starts with a short supervised phase
on training answers only, and stops early once accuracy on a slice of *training* prompts passes
``max_accuracy`` (the held-out set is never used here, so the before/after numbers stay honest).
"""

from __future__ import annotations

import logging
import random
from dataclasses import replace

from groupflow.batch import Batch
from groupflow.config import SFTConfig

log = logging.getLogger("groupflow")

__all__ = ["warm_start"]


def warm_start(
    actor,
    tokenizer,
    encoded,
    reward_fn,
    sampling,
    cfg: SFTConfig,
    seed: int,
    target_field: str = "answer",
    rollout=None,
    sync=None,
):
    """Run up to ``cfg.steps`` SFT steps; returns metrics (steps run, last loss, probe accuracy).

    ``rollout`` generates the probe (default: the actor); ``sync`` first pushes the actor's weights
    to it when it is placed apart from the actor."""
    from groupflow.evaluation import _accuracy_metrics, generate_and_score

    pairs = []
    for row, ids in zip(encoded.rows, encoded.ids):
        if target_field not in row.fields:
            raise ValueError(
                f"sft: row {row.index} of {row.source} has no '{target_field}' field to use as the SFT target"
            )
        target = tokenizer(str(row.fields[target_field]), add_special_tokens=False)["input_ids"]
        pairs.append((ids, target + [tokenizer.eos_token_id]))
    rng = random.Random(seed)
    probe = _probe(encoded, 128, seed)
    greedy = replace(sampling, temperature=0.0, n=1)
    loss, acc, step = float("nan"), 0.0, 0
    for step in range(1, cfg.steps + 1):
        chosen = [pairs[rng.randrange(len(pairs))] for _ in range(cfg.batch_samples)]
        batch = Batch(
            non_tensors={
                "prompt_token_ids": [p for p, _ in chosen],
                "target_ids": [t for _, t in chosen],
            }
        )
        loss = actor.sft_step(batch, cfg.lr)
        if cfg.stop_at_accuracy is not None and step % cfg.check_every == 0:
            if sync is not None:
                sync()
            recs = generate_and_score(rollout or actor, tokenizer, probe, reward_fn, greedy, seed)
            acc = _accuracy_metrics(recs, "p", 1, 1.0)["p/acc"]
            if acc >= cfg.stop_at_accuracy:
                break
    log.info("sft warm start: %d steps, loss %.3f, train-probe accuracy %.3f", step, loss, acc)
    return {"sft/steps": float(step), "sft/loss": loss, "sft/probe_acc": acc}


def _probe(encoded, n: int, seed: int):
    """A fixed slice of training prompts used to decide when to stop the warm start."""
    idx = random.Random(seed + 1).sample(range(len(encoded.rows)), min(n, len(encoded.rows)))
    return replace(
        encoded,
        rows=[encoded.rows[i] for i in idx],
        texts=[encoded.texts[i] for i in idx],
        ids=[encoded.ids[i] for i in idx],
    )
