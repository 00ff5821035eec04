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
    "OneModelTextEncoder", "WanTextEncoder", "WanVaeDecoder", "clean_prompt",
    "encoder_with_tokenizer", "frozen", "local_folder", "tokenizer_beside", "TEXT_KEY", "TOKENIZER_KEY",
]  # fmt: skip

TEXT_KEY, TOKENIZER_KEY = "diffusion.model.text_encoder_path", "diffusion.model.tokenizer_path"


def local_folder(path: str | Path, what: str, key: str) -> Path:
    """``path`` as a local model or tokenizer folder, or an error naming ``key``."""
    p = Path(path).expanduser()
    if not (p / "config.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise ModelPathError(f"{key}: '{p}' is not a local {what} folder (no config.json)")
    return p


def frozen(cls: Any, folder: Path, device: str) -> Any:
    """A pipeline part that only encodes or decodes: ``cls`` (a transformers or diffusers class)
    from the local ``folder``, in eval mode, without gradients, on ``device`` (Any: transformers
    types ``from_pretrained``'s result so that ``.to()`` looks uncallable)."""
    model = cls.from_pretrained(str(folder), local_files_only=True)
    return model.eval().requires_grad_(False).to(device)


def tokenizer_beside(path: str | Path | None, encoder: Path, name: str, key: str):
    """The tokenizer at ``path``, else the pipeline's ``name/`` folder beside the encoder's."""
    from transformers import AutoTokenizer

    folder = local_folder(path or encoder.parent / name, "tokenizer", key)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def encoder_with_tokenizer(
    cls: Any,
    path: str | Path,
    what: str,
    tokenizer_path: str | Path | None,
    device: str,
    key: str = TEXT_KEY,
    tokenizer: tuple[str, str] = ("tokenizer", TOKENIZER_KEY),
) -> tuple[Path, Any, Any]:
    """A text encoder's checked folder, its frozen model and its tokenizer (at ``tokenizer_path``,
    else the pipeline's ``tokenizer[0]/`` beside it): the lines every encoder class starts with;
    errors name ``key`` or ``tokenizer[1]``."""
    folder = local_folder(path, what, key)
    return folder, frozen(cls, folder, device), tokenizer_beside(tokenizer_path, folder, *tokenizer)


class OneModelTextEncoder:
    """What the text encoders of one transformers model (Wan's UMT5, Z-Image's Qwen3, Qwen-Image's
    Qwen2.5-VL) share: the model and its tokenizer loaded from local folders, the token budget,
    the device and the hidden width ``dim``. Each subclass names its transformers class
    (``MODEL``, imported on use: transformers is a heavy import) and encodes as its pipeline."""

    MODEL = "AutoModel"
    WHAT = "text encoder"

    def __init__(
        self,
        path: str | Path,
        tokenizer_path: str | Path | None = None,
        max_sequence_length: int = 512,
        device: str = "cpu",
    ):
        import transformers

        _, self.model, self.tokenizer = encoder_with_tokenizer(
            getattr(transformers, self.MODEL), path, self.WHAT, tokenizer_path, device
        )
        self.max_len, self.device = max_sequence_length, device
        config = self.model.config  # a vision-language model keeps its text width in text_config
        self.dim: int = getattr(config, "text_config", config).hidden_size


def clean_prompt(text: str) -> str:
    """The pipeline's prompt clean-up: HTML entities unescaped, whitespace collapsed."""
    return " ".join(html.unescape(html.unescape(text)).split())


class WanTextEncoder(OneModelTextEncoder):
    """UMT5 prompt embeddings [B, max_sequence_length, d_model], zero past each prompt's tokens."""

    MODEL, WHAT = "UMT5EncoderModel", "UMT5 text encoder"

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
        self.vae = frozen(AutoencoderKLWan, path, device)
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
