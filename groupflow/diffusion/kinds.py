"""How each diffusers transformer kind is called, exactly as its diffusers pipeline calls it.

Design decision: the policy always sees one latent layout per sample — ``[C, H, W]`` for images,
``[C, F, H, W]`` for Wan video — and a velocity v = ε − x0 in that layout; everything a kind's
pipeline does around its transformer call (packing the latent into tokens, position ids or image
shapes, the timestep's scale, text masks, a guidance embedding, the sign of the output) lives
here as small pure functions, one call function per kind in :data:`KIND_CALLS`. A kind is then
four entries: its transformer class (:data:`KIND_CLASSES`), its call, its latent check
(:func:`check_kind_latent`) and its default shift (:func:`default_shift`). Conditions are
per-sample tensors (``cond``) made by a ``PromptEncoder``; where the transformer wants a list of
variable-length captions (Z-Image) or a text mask (Qwen-Image), ``cond`` carries a padded
``encoder_hidden_states`` and an ``encoder_hidden_states_mask`` [B, L] (1: a real token), so it
still splits and concatenates like any Batch entry.

- ``sd3`` / ``wan``: the latent as is, timestep 1000·σ.
- ``flux`` (FLUX.1, FluxPipeline): 2×2 patches as tokens [B, H/2·W/2, 4C], (0, row, column)
  image ids, zero text ids, σ as the timestep (the model scales by 1000), and the guidance scale
  where the model embeds it (``guidance_embeds``).
- ``qwen_image`` (QwenImagePipeline): the same 2×2 packing, ``img_shapes`` [(1, H/2, W/2)] per
  sample for its rotary embedding, σ as the timestep, the text mask.
- ``z_image`` (ZImagePipeline): a list of [C, 1, H, W] latents and a list of unpadded captions,
  timestep 1 − σ; the model predicts x0 − ε, so the velocity is its output negated.
- ``flux2`` (Flux2Pipeline / Flux2KleinPipeline): the latent is the pipeline's own sampling state,
  the 2×2-patchified VAE latent [in_channels, H, W]; each position a token [B, H·W, C],
  (0, row, column, 0) image ids and (0, 0, 0, index) text ids, σ as the timestep, and the
  guidance scale where the model embeds it (FLUX.2-dev; klein has none).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from groupflow.diffusion.schedule import flux2_shift, flux_shift

__all__ = [
    "KIND_CLASSES",
    "KIND_CALLS",
    "QWEN_IMAGE_SHIFT",
    "check_kind_latent",
    "default_shift",
    "freeze_unused",
    "pack_flux_latents",
    "unpack_flux_latents",
    "flux_image_ids",
    "qwen_image_shapes",
    "z_image_inputs",
    "z_image_captions",
    "pack_flux2_latents",
    "unpack_flux2_latents",
    "flux2_image_ids",
    "flux2_text_ids",
]

KIND_CLASSES = {
    "sd3": "SD3Transformer2DModel",
    "wan": "WanTransformer3DModel",
    "flux": "FluxTransformer2DModel",
    "qwen_image": "QwenImageTransformer2DModel",
    "z_image": "ZImageTransformer2DModel",
    "flux2": "Flux2Transformer2DModel",
}

# Qwen-Image's scheduler (Qwen/Qwen-Image scheduler_config.json): e^μ between these token counts
QWEN_IMAGE_SHIFT = {"base_seq_len": 256, "max_seq_len": 8192, "base_shift": 0.5, "max_shift": 0.9}


# ----- packing and ids -------------------------------------------------------------------------


def pack_flux_latents(x: Tensor) -> Tensor:
    """[B, C, H, W] -> [B, H/2·W/2, 4C]: each 2×2 patch a token, channel-major within it (the
    order of FluxPipeline._pack_latents and QwenImagePipeline._pack_latents)."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_flux_latents(tokens: Tensor, height: int, width: int) -> Tensor:
    """The inverse of :func:`pack_flux_latents`: [B, H/2·W/2, 4C] -> [B, C, H, W]."""
    b, _, d = tokens.shape
    x = tokens.reshape(b, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, height, width)


