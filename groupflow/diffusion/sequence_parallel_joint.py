"""Ulysses sequence parallelism for the text-image joint-attention transformers: FLUX.1
(``FluxTransformer2DModel``), FLUX.2 (``Flux2Transformer2DModel``) and Qwen-Image
(``QwenImageTransformer2DModel``); :mod:`groupflow.diffusion.sequence_parallel` dispatches here.

Design decision: as for SD3, the image tokens are cut to this rank's 1/N and the (short) text
stream stays whole on every member, which takes its 1/N of the text heads locally; only the
image tokens are all-to-all'd (:func:`joint_attention`), and the text tokens' attention outputs
are gathered over the heads (``gather_heads``, whose backward sums the members' gradients). The
cut is one forward pre-hook on the transformer: it slices the packed latent tokens
(``hidden_states``, before the patch embedding, a per-token linear layer) and, for the FLUX
kinds, the image position ids (``img_ids``), so the rotary tables the model builds from them
are already this rank's; Qwen-Image builds its image rotary table from ``img_shapes``, so a
hook on its ``pos_embed`` slices that table. The output projection's tokens are gathered back
(``gather_sequence``), as for Wan and SD3.

The FLUX single-stream blocks run over the concatenation [whole text; this rank's image
tokens]: the same cut, consistently, so the same joint attention serves them. Their processor
is not told the text length: the pre-hook adds it to the ``joint_attention_kwargs`` diffusers
hands every attention (state kept in the call, not in the processors, so the worker's copies of
the model — reference, NFT old — and activation checkpointing's recomputation stay right).
Rotary embedding is per token, so it is applied before the exchange, on this rank's tokens
with this rank's rows of the table. Qwen-Image's text mask masks keys only: every member holds
the whole text, so the mask is built over [text; all image tokens] after the exchange.

Refused, each naming ``parallel.sequence_parallel``: an image token count the group does not
divide (no padding mask over the image tokens), heads it does not divide, an attention mask
passed to the FLUX kinds, FLUX.2's reference-image KV cache, and Qwen-Image's ``zero_cond_t``
(per-token modulation, edit models) — none of which groupflow's text-to-image training uses.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from groupflow.distributed.ulysses import (
    SequenceGroup,
    all_to_all,
    gather_heads,
    gather_sequence,
    split_sequence,
)

__all__ = ["JOINT_KINDS", "joint_attention", "enable_ulysses_joint"]

# diffusers class name -> groupflow's diffusion.model.kind (for the messages)
JOINT_KINDS = {
    "FluxTransformer2DModel": "flux",
    "Flux2Transformer2DModel": "flux2",
    "QwenImageTransformer2DModel": "qwen_image",
}

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def split_tokens(x: torch.Tensor, sp: SequenceGroup, kind: str, dim: int = 1) -> torch.Tensor:
    """This rank's 1/N of ``x``'s image tokens along ``dim``; refused where they do not divide."""
    return split_sequence(x, sp, f"the {kind} latent's image part", dim)


def joint_attention(text: QKV, image: QKV, sp: SequenceGroup, text_mask=None):
    """Attention over [whole text; whole image] for this rank's 1/N of the heads.

    ``text``: q, k, v [B, T, H, D], the same on every member; ``image``: q, k, v [B, S/N, H, D],
    this rank's tokens (rotary applied). ``text_mask``: [B, T] bool (True: a real token) masking
    text keys. Returns the text outputs [B, T, H·D] (all heads, gathered) and this rank's image
    outputs [B, S/N, H·D]."""
    length = text[0].shape[1]
    q, k, v = (
        torch.cat([t.chunk(sp.size, dim=2)[sp.rank], all_to_all(i, sp, scatter_dim=2, gather_dim=1)], 1)
        for t, i in zip(text, image, strict=True)
    )  # fmt: skip
    mask = None
    if text_mask is not None:
        image_mask = text_mask.new_ones(text_mask.shape[0], q.shape[1] - length)
        mask = torch.cat([text_mask.bool(), image_mask.bool()], 1)[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    ).transpose(1, 2).to(q.dtype)  # fmt: skip
    txt = gather_heads(out[:, :length], sp, dim=2).flatten(2, 3)
    img = all_to_all(out[:, length:], sp, scatter_dim=1, gather_dim=2).flatten(2, 3)
    return txt, img


def _text_length(length: int | None) -> int:
    if length is None:  # the pre-hook adds it: a single-stream block called outside the model
        raise ValueError(
            "parallel.sequence_parallel: a single-stream block needs the text length in its "
            "joint_attention_kwargs (text_length), which the transformer's pre-hook adds"
        )
    return length


def _heads(x: torch.Tensor, head_dim: int, norm: Any = None) -> torch.Tensor:
    out = x.unflatten(-1, (-1, head_dim))  # [B, S, H, D]
    return out if norm is None else norm(out)


def _split(qkv: QKV, length: int) -> tuple[QKV, QKV]:
    text = tuple(t[:, :length] for t in qkv)
    image = tuple(t[:, length:] for t in qkv)
    return text, image  # type: ignore[return-value]  # three of each


class UlyssesFluxProcessor:
    """A ``FluxAttention`` / ``Flux2Attention`` processor: the double-stream blocks' joint
    attention (text passed as ``encoder_hidden_states``) and FLUX.1's single-stream attention
    over [text; this rank's image tokens] (module docstring)."""

    def __init__(self, sp: SequenceGroup, projections, rotary):
        self.sp = sp
        self.projections, self.rotary = projections, rotary  # diffusers' own, per model

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None,
                 attention_mask=None, image_rotary_emb=None,
                 text_length: int | None = None) -> Any:  # fmt: skip
        if attention_mask is not None:
            raise ValueError("parallel.sequence_parallel: an attention mask is not supported")
        q, k, v, eq, ek, ev = self.projections(attn, hidden_states, encoder_hidden_states)
        q, k = _heads(q, attn.head_dim, attn.norm_q), _heads(k, attn.head_dim, attn.norm_k)
        v = _heads(v, attn.head_dim)
        joint = encoder_hidden_states is not None
        if joint:  # [text; image], as diffusers' processor lays them out for the rotary table
            eq, ek = (_heads(eq, attn.head_dim, attn.norm_added_q),
                      _heads(ek, attn.head_dim, attn.norm_added_k))  # fmt: skip
            q, k, v = (
                torch.cat([eq, q], 1),
                torch.cat([ek, k], 1),
                torch.cat([_heads(ev, attn.head_dim), v], 1),
            )
        if image_rotary_emb is not None:
            q = self.rotary(q, image_rotary_emb, sequence_dim=1)
            k = self.rotary(k, image_rotary_emb, sequence_dim=1)
        length = encoder_hidden_states.shape[1] if joint else _text_length(text_length)
        txt, img = joint_attention(*_split((q, k, v), length), self.sp)
        if not joint:  # FLUX.1's single-stream block: its own proj_out follows
            return torch.cat([txt, img], 1)
        img = attn.to_out[1](attn.to_out[0](img))
        return img, attn.to_add_out(txt)


