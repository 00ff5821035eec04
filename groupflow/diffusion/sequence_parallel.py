"""Ulysses sequence parallelism for the diffusers flow transformers: Wan (``WanTransformer3DModel``,
video) and SD3 (``SD3Transformer2DModel``, images) here; FLUX.1, FLUX.2 and Qwen-Image in
:mod:`groupflow.diffusion.sequence_parallel_joint`, Z-Image in
:mod:`groupflow.diffusion.sequence_parallel_z_image`, which :func:`enable_ulysses` dispatches to.

Design decision: the transformer stays diffusers' own; :func:`enable_ulysses` changes three places
of it, in place, for the life of the model. The rotary tables and the patch tokens entering the
first block are cut to this rank's 1/N of the latent tokens (module hooks), every attention
layer gets :class:`UlyssesWanProcessor`, and the output projection's tokens are gathered back to
the whole sequence (``gather_sequence``: every member of the group then holds the same velocity,
and the loss downstream is the same on all of them, so each member's gradient is its share and
FSDP2's sum over ranks makes the full one). Self-attention all-to-alls queries, keys and values
from [B, S/N, H, D] to [B, S, H/N, D] and back; cross-attention needs no exchange (this rank's
queries attend to the whole text, which every member holds). Patch embedding, norms,
modulation, the MLPs and the output projection see 1/N of the tokens.

SD3's joint attention (:class:`UlyssesJointProcessor`) attends image and text tokens together:
the image tokens are exchanged as above, while every member holds the whole (short) text stream
and takes its 1/N of the text heads without communication; the text tokens' attention outputs
are then gathered over the heads (``gather_heads``, whose backward sums the members' gradients:
each member's copy of the text stream feeds only its own heads). SD3.5's second, image-only
attention is self-attention as in Wan. The cut happens after the patch embedding (which adds
SD3's positions), the gather after the output projection.

The latent token count (frames × height/2 × width/2 for Wan's (1, 2, 2) patches, (H/p) × (W/p)
for SD3) must split evenly over the group (refused otherwise: the self-attention has no padding
mask) and the heads too. Image-conditioned (I2V) Wan layers and per-token timesteps (Wan2.2
TI2V's image-to-video mode) are refused; text-to-video and text-to-image, which groupflow
trains, are neither.

FLUX.1, FLUX.2 and Qwen-Image follow SD3's joint attention: image tokens cut to 1/N, the text
whole on every member with 1/N of its heads; the FLUX single-stream blocks cut their
[text; image] sequence the same way (that module's docstring). Z-Image too: its unified
[image; caption] sequence pads each caption to a multiple of 32 and masks the padding per
sample, and since every member holds the whole caption that mask masks keys only, after the
image exchange.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from groupflow.diffusion.sequence_parallel_joint import JOINT_KINDS, enable_ulysses_joint
from groupflow.diffusion.sequence_parallel_z_image import enable_ulysses_z_image
from groupflow.distributed.ulysses import (
    SequenceGroup,
    all_to_all,
    gather_heads,
    gather_sequence,
    split_sequence,
)

if TYPE_CHECKING:
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers.transformer_wan import WanAttention

__all__ = ["UlyssesWanProcessor", "UlyssesJointProcessor", "enable_ulysses"]


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on [B, S, H, D] (interleaved pairs), as its own processor does."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class UlyssesWanProcessor:
    """A ``WanAttention`` processor for this rank's slice of the tokens (module docstring)."""

    def __init__(self, sp: SequenceGroup):
        self.sp = sp

    def __call__(
        self,
        attn: WanAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        if attn.add_k_proj is not None:
            raise ValueError(
                "parallel.sequence_parallel: image-conditioned (I2V) Wan attention is not supported"
            )
        self_attention = encoder_hidden_states is None
        # diffusers types encoder_hidden_states as a Tensor; None (self-attention) is its default
        query, key, value = _get_qkv_projections(
            attn, hidden_states, cast(torch.Tensor, encoder_hidden_states)
        )
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            query, key = _rotary(query, *rotary_emb), _rotary(key, *rotary_emb)
        if self_attention:  # [B, S/N, H, D] → [B, S, H/N, D]: the whole sequence, 1/N of the heads
            query, key, value = (
                all_to_all(t, self.sp, scatter_dim=2, gather_dim=1) for t in (query, key, value)
            )
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
            attn_mask=attention_mask,
        ).transpose(1, 2)  # fmt: skip
        if self_attention:  # back to [B, S/N, H, D]
            out = all_to_all(out, self.sp, scatter_dim=1, gather_dim=2)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class UlyssesJointProcessor:
    """An SD3 ``Attention`` processor (joint image-text attention, or SD3.5's image-only second
    attention) for this rank's slice of the image tokens (module docstring)."""

    def __init__(self, sp: SequenceGroup):
        self.sp = sp

    def _heads(self, attn: Attention, x: torch.Tensor, proj: str, norm: str | None):
        out = getattr(attn, proj)(x)
        out = out.view(x.shape[0], -1, attn.heads, out.shape[-1] // attn.heads)  # [B, S, H, D]
        layer = getattr(attn, norm) if norm else None
        return out if layer is None else layer(out)  # the norms act on the head dimension

    def __call__(self, attn: Attention, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None, attention_mask=None,
                 *args, **kwargs):  # fmt: skip
        sp = self.sp
        q = self._heads(attn, hidden_states, "to_q", "norm_q")
        k = self._heads(attn, hidden_states, "to_k", "norm_k")
        v = self._heads(attn, hidden_states, "to_v", None)
        # image tokens: [B, S/N, H, D] → [B, S, H/N, D]
        q, k, v = (all_to_all(t, sp, scatter_dim=2, gather_dim=1) for t in (q, k, v))
        image = q.shape[1]
        text = encoder_hidden_states
        if text is not None:  # every member holds the whole text: its 1/N of the heads, locally
            tq = self._heads(attn, text, "add_q_proj", "norm_added_q")
            tk = self._heads(attn, text, "add_k_proj", "norm_added_k")
            tv = self._heads(attn, text, "add_v_proj", None)
            tq, tk, tv = (t.chunk(sp.size, dim=2)[sp.rank] for t in (tq, tk, tv))
            q, k, v = torch.cat([q, tq], 1), torch.cat([k, tk], 1), torch.cat([v, tv], 1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2)).transpose(1, 2)  # fmt: skip
        out = out.to(q.dtype)
        img = all_to_all(out[:, :image], sp, scatter_dim=1, gather_dim=2).flatten(2, 3)
        assert attn.to_out is not None, "SD3's attentions project their image tokens out"
        img = attn.to_out[1](attn.to_out[0](img))
        if text is None:
            return img
        txt = gather_heads(out[:, image:], sp, dim=2).flatten(2, 3)
        if not attn.context_pre_only:
            assert attn.to_add_out is not None, "a joint attention that is not context_pre_only"
            txt = attn.to_add_out(txt)
        return img, txt


