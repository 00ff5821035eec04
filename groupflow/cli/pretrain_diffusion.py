"""``groupflow pretrain-diffusion``: the tiny flow model the diffusion demo fine-tunes.

Design decision: a command module of its own (the CLI's rule: one module per command, or per
group sharing their imports); the pre-training is ``groupflow.diffusion.pretrain``, this module
sets the thread count and reports the loss.
"""

from __future__ import annotations

import argparse

import torch

from groupflow.diffusion.pretrain import COLORS, pretrain_tiny_model

__all__ = ["pretrain_diffusion"]


def pretrain_diffusion(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    labels = args.labels.split(",") if args.labels else list(COLORS)
    _, stats = pretrain_tiny_model(args.out, labels=labels, steps=args.steps, seed=args.seed)
    print(
        f"tiny flow model written to {args.out} (loss {stats['pretrain/loss']:.4f}, "
        f"{stats['pretrain/seconds']:.1f} s)"
    )
    return 0
