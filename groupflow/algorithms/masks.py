"""Response masks with gaps: which response tokens are actions, and how far a response reaches.

Design decision: ``response_mask`` marks *actions* — tokens the policy produced and is trained on —
not the extent of the sequence. A multi-turn rollout puts tool/observation tokens inside a response
with mask 0 (a gap, e.g. ``1 1 0 0 1 1 1``): the model attends to them like any other token, but
they carry no loss, no KL, no entropy and no advantage, and they are not time steps of GAE. So:

* a response's *width* (the columns a forward pass must keep) is its last action + 1, never its
  number of actions (``response_widths``);
* the *attention* over a response covers every column up to and including its last action
  (``response_span``): gap tokens are attended, padding after the last action is not — no action
  can see past the last one, so nothing after it changes a log-prob or a value;
* counts of actions (loss denominators, ``response_length`` metrics, per-sample token means) are
  sums of the mask, as before.

A padding token inside a span is therefore not expressible: every column before a response's last
action is part of the sequence.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["last_valid_index", "response_span", "response_widths", "prompt_widths"]


def check_2d(name: str, t) -> None:
    if not isinstance(t, Tensor) or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [B, T], got {getattr(t, 'shape', t)!r}")


def last_valid_index(mask: Tensor) -> Tensor:
    """[B] index of the last non-zero entry of each row of mask [B, T]; -1 for an empty row."""
    check_2d("mask", mask)
    if mask.shape[1] == 0:
        return torch.full((mask.shape[0],), -1, dtype=torch.long, device=mask.device)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask != 0, positions, -1).amax(dim=1)


def response_widths(mask: Tensor) -> Tensor:
    """[B] columns each response occupies: last action + 1 (0 for a row without actions)."""
    return last_valid_index(mask) + 1


def response_span(mask: Tensor) -> Tensor:
    """The attention mask of right-padded responses [B, T] (dtype of ``mask``): 1 on every column
    up to and including the row's last action, gaps included; 0 on the padding after it."""
    check_2d("response_mask", mask)
    columns = torch.arange(mask.shape[1], device=mask.device)
    return (columns[None, :] < response_widths(mask)[:, None]).to(mask.dtype)


def prompt_widths(mask: Tensor) -> Tensor:
    """[B] columns each left-padded prompt occupies: its first token to the end (0 if empty)."""
    check_2d("prompt_mask", mask)
    width = mask.shape[1]
    if width == 0:
        return torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    positions = torch.arange(width, device=mask.device).expand_as(mask)
    first = torch.where(mask != 0, positions, width).amin(dim=1)
    return width - first