class UlyssesFlux2SingleProcessor:
    """A ``Flux2ParallelSelfAttention`` processor (FLUX.2's single-stream blocks: fused QKV and
    MLP input projection, one output projection) over [text; this rank's image tokens]."""

    def __init__(self, sp: SequenceGroup, rotary):
        self.sp, self.rotary = sp, rotary

    def __call__(self, attn, hidden_states: torch.Tensor, attention_mask=None,
                 image_rotary_emb=None, text_length: int | None = None) -> torch.Tensor:  # fmt: skip
        if attention_mask is not None:
            raise ValueError("parallel.sequence_parallel: an attention mask is not supported")
        hidden_states = attn.to_qkv_mlp_proj(hidden_states)
        qkv, mlp = hidden_states.split(
            [3 * attn.inner_dim, hidden_states.shape[-1] - 3 * attn.inner_dim], -1
        )
        q, k, v = qkv.chunk(3, dim=-1)
        q, k = _heads(q, attn.head_dim, attn.norm_q), _heads(k, attn.head_dim, attn.norm_k)
        v = _heads(v, attn.head_dim)
        if image_rotary_emb is not None:
            q = self.rotary(q, image_rotary_emb, sequence_dim=1)
            k = self.rotary(k, image_rotary_emb, sequence_dim=1)
        txt, img = joint_attention(*_split((q, k, v), _text_length(text_length)), self.sp)
        return attn.to_out(torch.cat([torch.cat([txt, img], 1), attn.mlp_act_fn(mlp)], -1))


