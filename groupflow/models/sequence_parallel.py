"""Response log-probs of an HF causal LM with Ulysses sequence parallelism (``parallel.sequence_parallel``).

Design decision: the decoder stays the HF model; only its attention function changes. Each
member of a sequence-parallel group (``groupflow.distributed.ulysses``) runs the decoder on its
1/N slice of every [prompt | response] row — embeddings, MLPs, norms and the LM head see 1/N of
the tokens, which is where the activation memory goes. For the duration of that call the model's
``config._attn_implementation`` names :func:`ulysses_attention` (registered with transformers'
``AttentionInterface``; the group and mask reach it as a keyword argument that HF decoders pass
down to attention, so activation checkpointing replays it alike): it receives this slice's queries, keys and values after the rotary
embedding (positions are the global ones), all-to-alls them to the whole sequence for 1/N of the
heads, attends with the causal-and-padding mask of the whole rows, and all-to-alls the output
back. So every HF decoder that dispatches attention through that interface (Llama, Qwen2/3,
Mistral, SmolLM, Gemma...) works without per-architecture code.

Rows are padded on the right to a multiple of N (``padded_length``): padding is never attended
by a real token (causal mask) and predicts nothing. Query heads must divide by N (refused
otherwise, :func:`check_heads`); grouped-query K/V heads that do not (e.g. 2 K/V heads on 4
ranks) are handled by repeating each K/V head for its query heads before the exchange — exact,
at the cost of exchanging more K/V. Sliding-window and recurrent layers are refused. The prompt
is not shared across a group's rows here (``actor.share_prompt_prefix`` needs a KV cache and a
second decoder call): one pass over the whole rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from groupflow.algorithms.masks import response_span
from groupflow.distributed.ulysses import (
    SequenceGroup,
    all_to_all,
    gather_sequence,
    padded_length,
)
from groupflow.models.causal_lm import full_attention_only, hf_model, token_positions
from groupflow.models.logprobs import hidden_logprobs

__all__ = [
    "ATTENTION_NAME",
    "check_heads",
    "ulysses_attention",
    "use_ulysses_attention",
    "sequence_parallel_logprobs",
]

ATTENTION_NAME = "groupflow_ulysses"


def check_heads(config, size: int) -> None:
    """Refuse a model whose query heads do not split over ``size`` ranks (the K/V heads need not:
    they are repeated when they do not divide, see the module docstring)."""
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:
        raise ValueError(
            f"parallel.sequence_parallel={size}: cannot find num_attention_heads in the model's "
            f"config ({type(config).__name__})"
        )
    if heads % size:
        raise ValueError(
            f"parallel.sequence_parallel={size} must divide the model's {heads} attention heads "
            "(each rank attends with 1/N of them); choose a divisor of the head count"
        )


def _repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    """[B, Hkv, S, D] → [B, Hkv·times, S, D], each K/V head repeated for its query heads."""
    return x if times == 1 else x.repeat_interleave(times, dim=1)


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    ulysses: tuple[SequenceGroup, torch.Tensor | None] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function. With ``ulysses`` (the group and the [B, 1, S, S] boolean
    mask of the whole rows, None for a plain causal one; passed down by
    :func:`sequence_parallel_logprobs`): ``query``
    [B, Hq, S/N, D], ``key``/``value`` [B, Hkv, S/N, D] of this rank's slice → output
    [B, S/N, Hq, D], and ``attention_mask`` (HF's, for the slice alone) is ignored. Without it:
    plain SDPA attention (generation, or any other forward of the same model)."""
    if ulysses is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    sp, mask = ulysses
    hq, hkv = query.shape[1], key.shape[1]
    if hkv % sp.size:  # grouped-query K/V heads that do not split: one per query head
        key, value = _repeat_heads(key, hq // hkv), _repeat_heads(value, hq // hkv)
    # [B, H, S/N, D] → [B, H/N, S, D]: the whole sequence for this rank's heads
    q, k, v = (all_to_all(t, sp, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    # head chunks stay aligned: query heads j·Hq/N… use K/V heads j·Hkv/N… (Hq/Hkv per K/V head)
    k, v = _repeat_heads(k, q.shape[1] // k.shape[1]), _repeat_heads(v, q.shape[1] // v.shape[1])
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=mask is None
    )
    out = all_to_all(out, sp, scatter_dim=2, gather_dim=1)  # back to [B, H, S/N, D]
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    # outside a sequence-parallel forward the function is SDPA, so HF builds SDPA's masks for it
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


_register()


def use_ulysses_attention(model: nn.Module) -> None:
    """Make ``model`` dispatch attention to :func:`ulysses_attention` — for good, so that
    activation checkpointing replays a layer the same way in backward; it is plain SDPA
    attention whenever no sequence-parallel forward passes its group down."""
    hf_model(model).config._attn_implementation = ATTENTION_NAME


def whole_rows_mask(attention: torch.Tensor) -> torch.Tensor | None:
    """[B, 1, S, S] boolean attention of whole rows ``attention`` [B, S]: causal, no padded key,
    and each position sees itself (so a padded query row is not empty: its output is never used,
    but must be finite for backward). None when plain causal attention is the same for every real
    token — no row has padding before a real token (padding on the right is never attended by a
    real token) — so that a long single row never materialises an S × S mask."""
    if not bool((attention[:, 1:] > attention[:, :-1]).any()):
        return None
    s = attention.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention.device).tril()
    mask = causal & attention.bool()[:, None, :]
    return (mask | torch.eye(s, dtype=torch.bool, device=attention.device))[:, None]


def sequence_parallel_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    sp: SequenceGroup,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``response_logprobs`` [B, T] (entropy [B, T] if asked) computed by the ``sp.size``
    members of a sequence-parallel group, each holding the same rows: every member returns the
    whole result. A collective over the group (forward and backward)."""
    p, t = prompt_ids.shape[1], responses.shape[1]
    ids = torch.cat([prompt_ids, responses], dim=1)
    attention = torch.cat([prompt_mask, response_span(response_mask).to(prompt_mask.dtype)], dim=1)
    if not full_attention_only(model, ids.shape[1]):
        raise ValueError(
            "parallel.sequence_parallel needs a model whose every layer attends to the whole "
            "prefix (no sliding-window or recurrent layers)"
        )
    width = padded_length(ids.shape[1], sp.size)
    extra = width - ids.shape[1]
    ids, attention = F.pad(ids, (0, extra)), F.pad(attention, (0, extra))
    positions = token_positions(attention)
    s = width // sp.size
    lo = sp.rank * s
    use_ulysses_attention(model)
    out = hf_model(model).get_decoder()(
        input_ids=ids[:, lo : lo + s], position_ids=positions[:, lo : lo + s], use_cache=False,
        ulysses=(sp, whole_rows_mask(attention)),
    )  # fmt: skip
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    # Column c predicts token c+1; response token j sits at column p+j, so columns
    # [p-1, p+t-1) predict the responses. This rank computes the LM head on its share of them.
    a, b = max(lo, p - 1), min(lo + s, p + t - 1)
    rows = hidden.shape[0]

    def local(piece: torch.Tensor | None) -> torch.Tensor:
        """This rank's [B, S/N] slice: its computed columns, zeros around them."""
        if piece is None:
            return hidden.new_zeros(rows, s, dtype=torch.float32)
        return F.pad(piece.float(), (a - lo, lo + s - b))

    lp = ent = None
    if b > a:
        lp, ent = hidden_logprobs(
            model, hidden[:, a - lo : b - lo], ids[:, a + 1 : b + 1], temperature=temperature,
            chunk_tokens=chunk_tokens, with_entropy=with_entropy, entropy_grad=entropy_grad,
        )  # fmt: skip
    # Every member's slice enters its loss, if only with weight 0: the backward of each layer's
    # all-to-all is a collective that every member must reach, also one whose slice holds no
    # response token (its keys and values still feed the others' attention).
    anchor = hidden.sum() * 0 if hidden.requires_grad else 0
    logp = gather_sequence(local(lp) + anchor, sp)[:, p - 1 : p + t - 1]
    entropy = None
    if with_entropy:
        entropy = gather_sequence(local(ent), sp)[:, p - 1 : p + t - 1]
    return logp, entropy
