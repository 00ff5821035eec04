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

Attention: one row, so that flash-attention's varlen detection (a batch of one row) applies. A
flash (or flex) implementation gets the packed position ids as they are. SDPA and eager would
build that block-diagonal mask densely — N × N for the whole micro-batch, attention compute
growing with the square of the micro-batch's tokens, which on the CPU measured no faster than
the padded forward (benchmarks/README.md) — so for them the forward switches the model to
:func:`segment_attention` for the call: the samples' queries, keys and values laid out per
sample for one causal SDPA call (exact; the padded forward's attention work, the rest of the
model on real tokens only). The segment layout reaches it as a keyword argument that HF
decoders pass down to attention, so a checkpointed layer replays it alike. Models with
sliding-window or recurrent layers keep transformers' masks (``full_attention_only``).
The prompt is not shared across a group's rows here (``actor.share_prompt_prefix`` needs a
second decoder call on a KV cache of padded rows).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from groupflow.algorithms.masks import response_span
from groupflow.models.causal_lm import full_attention_only, hf_model
from groupflow.models.logprobs import hidden_logprobs

__all__ = [
    "ATTENTION_NAME",
    "Packed",
    "pack",
    "segment_attention",
    "packed_hidden",
    "packed_logprobs",
    "packed_values",
]

ATTENTION_NAME = "groupflow_packed"


def segment_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_segments: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function for a packed row: ``query`` [1, Hq, N, D],
    ``key``/``value`` [1, Hkv, N, D] → [1, N, Hq, D], causal attention inside each sample and
    none across. ``packed_segments`` = (``index`` [S, W], ``valid`` [S, W]): sample s's tokens
    are the row's columns ``index[s, :length_s]`` (``valid`` marks them; the rest point anywhere).

    The samples are laid out [S, H, W, D] for attention alone — right-padded, so plain causal
    attention never lets a real query see a padded key — and put back in row order: one SDPA
    call per layer (per-sample calls measured far slower on a loaded CPU), attention work
    S × W² as in the padded forward, while every other layer of the model sees the N real
    tokens only."""
    if packed_segments is None:
        raise RuntimeError(
            f"the {ATTENTION_NAME!r} attention needs packed_segments (models.packing's forward)"
        )
    index, valid = packed_segments
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query K/V heads: one per query head
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    # [1, H, N, D] → [S, H, W, D]
    q, k, v = (t[0][:, index].transpose(0, 1) for t in (query, key, value))
    out = F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout, scale=scaling, is_causal=True
    )  # [S, H, W, D]
    # back to the row: [S, W, H, D] at the valid columns, in row order → [1, N, H, D]
    return out.transpose(1, 2)[valid][None].contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    """The mask function of :func:`segment_attention`: it masks by segments, needs no tensor."""
    return None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, segment_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


_register()


@contextmanager
def _segment_attention(model: nn.Module, packed: Packed) -> Iterator[dict]:
    """Decoder keyword arguments for ``packed``: the segment bounds, with the model switched to
    :func:`segment_attention` for the duration, where its attention would build a dense mask
    (SDPA, eager) and every layer attends to the whole prefix; nothing for flash/flex."""
    config = hf_model(model).config
    impl = getattr(config, "_attn_implementation", None)
    lengths = packed.lengths.tolist()
    if impl not in ("sdpa", "eager", None) or not full_attention_only(
        model, max(lengths, default=1)
    ):
        yield {}
        return
    width = max(lengths, default=1)
    starts = packed.lengths.cumsum(0) - packed.lengths
    columns = torch.arange(width, device=packed.lengths.device)
    valid = columns[None, :] < packed.lengths[:, None]
    index = torch.where(valid, starts[:, None] + columns[None, :], 0)
    config._attn_implementation = ATTENTION_NAME
    try:
        yield {"packed_segments": (index, valid)}
    finally:
        config._attn_implementation = impl


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
    lengths: torch.Tensor  # [B] each sample's tokens in the row (in row order)


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
        lengths=keep.sum(1),
    )


def _unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """[M] values at ``packed.span`` → [B, T] float32, zeros elsewhere (differentiable)."""
    out = values.new_zeros(packed.span.shape, dtype=torch.float32)
    return out.masked_scatter(packed.span, values.float())


def packed_hidden(model: nn.Module, packed: Packed) -> torch.Tensor:
    """Decoder states [M, H] that predict the response tokens at ``packed.span``."""
    with _segment_attention(model, packed) as extra:
        out = hf_model(model).get_decoder()(
            input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
            **extra,
        )  # fmt: skip
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
        ents.append(ent[0] if ent is not None else None)  # None unless with_entropy
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
    with _segment_attention(model, packed) as extra:
        out = model(
            input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
            **extra,
        )  # fmt: skip
    return _unpack(out.logits[0, packed.source, 0], packed)
