"""Ulysses sequence parallelism for Z-Image (``ZImageTransformer2DModel``, groupflow's ``z_image``);
:mod:`groupflow.diffusion.sequence_parallel` dispatches here.

Design decision: diffusers' forward stays as it is; the image tokens are cut to this rank's 1/N
where the noise refiner first receives them (a pre-hook on its first layer), and every rank's
rotary table still covers all image tokens — each attention takes its rows from it. Z-Image
pads its image tokens and each caption to a multiple of 32 (pad tokens, unmasked) and then
builds one unified [image; caption] sequence per sample, padded to the batch's longest and
masked per sample (captions differ in length). At one latent shape every sample has the same
image token count, so the cut needs no mask; the captions stay whole on every rank, so their
per-sample padding is a mask over the caption KEYS only, which is diffusers' own unified mask
once the image tokens have been exchanged (every rank then holds all of them):

- noise refiner (image only): this rank's image tokens, q/k/v all-to-all'd as for Wan;
- context refiner (caption only): diffusers' processor, whole on every rank, no exchange;
- main layers ([this rank's image tokens; whole caption]): the image tokens exchanged, the
  caption's 1/N of the heads taken locally and its outputs gathered over the heads
  (:func:`~groupflow.diffusion.sequence_parallel_joint.joint_attention`, as for SD3 and FLUX);
- the final layer's image tokens gathered back (``gather_sequence``) in ``unpatchify``, the one
  place that is told the image size: this instance's ``unpatchify`` is wrapped, a method bound
  to the model so that the worker's copies of it (reference, NFT old) gather their own.

Which rows of a hidden state are this rank's image tokens follows from shapes alone (no state
in the processors, so model copies and activation checkpointing's recomputation stay right):
the rotary table has all S image rows, the hidden only S/N, so S/N is (table − hidden)/(N − 1);
the caption follows them. Each rank's gradient is its share; FSDP2's sum makes the full one.

Refused, each naming ``parallel.sequence_parallel``: an image token count (padded to 32) or
heads the group does not divide, latents of different token counts in one batch (a per-sample
image mask), omni mode (SigLIP and condition images: a noise mask per token) and ControlNet
residuals — none of which groupflow's text-to-image training uses.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from groupflow.diffusion.sequence_parallel_joint import joint_attention
from groupflow.distributed.ulysses import SequenceGroup, all_to_all, gather_sequence

__all__ = ["UlyssesZImageProcessor", "image_share", "enable_ulysses_z_image"]

SEQ_MULTI_OF = 32  # diffusers' transformer_z_image.SEQ_MULTI_OF: each part padded to a multiple


def image_share(hidden: int, table: int, size: int) -> int:
    """How many image tokens this rank's hidden state starts with: its rotary ``table`` has a
    row for every image token (S) and caption token (C), the ``hidden`` state S/N + C rows."""
    share, rest = divmod(table - hidden, size - 1)
    if rest or share < 0 or share > hidden:  # not a cut this module made
        raise ValueError(
            f"parallel.sequence_parallel={size}: a Z-Image hidden state of {hidden} tokens with "
            f"a rotary table of {table} rows is not [this rank's image tokens; the caption]"
        )
    return share


def padded_image_tokens(size: tuple[int, int, int], patch: int, f_patch: int) -> int:
    """A latent [C, F, H, W]'s image token count as Z-Image pads it (to a multiple of 32)."""
    f, h, w = size
    tokens = (f // f_patch) * (h // patch) * (w // patch)
    return tokens + (-tokens) % SEQ_MULTI_OF


def _rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Z-Image's rotary embedding on [B, S, H, D] (complex pairs), as its own processor does."""
    with torch.autocast("cuda", enabled=False):
        z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(z * freqs.unsqueeze(2)).flatten(3).type_as(x)


def _heads(x: torch.Tensor, heads: int, norm: Any = None) -> torch.Tensor:
    out = x.unflatten(-1, (heads, -1))  # [B, S, H, D]
    return out if norm is None else norm(out)


def _image_attention(q, k, v, sp: SequenceGroup) -> torch.Tensor:
    """Self-attention of this rank's image tokens [B, S/N, H, D] over all of them."""
    q, k, v = (all_to_all(t, sp, scatter_dim=2, gather_dim=1) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    ).transpose(1, 2).to(q.dtype)  # fmt: skip
    return all_to_all(out, sp, scatter_dim=1, gather_dim=2).flatten(2, 3)


class UlyssesZImageProcessor:
    """A Z-Image ``Attention`` processor for the noise refiner (this rank's image tokens) and
    the main layers ([this rank's image tokens; the whole caption]) (module docstring)."""

    def __init__(self, sp: SequenceGroup):
        self.sp = sp

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None,
                 attention_mask=None, freqs_cis=None) -> torch.Tensor:  # fmt: skip
        if encoder_hidden_states is not None or freqs_cis is None:
            raise ValueError(
                "parallel.sequence_parallel: Z-Image's attention is self-attention with its "
                "rotary table (freqs_cis)"
            )
        sp = self.sp
        share = image_share(hidden_states.shape[1], freqs_cis.shape[1], sp.size)
        image = share * sp.size  # all image tokens: the caption's table rows follow them
        rows = torch.cat(
            [freqs_cis[:, sp.rank * share : (sp.rank + 1) * share], freqs_cis[:, image:]], 1
        )
        q = _rotary(_heads(attn.to_q(hidden_states), attn.heads, attn.norm_q), rows)
        k = _rotary(_heads(attn.to_k(hidden_states), attn.heads, attn.norm_k), rows)
        v = _heads(attn.to_v(hidden_states), attn.heads)
        if share == hidden_states.shape[1]:  # the noise refiner: image tokens only
            if attention_mask is not None:
                raise ValueError(
                    "parallel.sequence_parallel: Z-Image latents of different token counts in "
                    "one batch (a per-sample image mask) are not supported"
                )
            out = _image_attention(q, k, v, self.sp)
        else:  # the unified mask is over [all image; caption]: its caption part masks keys
            caption_mask = None if attention_mask is None else attention_mask[:, image:]
            text = (q[:, share:], k[:, share:], v[:, share:])
            txt, img = joint_attention(
                text, (q[:, :share], k[:, :share], v[:, :share]), sp, caption_mask
            )
            out = torch.cat([img, txt], 1)
        out = attn.to_out[0](out)
        if len(attn.to_out) > 1:
            out = attn.to_out[1](out)  # dropout
        return out


