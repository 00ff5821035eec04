"""Per-token log-probs (and entropy) of responses under a causal LM, chunked over tokens.

Design decision: get the decoder's hidden states for the responses, then apply the LM head to a
few rows of hidden states at a time, so at most ``chunk_tokens × V`` logits exist at
once instead of ``B × T × V``. Under autograd each chunk is checkpointed: its logits are recomputed
in backward rather than kept, which is what makes a 150k-vocabulary model fit on small hardware.
The hidden states come from one decoder pass over [prompt | response], or — when rows repeat a
prompt, as GRPO's G samples do — from one pass over the distinct prompts whose K/V are shared by
their rows, then one pass over the responses (``share_prompt``; exact, see
``causal_lm.response_hidden_states``): the prompt is encoded once per group, not G times.
The LM head's output goes through the model's own final transform (Gemma2's soft-capping,
Granite's logits_scaling, ...: ``models/logit_transform``), then is divided by the sampling
temperature (not at 1) and never truncated by top-k/top-p (algorithms.md §5), matching what the
rollout engine records. A plain linear head with no transform takes the fused path
(``models/head_logprob``: no logits kept for backward, fewer passes over them); the entropy is a
metric computed without gradient unless ``entropy_grad`` (``actor.entropy_coef`` > 0), which takes
the checkpointed autograd path.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from groupflow.algorithms import entropy_from_logits
from groupflow.models.causal_lm import hf_model, response_hidden_states
from groupflow.models.head_logprob import fusable_head, fused_head_logprobs
from groupflow.models.logit_transform import logit_transform

__all__ = ["response_logprobs", "hidden_logprobs", "FUSED_CHUNK_TOKENS"]

# Positions per chunk of the fused head: 1024 × a 49k vocabulary is 200 MB of fp32 logits at a
# time (actor.logprob_chunk_tokens, when smaller, wins).
FUSED_CHUNK_TOKENS = 1024


def _chunk_stats(
    head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    want_entropy: bool,
    transform,
    entropy_grad: bool = True,
):
    logits = head(hidden)
    logits = (logits if transform is None else transform(logits)).float()
    if temperature != 1.0:
        logits = logits / temperature
    logz = logits.logsumexp(-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    if not want_entropy:
        return logp, torch.zeros_like(logp)
    if not entropy_grad:  # a metric: no graph through the [N, V] entropy terms
        with torch.no_grad():
            return logp, entropy_from_logits(logits)
    return logp, entropy_from_logits(logits)


def response_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
    with_entropy: bool = False,
    share_prompt: bool | str = True,
    entropy_grad: bool = True,
    fused: bool = True,
    vision=None,
    whole_sequence: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] of ``responses`` given left-padded prompts; entropy [B, T] if asked.

    Positions where ``response_mask`` is 0 hold garbage and must be masked by the caller.
    ``share_prompt``: encode each distinct prompt once (same result; falls back to one pass).
    ``entropy_grad``: whether gradients flow through the entropy (false: it is a metric).
    ``fused``: use the fused head where it applies (false: the autograd path, for comparison).
    ``vision``: each row's images (``models.vision.VisionInputs`` or None), for a VLM;
    ``whole_sequence``: see ``causal_lm.response_hidden_states``.
    """
    hidden = response_hidden_states(
        model, prompt_ids, prompt_mask, responses, response_mask, share_prompt=share_prompt,
        vision=vision, whole_sequence=whole_sequence,
    )  # fmt: skip
    return hidden_logprobs(
        model, hidden, responses, temperature=temperature, chunk_tokens=chunk_tokens,
        with_entropy=with_entropy, entropy_grad=entropy_grad, fused=fused,
    )  # fmt: skip


def hidden_logprobs(
    model: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] of ``targets`` [B, T] from the decoder states [B, T, H] that predict them
    (through the model's LM head and final logit transform); entropy [B, T] if asked."""
    temperature = temperature if temperature > 0 else 1.0
    t = targets.shape[1]
    head = hf_model(model).get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (LM head)")
    transform = logit_transform(model)
    if fused and fusable_head(head, transform) and not (with_entropy and entropy_grad):
        return fused_head_logprobs(
            hidden, head, targets, temperature=temperature,
            chunk=min(chunk_tokens, FUSED_CHUNK_TOKENS), with_entropy=with_entropy,
        )  # fmt: skip
    rows = max(1, chunk_tokens // max(t, 1))
    use_ckpt = torch.is_grad_enabled() and hidden.requires_grad
    logps, ents = [], []
    for start in range(0, hidden.shape[0], rows):
        h, y = hidden[start : start + rows], targets[start : start + rows]
        if use_ckpt:
            lp, ent = checkpoint(
                _chunk_stats, head, h, y, temperature, with_entropy, transform, entropy_grad,
                use_reentrant=False,
            )  # fmt: skip
        else:
            lp, ent = _chunk_stats(head, h, y, temperature, with_entropy, transform, entropy_grad)
        logps.append(lp)
        ents.append(ent)
    logp = torch.cat(logps)
    return logp, (torch.cat(ents) if with_entropy else None)
