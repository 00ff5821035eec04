"""The VAE decoders of the image kinds (SD3, FLUX.1, Z-Image, Qwen-Image, FLUX.2) behind ``decoder``.

Design decision: the policy's latent is the kind's own layout (``groupflow.diffusion.kinds``), so
each decoder takes exactly that latent and reproduces the lines its diffusers pipeline runs
between the last denoising step and ``image_processor.postprocess`` — nothing more, so a rollout
scores the image the real pipeline would produce. One class per family of math:

- :class:`ScaledVaeDecoder` (``sd3``, ``flux``, ``z_image``: ``AutoencoderKL``) — x /
  scaling_factor + shift_factor, decode (StableDiffusion3Pipeline, FluxPipeline,
  ZImagePipeline; each reads both factors from its ``vae/config.json``).
- :class:`QwenImageVaeDecoder` (``qwen_image``: ``AutoencoderKLQwenImage``) — a one-frame axis,
  x·latents_std + latents_mean, decode, the frame dropped (QwenImagePipeline).
- :class:`Flux2VaeDecoder` (``flux2``: ``AutoencoderKLFlux2``) — the policy latent is already the
  2×2-patchified one: the VAE's batch-norm statistics undone (x·√(var + eps) + mean), the 2×2
  patches unfolded, decode (Flux2Pipeline).

Each maps the VAE's [−1, 1] to [0, 1] (``postprocess(output_type="pt")``) and exposes ``z_dim``,
the policy-latent channels it decodes, which ``models.load_diffusers_model`` checks against
``diffusion.model.latent_shape``. :func:`load_vae_decoder` picks the class by kind and refuses a
folder holding another VAE class, naming both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from groupflow.diffusion.encoders import WanVaeDecoder, frozen, local_folder

__all__ = [
    "VAE_CLASSES",
    "ScaledVaeDecoder",
    "QwenImageVaeDecoder",
    "Flux2VaeDecoder",
    "check_vae_folder",
    "load_vae_decoder",
    "unpatchify_flux2_latents",
]

KEY = "diffusion.model.vae_path"

# kind -> the diffusers VAE class its pipeline decodes with
VAE_CLASSES = {
    "sd3": "AutoencoderKL",
    "wan": "AutoencoderKLWan",
    "flux": "AutoencoderKL",
    "z_image": "AutoencoderKL",
    "qwen_image": "AutoencoderKLQwenImage",
    "flux2": "AutoencoderKLFlux2",
}


def _to_unit(image: Tensor) -> Tensor:
    """[−1, 1] -> [0, 1] as ``VaeImageProcessor.postprocess`` does (its denormalize)."""
    return (image.float() / 2 + 0.5).clamp(0, 1)


def _load(cls_name: str, path: str | Path, device: str) -> Any:
    import diffusers

    cls = getattr(diffusers, cls_name)
    folder = local_folder(path, "VAE", KEY)
    return frozen(cls, folder, device)


class ScaledVaeDecoder:
    """``AutoencoderKL`` decode of [B, C, H, W] latents to images [B, 3, 8H, 8W] in [0, 1]."""

    def __init__(self, path: str | Path, device: str = "cpu"):
        self.vae = _load("AutoencoderKL", path, device)
        c = self.vae.config
        self.scale, self.shift = float(c.scaling_factor), float(c.shift_factor or 0.0)
        self.z_dim, self.device = int(c.latent_channels), device

    @torch.no_grad()
    def __call__(self, x0: Tensor) -> Tensor:
        z = x0 / self.scale + self.shift
        image = self.vae.decode(z.to(self.device, self.vae.dtype), return_dict=False)[0]
        return _to_unit(image).to(x0.device)


class QwenImageVaeDecoder:
    """``AutoencoderKLQwenImage`` decode of [B, C, H, W] latents (one frame) to [B, 3, 8H, 8W]."""

    def __init__(self, path: str | Path, device: str = "cpu"):
        self.vae = _load("AutoencoderKLQwenImage", path, device)
        c = self.vae.config
        shape = (1, c.z_dim, 1, 1, 1)
        self.mean = torch.tensor(c.latents_mean, dtype=torch.float32).view(shape)
        self.std = torch.tensor(c.latents_std, dtype=torch.float32).view(shape)
        self.z_dim, self.device = int(c.z_dim), device

    @torch.no_grad()
    def __call__(self, x0: Tensor) -> Tensor:
        z = x0.float()[:, :, None] * self.std.to(x0.device) + self.mean.to(x0.device)
        video = self.vae.decode(z.to(self.device, self.vae.dtype), return_dict=False)[0]
        return _to_unit(video[:, :, 0]).to(x0.device)


def unpatchify_flux2_latents(x: Tensor) -> Tensor:
    """[B, 4C, H, W] -> [B, C, 2H, 2W]: each position's channels unfolded into its 2×2 patch
    (Flux2Pipeline._unpatchify_latents)."""
    b, c, h, w = x.shape
    x = x.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c // 4, h * 2, w * 2)


class Flux2VaeDecoder:
    """``AutoencoderKLFlux2`` decode of the 2×2-patchified [B, 4C, H, W] latents to
    [B, 3, 16H, 16W] in [0, 1]."""

    def __init__(self, path: str | Path, device: str = "cpu"):
        self.vae = _load("AutoencoderKLFlux2", path, device)
        bn = self.vae.bn  # its running statistics normalise the patchified latent
        self.mean = bn.running_mean.detach().float().view(1, -1, 1, 1).cpu()
        var = bn.running_var.detach().float().view(1, -1, 1, 1).cpu()
        self.std = torch.sqrt(var + self.vae.config.batch_norm_eps)
        self.z_dim, self.device = int(bn.num_features), device

    @torch.no_grad()
    def __call__(self, x0: Tensor) -> Tensor:
        z = x0.float() * self.std.to(x0.device) + self.mean.to(x0.device)
        z = unpatchify_flux2_latents(z)
        image = self.vae.decode(z.to(self.device, self.vae.dtype), return_dict=False)[0]
        return _to_unit(image).to(x0.device)


_DECODERS = {
    "sd3": ScaledVaeDecoder,
    "wan": WanVaeDecoder,
    "flux": ScaledVaeDecoder,
    "z_image": ScaledVaeDecoder,
    "qwen_image": QwenImageVaeDecoder,
    "flux2": Flux2VaeDecoder,
}


def check_vae_folder(kind: str, path: str | Path) -> Path:
    """``path`` as a local folder of the VAE class ``kind``'s pipeline decodes with, reading only
    its ``config.json`` (the policy checks this before any worker starts); another class is an
    error naming both."""
    if kind not in _DECODERS:
        raise ValueError(f"{KEY}: kind '{kind}' has no VAE decoder; kinds with one: "
                         f"{sorted(_DECODERS)}")  # fmt: skip
    want = VAE_CLASSES[kind]
    folder = local_folder(path, want, KEY)
    try:
        found = json.loads((folder / "config.json").read_text()).get("_class_name")
    except json.JSONDecodeError as e:
        raise ValueError(f"{KEY}: '{folder / 'config.json'}' is not valid JSON ({e})") from None
    if found is not None and found != want:
        raise ValueError(
            f"{KEY}: '{folder}' holds a {found}, but diffusion.model.kind '{kind}' decodes with "
            f"a {want}"
        )
    return folder


def load_vae_decoder(kind: str, path: str | Path, device: str = "cpu"):
    """``kind``'s decoder from the local VAE folder ``path`` (:func:`check_vae_folder`)."""
    return _DECODERS[kind](check_vae_folder(kind, path), device=device)
