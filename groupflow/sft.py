"""Supervised warm start: a few cross-entropy steps on demonstrations before RL.

Design decision: RL needs a policy that is right *sometimes* — with zero successes every group
has equal rewards and GRPO has no signal. The demos therefore start with a short supervised phase
on training rows only, and stop early once accuracy on a slice of *training* prompts passes
``stop_at_accuracy`` (the held-out set is never used here, so the before/after numbers stay
honest). The workflow supplies the demonstrations as token ids — a single-turn target, or a
multi-turn trajectory whose observation tokens are masked out — and the probe, which runs the
workflow's own episodes, so a tool-using policy is probed with its tools.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from groupflow.batch import Batch
from groupflow.config import SFTConfig
from groupflow.evaluation import accuracy

log = logging.getLogger("groupflow")

__all__ = ["warm_start"]

# (prompt ids, target ids, target loss mask or None: every target token is trained), optionally
# followed by the prompt's images (``models.vision.VisionInputs`` or None)
Example = tuple


def warm_start(
    learner,
    make_examples: Callable[[object], list[Example]],
    probe: Callable[[Any], list[dict]],  # given a split of the caller's own type
    train,
    cfg: SFTConfig,
    seed: int,
    sync: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Run up to ``cfg.steps`` SFT steps on ``make_examples(train)``; returns metrics (steps run,
    last loss, probe accuracy). ``learner``: what trains (``sft_step(batch, lr) -> loss``; the
    policy, or an actor group). ``probe(prompts) -> records`` scores greedy episodes; ``sync``
    first pushes the actor's weights to a rollout pool placed apart from it."""
    examples = make_examples(train)
    rng = random.Random(seed)
    probe_set = _probe(train, cfg.probe_prompts, seed)
    loss, acc, step = float("nan"), 0.0, 0
    for step in range(1, cfg.steps + 1):
        chosen = [examples[rng.randrange(len(examples))] for _ in range(cfg.batch_samples)]
        objects = {
            "prompt_token_ids": [e[0] for e in chosen],
            "target_ids": [e[1] for e in chosen],
            "target_mask": [e[2] if e[2] is not None else [1] * len(e[1]) for e in chosen],
        }
        images = [e[3] if len(e) > 3 else None for e in chosen]
        if any(v is not None for v in images):
            objects["vision"] = images
        batch = Batch(non_tensors=objects)
        loss = learner.sft_step(batch, cfg.lr)
        if cfg.stop_at_accuracy is not None and step % cfg.check_every == 0:
            if sync is not None:
                sync()
            acc = accuracy(probe(probe_set))
            if acc >= cfg.stop_at_accuracy:
                break
    log.info("sft warm start: %d steps, loss %.3f, train-probe accuracy %.3f", step, loss, acc)
    return {"sft/steps": float(step), "sft/loss": loss, "sft/probe_acc": acc}


def _probe(encoded, n: int, seed: int):
    """A fixed slice of training prompts used to decide when to stop the warm start."""
    idx = random.Random(seed + 1).sample(range(len(encoded.rows)), min(n, len(encoded.rows)))
    if hasattr(encoded, "subset"):  # assembly.data.EncodedPrompts: its images follow the rows
        return encoded.subset(idx)
    return replace(
        encoded,
        rows=[encoded.rows[i] for i in idx],
        texts=[encoded.texts[i] for i in idx],
        ids=[encoded.ids[i] for i in idx],
    )
