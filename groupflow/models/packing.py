"""Padding-free (packed) forwards: a micro-batch's samples concatenated into one row.

Design decision: the padded forward runs a micro-batch as [B, P + T] — prompts left-padded to
the longest prompt, responses right-padded to the longest response — so with the skewed lengths
of real tasks most of its tokens are padding. A packed forward keeps only the tokens the padded
forward attends to (``prompt_mask`` and ``response_span``: gaps in a response are attended and
so kept), concatenates them sample after sample into a single row ``[1, N]``, restarts the
position ids at 0 for every sample and passes no attention mask. transformers reads such
position ids as packed sequences: flash-attention takes its varlen path (cu_seqlens from the
restarts), SDPA and eager get a block-diagonal causal mask (``masking_utils``'s packed-sequence
detection) — attention never crosses a sample boundary. Positions equal the padded forward's
(``token_positions``: the count of attended tokens before), so every state, log-prob, entropy
and value equals the padded forward's up to floating-point summation order.

The results come back in the padded layout ([B, T], zeros outside each response's span), so the
losses, their aggregations (``loss_agg``) and global denominators run unchanged on them: packing
changes how states are computed, never what is optimised. The LM head runs on the response
positions only (N_resp × V logits, chunked as in ``models.logprobs``).

One row, not several: flash-attention's varlen detection needs a batch of one row, and on the
CPU a block-diagonal SDPA mask of one row measured no slower than several shorter rows at the
budgets used (benchmarks/bench_packing.py). The prompt is not shared across a group's rows here
(``actor.share_prompt_prefix`` needs a second decoder call on a KV cache of padded rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from groupflow.algorithms.masks import response_span
from groupflow.models.logprobs import hidden_logprobs

__all__ = ["Packed", "pack", "packed_hidden", "packed_logprobs", "packed_values"]


@dataclass(frozen=True)
class Packed:
    """One micro-batch as a single row. ``input_ids``/``position_ids`` [1, N]; ``span`` [B, T]
    bool, the response columns that are attended (their values come back); ``source`` [M] the
    row index of the state that predicts each of them (row-major order of ``span``)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    span: torch.Tensor
    source: torch.Tensor
    targets: torch.Tensor  # [M] the response tokens at ``span``


def pack(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
) -> Packed:
    """Pack left-padded prompts [B, P] and right-padded responses [B, T] into one row.

    A sample's tokens are its attended prompt columns then its response up to its last action;
    its first response token is predicted by its last prompt token, so a row whose response
    has actions needs a prompt token (a clear error names it otherwise).
    """
    p = prompt_ids.shape[1]
    span = response_span(response_mask).bool()
    keep = torch.cat([prompt_mask != 0, span], dim=1)  # [B, P + T]
    no_prompt = span.any(1) & ~keep[:, :p].any(1)
    if bool(no_prompt.any()):
        row = int(no_prompt.nonzero()[0])
        raise ValueError(
            f"packing: sample {row} of the micro-batch has a response but no prompt token "
            "(prompt_mask all 0): nothing predicts its first response token"
        )
    ids = torch.cat([prompt_ids, responses], dim=1)
    # the padded forward's positions: attended tokens before, per sample (token_positions)
    positions = keep.long().cumsum(1) - 1
    flat = keep.flatten().long().cumsum(0) - 1  # each kept column's index in the packed row
    flat = flat.view_as(keep)
    return Packed(
        input_ids=ids[keep][None],
        position_ids=positions[keep][None],
        span=span,
        source=flat[:, p:][span] - 1,
        targets=responses[span],
    )


def _unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """[M] values at ``packed.span`` → [B, T] float32, zeros elsewhere (differentiable)."""
    out = values.new_zeros(packed.span.shape, dtype=torch.float32)
    return out.masked_scatter(packed.span, values.float())


def packed_hidden(model: nn.Module, packed: Packed) -> torch.Tensor:
    """Decoder states [M, H] that predict the response tokens at ``packed.span``."""
    out = model.get_decoder()(
        input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False
    )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[0, packed.source]


def packed_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``models.logprobs.response_logprobs`` [B, T] (entropy [B, T] if asked) from one packed
    forward; 0 outside each response's span (masked positions hold garbage in the padded path,
    the caller masks them either way)."""
    packed = pack(prompt_ids, prompt_mask, responses, response_mask)
    hidden = packed_hidden(model, packed)
    logps, ents = [], []
    # hidden_logprobs chunks over rows of a [rows, t] layout: pieces of chunk_tokens positions
    # keep at most chunk_tokens × V logits alive, as in the padded path
    for s in range(0, hidden.shape[0], chunk_tokens):
        lp, ent = hidden_logprobs(
            model, hidden[None, s : s + chunk_tokens], packed.targets[None, s : s + chunk_tokens],
            temperature=temperature, chunk_tokens=chunk_tokens, with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )  # fmt: skip
        logps.append(lp[0])
        ents.append(ent[0] if with_entropy else None)
    empty = hidden.new_zeros(0, dtype=torch.float32)
    logp = _unpack(torch.cat(logps) if logps else empty, packed)
    if not with_entropy:
        return logp, None
    return logp, _unpack(torch.cat(ents) if ents else empty, packed)


def packed_values(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """``models.value.response_values`` [B, T] (float32) of a token-classification value model
    from one packed forward; 0 outside each response's span."""
    packed = pack(prompt_ids, prompt_mask, responses, response_mask)
    out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
    return _unpack(out.logits[0, packed.source, 0], packed)
