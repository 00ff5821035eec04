"""Optimizer hyper-parameters after a resume: this run's config, not the checkpoint's.

Design decision: ``optimizer.load_state_dict`` brings back the checkpoint's LR, betas and weight
decay, and ``LambdaLR.load_state_dict`` its base LR, so a resume would silently train with the old
values even where ``run.allow_config_changes`` accepted new ones. Every worker therefore re-applies
the values it was constructed with (``optimizer.defaults``) after loading, and recomputes the
current LR from the schedule at the restored step with LambdaLR's own formula: with an unchanged
config the values are bit-identical, so an exact resume stays exact.
"""

from __future__ import annotations

import torch

__all__ = ["apply_configured_hyperparameters"]


def apply_configured_hyperparameters(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR
) -> None:
    """Set LR (base and current), betas and weight decay of every param group from the values
    ``optimizer`` was built with; call after loading optimizer and scheduler state."""
    d = optimizer.defaults
    scheduler.base_lrs = [d["lr"]] * len(optimizer.param_groups)
    for group, lmbda in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = d["lr"]
        group["lr"] = d["lr"] * lmbda(scheduler.last_epoch)
        for key in ("betas", "weight_decay"):
            if key in d:
                group[key] = d[key]
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
