"""Ulysses sequence parallelism for the Wan video transformer (diffusers' ``WanTransformer3DModel``).

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

The latent token count (frames × height/2 × width/2 for Wan's (1, 2, 2) patches) must split
evenly over the group (refused otherwise: Wan's self-attention has no padding mask) and the
heads too. Image-conditioned (I2V) layers and per-token timesteps (Wan2.2 TI2V's image-to-video
mode) are refused; text-to-video, which groupflow trains, is neither.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from groupflow.distributed.ulysses import SequenceGroup, all_to_all, gather_sequence

__all__ = ["UlyssesWanProcessor", "enable_ulysses"]


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
        attn: nn.Module,
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
        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
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


def _slice(x: torch.Tensor, sp: SequenceGroup, dim: int = 1) -> torch.Tensor:
    if x.shape[dim] % sp.size:
        raise ValueError(
            f"parallel.sequence_parallel={sp.size}: the latent has {x.shape[dim]} tokens (frames × "
            f"height/2 × width/2 for Wan), which do not split evenly over {sp.size} ranks; choose "
            "a latent_shape whose token count it divides"
        )
    return x.chunk(sp.size, dim=dim)[sp.rank]


def enable_ulysses(transformer: nn.Module, sp: SequenceGroup) -> nn.Module:
    """Make ``transformer`` (a ``WanTransformer3DModel``) run sequence parallel over ``sp``, in
    place: every forward is then a collective of the group, whose members pass the same inputs."""
    if type(transformer).__name__ != "WanTransformer3DModel":
        raise ValueError(
            "parallel.sequence_parallel for diffusion is implemented for the Wan transformer "
            f"(diffusion.model.kind wan), not {type(transformer).__name__}"
        )
    heads = transformer.config.num_attention_heads
    if heads % sp.size:
        raise ValueError(
            f"parallel.sequence_parallel={sp.size} must divide the transformer's {heads} heads"
        )
    for block in transformer.blocks:
        block.attn1.set_processor(UlyssesWanProcessor(sp))
        block.attn2.set_processor(UlyssesWanProcessor(sp))

    def rope_slice(_module, _args, out):
        return tuple(_slice(t, sp) for t in out)  # freqs [1, S, 1, D] → this rank's tokens

    def tokens_slice(_module, args):
        if args[2].dim() == 4:  # timestep_proj [B, S, 6, D]: per-token timesteps
            raise ValueError("parallel.sequence_parallel: per-token timesteps are not supported")
        return (_slice(args[0], sp), *args[1:])

    def tokens_gather(_module, _args, out):
        return gather_sequence(out, sp, dim=1)

    transformer.rope.register_forward_hook(rope_slice)
    transformer.blocks[0].register_forward_pre_hook(tokens_slice)
    transformer.proj_out.register_forward_hook(tokens_gather)
    return transformer