def _slice(x: torch.Tensor, sp: SequenceGroup, dim: int = 1) -> torch.Tensor:
    what = "the latent (frames × height/2 × width/2 for Wan, (height/p) × (width/p) for SD3)"
    return split_sequence(x, sp, what, dim)


def enable_ulysses(transformer: nn.Module, sp: SequenceGroup) -> nn.Module:
    """Make ``transformer`` (a ``WanTransformer3DModel``, ``SD3Transformer2DModel``,
    ``FluxTransformer2DModel``, ``Flux2Transformer2DModel``, ``QwenImageTransformer2DModel`` or
    ``ZImageTransformer2DModel``)
    run sequence parallel over ``sp``, in place: every forward is then a collective of the
    group, whose members pass the same inputs."""
    kind = type(transformer).__name__
    # diffusers' transformer, its submodules read by name (nn.Module's __getattr__ types each as
    # Tensor | Module)
    model: Any = transformer
    z_image = kind == "ZImageTransformer2DModel"
    if kind not in ("WanTransformer3DModel", "SD3Transformer2DModel", *JOINT_KINDS) and not z_image:
        raise ValueError(
            "parallel.sequence_parallel for diffusion is implemented for the Wan, SD3, FLUX.1, "
            "FLUX.2, Qwen-Image and Z-Image transformers (diffusion.model.kind wan / sd3 / flux / "
            f"flux2 / qwen_image / z_image), not {kind}"
        )
    heads = model.config.n_heads if z_image else model.config.num_attention_heads
    if heads % sp.size:
        raise ValueError(
            f"parallel.sequence_parallel={sp.size} must divide the transformer's {heads} heads"
        )

    def tokens_gather(_module, _args, out):
        return gather_sequence(out, sp, dim=1)

    if kind in JOINT_KINDS:
        return enable_ulysses_joint(transformer, sp)
    if z_image:
        return enable_ulysses_z_image(transformer, sp)
    model.proj_out.register_forward_hook(tokens_gather)
    if kind == "SD3Transformer2DModel":
        for block in model.transformer_blocks:
            for attn in (block.attn, getattr(block, "attn2", None)):
                if attn is not None:
                    attn.set_processor(UlyssesJointProcessor(sp))
        # patch tokens (positions added) → this rank's slice
        model.pos_embed.register_forward_hook(lambda _m, _a, out: _slice(out, sp))
        return transformer
    for block in model.blocks:
        block.attn1.set_processor(UlyssesWanProcessor(sp))
        block.attn2.set_processor(UlyssesWanProcessor(sp))

    def rope_slice(_module, _args, out):
        return tuple(_slice(t, sp) for t in out)  # freqs [1, S, 1, D] → this rank's tokens

    def tokens_slice(_module, args):
        if args[2].dim() == 4:  # timestep_proj [B, S, 6, D]: per-token timesteps
            raise ValueError("parallel.sequence_parallel: per-token timesteps are not supported")
        return (_slice(args[0], sp), *args[1:])

    model.rope.register_forward_hook(rope_slice)
    model.blocks[0].register_forward_pre_hook(tokens_slice)
    return transformer