class UlyssesQwenProcessor:
    """A Qwen-Image double-stream ``Attention`` processor: its own rotary tables for the image
    (this rank's rows) and the text, and the text mask over the keys (module docstring)."""

    def __init__(self, sp: SequenceGroup, rotary):
        self.sp, self.rotary = sp, rotary

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None,
                 encoder_hidden_states_mask=None, attention_mask=None,
                 image_rotary_emb=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if encoder_hidden_states is None or attention_mask is not None:
            raise ValueError(
                "parallel.sequence_parallel: Qwen-Image's attention takes the text stream and "
                "its encoder_hidden_states_mask, not an attention_mask"
            )
        d = attn.inner_dim // attn.heads
        image = (_heads(attn.to_q(hidden_states), d, attn.norm_q),
                 _heads(attn.to_k(hidden_states), d, attn.norm_k),
                 _heads(attn.to_v(hidden_states), d))  # fmt: skip
        text = (_heads(attn.add_q_proj(encoder_hidden_states), d, attn.norm_added_q),
                _heads(attn.add_k_proj(encoder_hidden_states), d, attn.norm_added_k),
                _heads(attn.add_v_proj(encoder_hidden_states), d))  # fmt: skip
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            image = (*(self.rotary(t, img_freqs, use_real=False) for t in image[:2]), image[2])
            text = (*(self.rotary(t, txt_freqs, use_real=False) for t in text[:2]), text[2])
        txt, img = joint_attention(text, image, self.sp, encoder_hidden_states_mask)  # type: ignore[arg-type]
        img = attn.to_out[0](img)
        if len(attn.to_out) > 1:
            img = attn.to_out[1](img)  # dropout
        return img, attn.to_add_out(txt)


def _check_kwargs(kind: str, kwargs: dict) -> None:
    if kwargs.get("kv_cache") is not None or kwargs.get("kv_cache_mode") is not None:
        raise ValueError(
            "parallel.sequence_parallel: FLUX.2's reference-image KV cache is not supported"
        )
    if "hidden_states" not in kwargs or "encoder_hidden_states" not in kwargs:
        raise ValueError(
            f"parallel.sequence_parallel: the {kind} transformer is called with hidden_states "
            "and encoder_hidden_states as keywords (groupflow.diffusion.kinds)"
        )


def enable_ulysses_joint(transformer: nn.Module, sp: SequenceGroup) -> nn.Module:
    """Make a FLUX.1, FLUX.2 or Qwen-Image transformer run sequence parallel over ``sp``, in
    place (the heads are checked by the caller)."""
    name = type(transformer).__name__
    kind = JOINT_KINDS[name]
    model: Any = transformer  # diffusers' transformer, its submodules read by name
    if getattr(model.config, "zero_cond_t", False):  # refused before anything is changed
        raise ValueError(
            "parallel.sequence_parallel: Qwen-Image's zero_cond_t (per-token modulation of "
            "edit models) is not supported"
        )

    def cut(_module, args, kwargs):
        _check_kwargs(kind, kwargs)
        kwargs["hidden_states"] = split_tokens(kwargs["hidden_states"], sp, kind)
        ids = kwargs.get("img_ids")
        if ids is not None:  # FLUX: [S, axes] (or the deprecated [B, S, axes])
            kwargs["img_ids"] = split_tokens(ids, sp, kind, dim=ids.dim() - 2)
        if kind != "qwen_image":  # what the FLUX single-stream processors are not told otherwise
            length = kwargs["encoder_hidden_states"].shape[1]
            extra = kwargs.get("joint_attention_kwargs") or {}
            kwargs["joint_attention_kwargs"] = {**extra, "text_length": length}
        return args, kwargs

    model.register_forward_pre_hook(cut, with_kwargs=True)
    model.proj_out.register_forward_hook(lambda _m, _a, out: gather_sequence(out, sp, dim=1))
    if name == "QwenImageTransformer2DModel":
        from diffusers.models.transformers import transformer_qwenimage as qwen

        # (image table, text table): the image rows are this rank's tokens'
        model.pos_embed.register_forward_hook(
            lambda _m, _a, out: (split_tokens(out[0], sp, kind, dim=0), out[1])
        )
        for block in model.transformer_blocks:
            block.attn.set_processor(UlyssesQwenProcessor(sp, qwen.apply_rotary_emb_qwen))
        return transformer
    if name == "FluxTransformer2DModel":
        from diffusers.models.transformers import transformer_flux as flux
    else:
        from diffusers.models.transformers import transformer_flux2 as flux
    from diffusers.models.embeddings import apply_rotary_emb as rotary

    projections = flux._get_qkv_projections
    for block in model.transformer_blocks:
        block.attn.set_processor(UlyssesFluxProcessor(sp, projections, rotary))
    for block in model.single_transformer_blocks:
        single = (UlyssesFluxProcessor(sp, projections, rotary) if kind == "flux"
                  else UlyssesFlux2SingleProcessor(sp, rotary))  # fmt: skip
        block.attn.set_processor(single)
    return transformer