def flux_image_ids(height: int, width: int, device=None, dtype=torch.float32) -> Tensor:
    """[H/2·W/2, 3] position ids of the packed tokens: (0, row, column) of each 2×2 patch."""
    rows = torch.arange(height // 2, device=device, dtype=dtype)
    cols = torch.arange(width // 2, device=device, dtype=dtype)
    grid = torch.stack(torch.meshgrid(rows, cols, indexing="ij"), -1).reshape(-1, 2)
    return torch.cat([torch.zeros(grid.shape[0], 1, device=device, dtype=dtype), grid], 1)


def qwen_image_shapes(batch: int, height: int, width: int) -> list[list[tuple[int, int, int]]]:
    """QwenImagePipeline's ``img_shapes``: one (frames, rows, columns) of packed tokens per
    sample, what its rotary embedding is laid out by."""
    return [[(1, height // 2, width // 2)]] * batch


def z_image_inputs(x: Tensor) -> list[Tensor]:
    """[B, C, H, W] -> B latents [C, 1, H, W] (ZImagePipeline's ``unsqueeze(2).unbind(0)``)."""
    return list(x.unsqueeze(2).unbind(0))


def z_image_captions(hidden: Tensor, mask: Tensor) -> list[Tensor]:
    """A padded [B, L, D] and its mask [B, L] -> B captions [L_i, D] of the real tokens only (what
    ZImagePipeline passes: its caption positions, and so the image's, depend on L_i)."""
    return [h[m.bool()] for h, m in zip(hidden, mask, strict=True)]


def pack_flux2_latents(x: Tensor) -> Tensor:
    """[B, C, H, W] -> [B, H·W, C] (Flux2Pipeline._pack_latents)."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h * w).permute(0, 2, 1)


def unpack_flux2_latents(tokens: Tensor, height: int, width: int) -> Tensor:
    """The inverse of :func:`pack_flux2_latents`: [B, H·W, C] -> [B, C, H, W]."""
    b, _, c = tokens.shape
    # a copy, not a view: FSDP2's backward hook on a module output is lost to in-place ops on views
    return tokens.permute(0, 2, 1).reshape(b, c, height, width).contiguous()


def flux2_image_ids(height: int, width: int, device=None) -> Tensor:
    """[H·W, 4] (time, row, column, layer) ids: (0, h, w, 0) (Flux2Pipeline._prepare_latent_ids)."""
    grid = torch.cartesian_prod(
        torch.arange(1), torch.arange(height), torch.arange(width), torch.arange(1)
    )
    return grid.to(device)


def flux2_text_ids(length: int, device=None) -> Tensor:
    """[L, 4] ids of the text tokens: (0, 0, 0, index) (Flux2Pipeline._prepare_text_ids)."""
    return torch.cartesian_prod(
        torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(length)
    ).to(device)


# ----- the calls: (transformer, x, σ[B], cond, guidance) -> v = ε − x0 in x's layout -----------


def _guidance(transformer: nn.Module, x: Tensor, guidance: float) -> Tensor | None:
    if not getattr(transformer.config, "guidance_embeds", False):
        return None
    return torch.full((x.shape[0],), guidance, device=x.device, dtype=x.dtype)


def call_plain(transformer, x: Tensor, sigma: Tensor, cond: dict[str, Tensor], guidance: float):
    """SD3 and Wan: the latent as is, timestep 1000·σ, the condition tensors as keywords."""
    out = transformer(
        hidden_states=x, timestep=1000.0 * sigma.to(x.dtype), return_dict=False,
        **{k: v.to(x.dtype) for k, v in cond.items()},
    )  # fmt: skip
    return out[0]


def call_flux(transformer, x: Tensor, sigma: Tensor, cond: dict[str, Tensor], guidance: float):
    h, w = x.shape[2:]
    text = cond["encoder_hidden_states"].to(x.dtype)
    out = transformer(
        hidden_states=pack_flux_latents(x), timestep=sigma.to(x.dtype),
        encoder_hidden_states=text, pooled_projections=cond["pooled_projections"].to(x.dtype),
        img_ids=flux_image_ids(h, w, x.device, x.dtype),
        txt_ids=torch.zeros(text.shape[1], 3, device=x.device, dtype=x.dtype),
        guidance=_guidance(transformer, x, guidance), return_dict=False,
    )  # fmt: skip
    return unpack_flux_latents(out[0], h, w)


def call_qwen_image(
    transformer, x: Tensor, sigma: Tensor, cond: dict[str, Tensor], guidance: float
):
    # No guidance: Qwen-Image is not guidance-distilled (its timestep embedding takes none).
    b, _, h, w = x.shape
    out = transformer(
        hidden_states=pack_flux_latents(x), timestep=sigma.to(x.dtype),
        encoder_hidden_states=cond["encoder_hidden_states"].to(x.dtype),
        encoder_hidden_states_mask=cond["encoder_hidden_states_mask"],
        img_shapes=qwen_image_shapes(b, h, w), return_dict=False,
    )  # fmt: skip
    return unpack_flux_latents(out[0], h, w)


def call_z_image(transformer, x: Tensor, sigma: Tensor, cond: dict[str, Tensor], guidance: float):
    hidden, mask = cond["encoder_hidden_states"].to(x.dtype), cond["encoder_hidden_states_mask"]
    captions = z_image_captions(hidden, mask)
    out = transformer(z_image_inputs(x), 1.0 - sigma.to(x.dtype), captions, return_dict=False)
    return -torch.stack([o.squeeze(1) for o in out[0]])  # [C, 1, H, W] each; stacked: no view


def call_flux2(transformer, x: Tensor, sigma: Tensor, cond: dict[str, Tensor], guidance: float):
    h, w = x.shape[2:]
    text = cond["encoder_hidden_states"].to(x.dtype)
    out = transformer(
        hidden_states=pack_flux2_latents(x), timestep=sigma.to(x.dtype),
        encoder_hidden_states=text, img_ids=flux2_image_ids(h, w, x.device),
        txt_ids=flux2_text_ids(text.shape[1], x.device),
        guidance=_guidance(transformer, x, guidance), return_dict=False,
    )  # fmt: skip
    return unpack_flux2_latents(out[0], h, w)


KIND_CALLS: dict[str, Callable[..., Tensor]] = {
    "sd3": call_plain,
    "wan": call_plain,
    "flux": call_flux,
    "qwen_image": call_qwen_image,
    "z_image": call_z_image,
    "flux2": call_flux2,
}


def freeze_unused(transformer: nn.Module, kind: str) -> None:
    """Qwen-Image's last block still updates the text stream, but only the image stream goes on
    to the output: that block's text attention output projection and text MLP never get a
    gradient. DDP (without ``find_unused_parameters``) fails on parameters that get none, and
    under FSDP2 they would still carry optimizer state and gradient buffers for nothing, so they
    are frozen (in the reference copies too, which changes nothing; LoRA adapters put on them
    are frozen again after injection, ``build.lora_adapters``)."""
    if kind != "qwen_image":
        return
    blocks = getattr(transformer, "transformer_blocks", None)
    if not blocks:
        return
    last = blocks[-1]
    last.attn.to_add_out.requires_grad_(False)
    last.txt_mlp.requires_grad_(False)


# ----- what a kind's latent must be, and its default shift -------------------------------------


def _divisible(key: str, shape: Sequence[int], q: int, why: str) -> None:
    for name, d in zip(("height", "width"), shape[1:]):
        if d % q:
            raise ValueError(f"{key}: {name} {d} is not divisible by {why}")


def check_kind_latent(config, kind: str, shape: Sequence[int], key: str) -> bool:
    """Check a latent for the kinds this module packs; False for a kind it does not handle (SD3,
    Wan: ``models.check_latent_fits`` does)."""
    channels = getattr(config, "in_channels", None)
    if kind in ("flux", "qwen_image"):  # the pipeline packs 2×2 patches: in_channels = 4·C
        name = {"flux": "FLUX", "qwen_image": "Qwen-Image"}[kind]
        if channels is not None and shape[0] * 4 != channels:
            raise ValueError(
                f"{key}: the {KIND_CLASSES[kind]} takes packed 2x2 patches of "
                f"{channels // 4} latent channels (in_channels={channels}), not {shape[0]}"
            )
        _divisible(key, shape, 2, f"{name}'s 2x2 packing")
        return True
    if kind == "z_image":
        if channels is not None and shape[0] != channels:
            raise ValueError(f"{key}: the {KIND_CLASSES[kind]} takes {channels} latent channels, "
                             f"not {shape[0]}")  # fmt: skip
        patch = int(getattr(config, "all_patch_size", (2,))[0])
        _divisible(key, shape, patch, f"Z-Image's patch size {patch}")
        return True
    if kind == "flux2":  # the latent is already the pipeline's 2×2-patchified one
        if channels is not None and shape[0] != channels:
            raise ValueError(
                f"{key}: the {KIND_CLASSES[kind]} takes the 2x2-patchified latent of "
                f"{channels} channels (in_channels={channels}), not {shape[0]}"
            )
        return True
    return False


def default_shift(kind: str, latent_shape: Sequence[int], num_steps: int) -> float:
    """The shift a kind's pipeline uses when ``diffusion.shift`` is unset: FLUX.1 and Qwen-Image
    e^μ of the packed token count with their schedulers' bounds, FLUX.2 its empirical e^μ of the
    token count and the step count; SD3, Wan and Z-Image (Z-Image-Turbo's scheduler: a fixed
    shift, no dynamic shifting) 3.0."""
    if kind in ("flux", "qwen_image"):
        _, h, w = latent_shape
        tokens = (h // 2) * (w // 2)
        return flux_shift(tokens) if kind == "flux" else flux_shift(tokens, **QWEN_IMAGE_SHIFT)
    if kind == "flux2":
        _, h, w = latent_shape
        return flux2_shift(h * w, num_steps)
    return 3.0
