"""Wan's text encoder and VAE decoder behind the FlowModel's PromptEncoder and decoder slots.

Design decision: the transformer adapter stays unaware of text and pixels; these two classes load
the pipeline's other parts from LOCAL diffusers-layout folders and reproduce what diffusers'
``WanPipeline`` does with them, so a rollout scores the frames the real pipeline would produce:

- :class:`WanTextEncoder` — the UMT5 encoder's last hidden state over the prompt padded/truncated
  to ``max_sequence_length`` tokens, with every position past the prompt's length set to zero
  (the pipeline's ``_get_t5_prompt_embeds``); the unconditional input is the empty prompt.
- :class:`WanVaeDecoder` — un-normalises the latent with the VAE's ``latents_mean`` /
  ``latents_std`` (x·std + mean), decodes, and maps [−1, 1] to [0, 1]: [B, 3, F', H', W'].
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from groupflow.diffusion.models import ModelPathError

__all__ = [
    "WanTextEncoder", "WanVaeDecoder", "clean_prompt", "frozen", "local_folder",
    "tokenizer_beside",
]  # fmt: skip


def local_folder(path: str | Path, what: str, key: str) -> Path:
    """``path`` as a local model or tokenizer folder, or an error naming ``key``."""
    p = Path(path).expanduser()
    if not (p / "config.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise ModelPathError(f"{key}: '{p}' is not a local {what} folder (no config.json)")
    return p


def frozen(model: Any, device: str) -> Any:
    """A pipeline part that only encodes or decodes: eval mode, no gradients, on ``device``
    (Any: transformers types ``from_pretrained``'s result so that ``.to()`` looks uncallable)."""
    return model.eval().requires_grad_(False).to(device)


def tokenizer_beside(path: str | Path | None, encoder: Path, name: str, key: str):
    """The tokenizer at ``path``, else the pipeline's ``name/`` folder beside the encoder's."""
    from transformers import AutoTokenizer

    folder = local_folder(path or encoder.parent / name, "tokenizer", key)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def clean_prompt(text: str) -> str:
    """The pipeline's prompt clean-up: HTML entities unescaped, whitespace collapsed."""
    return " ".join(html.unescape(html.unescape(text)).split())


class WanTextEncoder:
    """UMT5 prompt embeddings [B, max_sequence_length, d_model], zero past each prompt's tokens."""

    def __init__(
        self,
        path: str | Path,
        tokenizer_path: str | Path | None = None,
        max_sequence_length: int = 512,
        device: str = "cpu",
    ):
        from transformers import UMT5EncoderModel

        path = local_folder(path, "UMT5 text encoder", "diffusion.model.text_encoder_path")
        self.model = frozen(UMT5EncoderModel.from_pretrained(str(path), local_files_only=True),
                            device)  # fmt: skip
        self.tokenizer = tokenizer_beside(tokenizer_path, path, "tokenizer",
                                          "diffusion.model.tokenizer_path")  # fmt: skip
        self.max_len, self.device = max_sequence_length, device
        self.dim = self.model.config.d_model

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        t = self.tokenizer(
            [clean_prompt(p) for p in prompts], padding="max_length", max_length=self.max_len,
            truncation=True, add_special_tokens=True, return_attention_mask=True,
            return_tensors="pt",
        )  # fmt: skip
        hidden = self.model(t.input_ids.to(self.device), t.attention_mask.to(self.device))
        hidden = hidden.last_hidden_state.float().cpu()
        keep = t.attention_mask.gt(0)  # the pipeline zeroes everything past the prompt's tokens
        return {"encoder_hidden_states": hidden * keep[:, :, None]}

    def null(self, n: int) -> dict[str, Tensor]:
        return self([""] * n)


class WanVaeDecoder:
    """``AutoencoderKLWan`` decode of normalised latents to videos in [0, 1]."""

    def __init__(self, path: str | Path, device: str = "cpu"):
        from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

        path = local_folder(path, "AutoencoderKLWan", "diffusion.model.vae_path")
        self.vae = frozen(
            AutoencoderKLWan.from_pretrained(str(path), local_files_only=True), device
        )
        c = self.vae.config  # a FrozenDict with attribute access
        shape = (1, c.z_dim, 1, 1, 1)
        self.mean = torch.tensor(c.latents_mean, dtype=torch.float32).view(shape)
        self.std = torch.tensor(c.latents_std, dtype=torch.float32).view(shape)
        self.z_dim, self.device = c.z_dim, device

    @torch.no_grad()
    def __call__(self, x0: Tensor) -> Tensor:
        z = x0.float() * self.std.to(x0.device) + self.mean.to(x0.device)
        video = self.vae.decode(z.to(self.device), return_dict=False)[0]
        return ((video.float() + 1) / 2).clamp(0, 1).to(x0.device)
