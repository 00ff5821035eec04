"""Fused LM head + log-softmax + gather: per-token log-probs without keeping any logits.

Design decision: the update needs ``log p(y_t)`` for every response token, i.e. the LM head's
``[N, V]`` logits only through their log-sum-exp and one gathered entry. A custom autograd
function computes them chunk by chunk (``chunk`` positions at a time), keeping for backward only
the hidden states, the targets and the ``[N]`` log-normalisers; backward recomputes each chunk's
logits once and turns them in place into the logits' gradient, ``g · (onehot(y) - softmax)``,
which two matmuls take to the hidden states and the head's weight (the approach of Liger
Kernel's fused linear cross-entropy, written here in plain torch). Against the checkpointed
autograd path this saves the full-vocabulary tensors autograd would create and pass over
(division by the temperature, the log-softmax, its gradient), and at temperature 1 no division
happens at all. Entropy, when asked, is computed in the same pass without gradient (it is a
metric unless ``actor.entropy_coef`` is set; then the caller uses the autograd path). Values and
gradients equal the plain path's (tests/models/test_head_logprob.py).

Only a plain ``nn.Linear`` head without bias and a model without a final logit transform take
this path (``fusable_head``); anything else keeps the autograd path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["fusable_head", "fused_head_logprobs"]


def fusable_head(head: nn.Module | None, transform) -> bool:
    """Whether ``head`` is a bias-free ``nn.Linear`` (not a LoRA wrapper) without forward hooks,
    and no final logit transform (soft-capping, scaling) sits between it and the softmax."""
    return (
        transform is None
        and type(head) is nn.Linear  # a subclass (quantised, LoRA) may compute something else
        and head.bias is None
        # the fused path never calls the module, so a hook that changes its output (a user's
        # logit bias, an adapter library's) would be skipped
        and not head._forward_hooks
        and not head._forward_pre_hooks
    )


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, inv_temp: float) -> torch.Tensor:
    logits = F.linear(h, weight).float()  # the plain path's ``head(h).float()``
    if inv_temp != 1.0:
        logits.mul_(inv_temp)
    return logits


class _FusedHeadLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp: float, chunk: int, want_entropy: bool):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        logz = torch.empty_like(logp)
        ent = torch.zeros_like(logp)
        for s in range(0, n, chunk):
            logits = _chunk_logits(hidden[s : s + chunk], weight, inv_temp)
            lz = torch.logsumexp(logits, dim=-1)
            logz[s : s + chunk] = lz
            logp[s : s + chunk] = logits.gather(-1, targets[s : s + chunk, None]).squeeze(-1) - lz
            if want_entropy:  # H = -sum p log p, with log p = logits - lz (in place)
                logq = logits.sub_(lz[:, None])
                ent[s : s + chunk] = -(logq.exp() * logq).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, logz)
        ctx.inv_temp, ctx.chunk = inv_temp, chunk
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):
        hidden, weight, targets, logz = ctx.saved_tensors
        inv_temp, chunk = ctx.inv_temp, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        )
        grad_logp = grad_logp.float()
        for s in range(0, hidden.shape[0], chunk):
            h, g = hidden[s : s + chunk], grad_logp[s : s + chunk]
            # softmax in place, then d logp_y / d logits = onehot(y) - p, times g and 1/T
            p = _chunk_logits(h, weight, inv_temp).sub_(logz[s : s + chunk, None]).exp_()
            grad = p.mul_(-g[:, None])
            grad.scatter_add_(-1, targets[s : s + chunk, None], g[:, None])
            if inv_temp != 1.0:
                grad.mul_(inv_temp)
            grad = grad.to(hidden.dtype)
            if grad_h is not None:  # need_h
                grad_h[s : s + chunk] = grad @ weight
            if grad_w is not None:  # need_w
                grad_w.addmm_(grad.t().float(), h.float())
        return (
            grad_h,
            (grad_w.to(weight.dtype) if grad_w is not None else None),
            None,
            None,
            None,
            None,
        )


def fused_head_logprobs(
    hidden: torch.Tensor,
    head: nn.Linear,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[..., ]`` of ``targets`` under ``softmax(head(hidden) / temperature)``, and the
    entropy (no gradient) when asked; ``hidden`` is ``[..., H]``, ``targets`` ``[...]``."""
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    inv_temp = 1.0 if temperature in (0, 1) else 1.0 / temperature
    logp, ent = _FusedHeadLogprob.apply(h, head.weight, y, inv_temp, max(1, chunk), with_entropy)
    return logp.view(lead), (ent.view(lead) if with_entropy else None)