def _cut(sp: SequenceGroup):
    def cut(_module, args):
        x, mask = args[0], args[1]  # [B, S, dim] (embedded, padded), the image mask
        if mask is not None:
            raise ValueError(
                "parallel.sequence_parallel: Z-Image latents of different token counts in one "
                "batch (a per-sample image mask) are not supported"
            )
        if x.shape[1] % sp.size:
            raise ValueError(
                f"parallel.sequence_parallel={sp.size}: the z_image latent has {x.shape[1]} "
                f"image tokens (padded to a multiple of {SEQ_MULTI_OF}, as Z-Image pads them), "
                f"which do not split evenly over {sp.size} ranks; choose a latent_shape or a "
                f"group size that divides them"
            )
        return (x.chunk(sp.size, dim=1)[sp.rank], *args[1:])

    return cut


def _check_call(_module, args, kwargs):
    x = kwargs.get("x", args[0] if args else None)
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], list):
        raise ValueError(
            "parallel.sequence_parallel: Z-Image's omni mode (SigLIP and condition images, a "
            "noise mask per token) is not supported"
        )
    if kwargs.get("controlnet_block_samples") is not None:
        raise ValueError(
            "parallel.sequence_parallel: Z-Image's ControlNet residuals are not supported"
        )


def _unpatchify(sp: SequenceGroup):
    def unpatchify(self, x, size, patch_size, f_patch_size, x_pos_offsets=None):
        # x: per sample [this rank's image tokens; caption] → all image tokens, then diffusers'
        share = padded_image_tokens(size[0], patch_size, f_patch_size) // sp.size
        tokens = gather_sequence(torch.stack([t[:share] for t in x]), sp, dim=1)
        return type(self).unpatchify(
            self, list(tokens.unbind(0)), size, patch_size, f_patch_size, x_pos_offsets
        )

    return unpatchify


def enable_ulysses_z_image(transformer: nn.Module, sp: SequenceGroup) -> nn.Module:
    """Make a Z-Image transformer run sequence parallel over ``sp``, in place (the heads are
    checked by the caller)."""
    model: Any = transformer  # diffusers' transformer, its submodules read by name
    if len(model.noise_refiner) == 0:
        raise ValueError(
            "parallel.sequence_parallel: a Z-Image transformer without noise refiner layers "
            "(n_refiner_layers: 0) is not supported: the image tokens are cut entering them"
        )
    model.register_forward_pre_hook(_check_call, with_kwargs=True)
    model.noise_refiner[0].register_forward_pre_hook(_cut(sp))
    for layer in (*model.noise_refiner, *model.layers):
        layer.attention.set_processor(UlyssesZImageProcessor(sp))
    # an instance attribute, bound to the model: deepcopy rebinds it to the copy
    model.unpatchify = types.MethodType(_unpatchify(sp), model)
    return transformer
