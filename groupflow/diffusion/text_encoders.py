"""The image kinds' text encoders (SD3, FLUX.1, Qwen-Image, Z-Image, FLUX.2) behind PromptEncoder.

Design decision: as with Wan's (``groupflow.diffusion.encoders``), each class loads the
pipeline's text encoder and tokenizer from LOCAL diffusers-layout folders and reproduces the
pipeline's ``encode_prompt`` on them, returning the per-sample tensors the kind's transformer
call (``groupflow.diffusion.kinds``) reads. A condition must split and concatenate like any Batch
entry, so where the pipeline's captions vary in length (Qwen-Image, Z-Image) they are padded to
``max_sequence_length`` tokens with a mask, which the kind's call strips again. The
unconditional input is the empty prompt, encoded like any other (the pipelines' default negative
prompt).

- :class:`SD3TextEncoder` (``sd3``: StableDiffusion3Pipeline) — CLIP-L's and CLIP-G's
  (``CLIPTextModelWithProjection``) penultimate hidden states over CLIP-L's tokenizer length,
  concatenated per token and zero-padded to T5's width, then T5-XXL's last hidden state over the
  prompt padded/truncated to ``max_sequence_length`` tokens (no mask) after them along the
  sequence; without T5 (``text_encoder_3_path`` unset, the pipeline with ``text_encoder_3=None``)
  its part is zeros of the transformer's ``joint_attention_dim``. The two CLIPs' projected pooled
  outputs concatenated are ``pooled_projections`` (``_get_clip_prompt_embeds``,
  ``_get_t5_prompt_embeds``, ``encode_prompt``). CLIP-L is ``text_encoder_path``, CLIP-G
  ``text_encoder_2_path`` (default ``text_encoder_2/`` beside it), each tokenizer beside its
  encoder unless given, T5's ``tokenizer_3/`` beside it.
- :class:`FluxTextEncoder` (``flux``: FluxPipeline) — T5's last hidden state over the prompt
  padded/truncated to ``max_sequence_length`` tokens, no attention mask and no zeroing
  (``_get_t5_prompt_embeds``), and CLIP's pooled output over ``model_max_length`` tokens
  (``_get_clip_prompt_embeds``): ``encoder_hidden_states`` [B, L, d_T5] and
  ``pooled_projections`` [B, d_CLIP]. CLIP is ``text_encoder_path`` (``text_encoder/``), T5
  ``text_encoder_2_path`` (default ``text_encoder_2/`` beside it), each tokenizer beside its
  encoder unless given.
- :class:`QwenImageTextEncoder` (``qwen_image``: QwenImagePipeline) — the prompt in the
  pipeline's system/user template, Qwen2.5-VL's last hidden state at the real tokens with the
  template's first 34 dropped, at most ``max_sequence_length`` (≤ 1024) of them
  (``_get_qwen_prompt_embeds``, ``encode_prompt``): ``encoder_hidden_states`` [B, L, D] and
  ``encoder_hidden_states_mask`` [B, L]. A longer padding than the pipeline's batch-longest one
  changes nothing: the model is causal and the transformer masks the padding.
- :class:`ZImageTextEncoder` (``z_image``: ZImagePipeline) — the prompt in the tokenizer's chat
  template (a user turn, the generation prompt, thinking enabled), padded/truncated to
  ``max_sequence_length`` tokens, the causal LM's second-to-last hidden state at the real tokens
  (``_encode_prompt``): ``encoder_hidden_states`` [B, L, D] (zero past each caption) and
  ``encoder_hidden_states_mask`` [B, L].
- :class:`Flux2TextEncoder` (``flux2``: Flux2Pipeline, Flux2KleinPipeline) — three of the
  language model's hidden states concatenated per token over the prompt padded/truncated to
  ``max_sequence_length`` tokens, no mask (dev: Mistral3, layers 10/20/30, the system message
  and the prompt through the Pixtral processor's chat template; klein: Qwen3, layers 9/18/27, a
  user turn with thinking off): ``encoder_hidden_states`` [B, L, 3·D].
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from groupflow.diffusion.encoders import (
    TEXT_KEY,
    TOKENIZER_KEY,
    OneModelTextEncoder,
    WanTextEncoder,
    encoder_with_tokenizer,
    frozen,
    local_folder,
    tokenizer_beside,
)

log = logging.getLogger("groupflow")

__all__ = [
    "Flux2TextEncoder",
    "FluxTextEncoder",
    "SD3TextEncoder",
    "QwenImageTextEncoder",
    "ZImageTextEncoder",
    "TEXT_ENCODER_KINDS",
    "load_text_encoder",
]

# the kinds whose text encoder is wired (config.diffusion.TEXT_ENCODER_KINDS says the same)
TEXT_ENCODER_KINDS = ("sd3", "wan", "flux", "qwen_image", "z_image", "flux2")


SD3_KEYS = tuple(f"diffusion.model.{k}" for k in
                 ("text_encoder_path", "text_encoder_2_path", "text_encoder_3_path"))  # fmt: skip


class SD3TextEncoder:
    """SD3's joint CLIP-L + CLIP-G + T5 sequence and pooled CLIP embeddings, as
    StableDiffusion3Pipeline.encode_prompt (no clip_skip). ``width``: the transformer's
    ``joint_attention_dim``, the zeros' width when there is no T5."""

    def __init__(
        self,
        clip_path: str | Path,
        clip_2_path: str | Path | None = None,
        t5_path: str | Path | None = None,
        tokenizer_path: str | Path | None = None,
        tokenizer_2_path: str | Path | None = None,
        max_sequence_length: int = 256,
        width: int | None = None,
        device: str = "cpu",
    ):
        from transformers import CLIPTextModelWithProjection, T5EncoderModel

        clip_l = local_folder(clip_path, "CLIP-L text encoder", SD3_KEYS[0])
        clip_g = local_folder(clip_2_path or clip_l.parent / "text_encoder_2",
                              "CLIP-G text encoder", SD3_KEYS[1])  # fmt: skip
        self.clips = [frozen(CLIPTextModelWithProjection, f, device) for f in (clip_l, clip_g)]
        self.tokenizers = [
            tokenizer_beside(tokenizer_path, clip_l, "tokenizer", TOKENIZER_KEY),
            tokenizer_beside(
                tokenizer_2_path, clip_g, "tokenizer_2", "diffusion.model.tokenizer_2_path"
            ),  # fmt: skip
        ]
        self.t5 = self.t5_tokenizer = None
        if t5_path is not None:
            t5 = local_folder(t5_path, "T5 text encoder", SD3_KEYS[2])
            self.t5 = frozen(T5EncoderModel, t5, device)
            self.t5_tokenizer = tokenizer_beside(None, t5, "tokenizer_3", SD3_KEYS[2])
            width = self.t5.config.d_model
        elif (clip_l.parent / "text_encoder_3" / "config.json").is_file():
            # explicit, since dropping T5 is SD3's documented way to save memory
            log.warning("%s is unset: SD3 runs without the T5 beside %s (its part zeros)",
                        SD3_KEYS[2], clip_l)  # fmt: skip
        if width is None:
            raise ValueError(f"{SD3_KEYS[2]} is unset: SD3's zero T5 part needs the "
                             "transformer's joint_attention_dim")  # fmt: skip
        clip_width = sum(int(c.config.hidden_size) for c in self.clips)
        if clip_width > width:  # the pipeline's pad would silently crop instead
            raise ValueError(
                f"{SD3_KEYS[0]} + {SD3_KEYS[1]}: CLIP-L's and CLIP-G's hidden states are "
                f"{clip_width} wide together, wider than the T5 part's {width}"
            )
        # the pipeline pads both CLIPs to CLIP-L's tokenizer's length
        self.clip_len = int(self.tokenizers[0].model_max_length)
        self.max_len, self.device, self.dim = max_sequence_length, device, int(width)
        self.pooled_dim = sum(int(c.config.projection_dim) for c in self.clips)

    def _t5(self, prompts: list[str]) -> Tensor:
        if self.t5 is None or self.t5_tokenizer is None:
            return torch.zeros(len(prompts), self.max_len, self.dim)
        ids = self.t5_tokenizer(
            prompts, padding="max_length", max_length=self.max_len, truncation=True,
            add_special_tokens=True, return_tensors="pt",
        ).input_ids  # fmt: skip
        return self.t5(ids.to(self.device))[0].float().cpu()

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        prompts = list(prompts)
        hidden, pooled = [], []
        for tokenizer, clip in zip(self.tokenizers, self.clips, strict=True):
            ids = tokenizer(
                prompts, padding="max_length", max_length=self.clip_len, truncation=True,
                return_tensors="pt",
            ).input_ids  # fmt: skip
            out = clip(ids.to(self.device), output_hidden_states=True)
            pooled.append(out[0].float().cpu())  # the projected pooled output (text_embeds)
            hidden.append(out.hidden_states[-2].float().cpu())
        clip_hidden = torch.cat(hidden, dim=-1)
        clip_hidden = torch.nn.functional.pad(clip_hidden, (0, self.dim - clip_hidden.shape[-1]))
        return {
            "encoder_hidden_states": torch.cat([clip_hidden, self._t5(prompts)], dim=-2),
            "pooled_projections": torch.cat(pooled, dim=-1),
        }

    def null(self, n: int) -> dict[str, Tensor]:
        return self([""] * n)


class FluxTextEncoder:
    """FLUX.1's T5 sequence and CLIP pooled embeddings, as FluxPipeline.encode_prompt."""

    def __init__(
        self,
        clip_path: str | Path,
        t5_path: str | Path | None = None,
        tokenizer_path: str | Path | None = None,
        tokenizer_2_path: str | Path | None = None,
        max_sequence_length: int = 512,
        device: str = "cpu",
    ):
        from transformers import CLIPTextModel, T5EncoderModel

        clip, self.clip, self.clip_tokenizer = encoder_with_tokenizer(
            CLIPTextModel, clip_path, "CLIP text encoder", tokenizer_path, device
        )
        _, self.t5, self.t5_tokenizer = encoder_with_tokenizer(
            T5EncoderModel, t5_path or clip.parent / "text_encoder_2", "T5 text encoder",
            tokenizer_2_path, device, key="diffusion.model.text_encoder_2_path",
            tokenizer=("tokenizer_2", "diffusion.model.tokenizer_2_path"),
        )  # fmt: skip
        self.max_len, self.device = max_sequence_length, device
        self.dim, self.pooled_dim = self.t5.config.d_model, self.clip.config.hidden_size

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        prompts = list(prompts)
        clip_ids = self.clip_tokenizer(
            prompts, padding="max_length", max_length=self.clip_tokenizer.model_max_length,
            truncation=True, return_tensors="pt",
        ).input_ids  # fmt: skip
        pooled = self.clip(clip_ids.to(self.device), output_hidden_states=False).pooler_output
        t5_ids = self.t5_tokenizer(
            prompts, padding="max_length", max_length=self.max_len, truncation=True,
            return_tensors="pt",
        ).input_ids  # fmt: skip
        hidden = self.t5(t5_ids.to(self.device), output_hidden_states=False)[0]
        return {
            "encoder_hidden_states": hidden.float().cpu(),
            "pooled_projections": pooled.float().cpu(),
        }

    def null(self, n: int) -> dict[str, Tensor]:
        return self([""] * n)


class ZImageTextEncoder(OneModelTextEncoder):
    """Z-Image's chat-templated Qwen3 captions (hidden_states[-2] at the real tokens), padded to
    ``max_sequence_length`` with a mask, as ZImagePipeline._encode_prompt."""

    MODEL, WHAT = "AutoModel", "Qwen3 text encoder"

    def _template(self, prompt: str) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True,
            enable_thinking=True,
        )  # fmt: skip

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        t = self.tokenizer(
            [self._template(p) for p in prompts], padding="max_length", max_length=self.max_len,
            truncation=True, return_tensors="pt",
        )  # fmt: skip
        mask = t.attention_mask.bool()
        out = self.model(
            input_ids=t.input_ids.to(self.device), attention_mask=mask.to(self.device),
            output_hidden_states=True,
        )  # fmt: skip
        hidden = out.hidden_states[-2].float().cpu()
        # the pipeline keeps only the real tokens: the rest is zero here and masked out
        return {
            "encoder_hidden_states": hidden * mask[:, :, None],
            "encoder_hidden_states_mask": mask.long(),
        }

    def null(self, n: int) -> dict[str, Tensor]:
        return self([""] * n)


# QwenImagePipeline's prompt template and the count of its leading tokens it drops (the system
# turn and the user turn's opening), and the most caption tokens it keeps
QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_IMAGE_DROP = 34
QWEN_IMAGE_MAX_TOKENS = 1024


class QwenImageTextEncoder(OneModelTextEncoder):
    """Qwen-Image's templated Qwen2.5-VL captions (the last hidden state at the real tokens, the
    template's first 34 dropped), padded to ``max_sequence_length`` with a mask, as
    QwenImagePipeline._get_qwen_prompt_embeds and encode_prompt."""

    MODEL, WHAT = "Qwen2_5_VLForConditionalGeneration", "Qwen2.5-VL text encoder"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_len = min(self.max_len, QWEN_IMAGE_MAX_TOKENS)  # the pipeline's own cap

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        # A causal model: truncating after a caption's first max_len tokens (the pipeline cuts
        # its embeddings there) leaves those tokens' hidden states as they were.
        t = self.tokenizer(
            [QWEN_IMAGE_TEMPLATE.format(p) for p in prompts], padding="max_length",
            max_length=self.max_len + QWEN_IMAGE_DROP, truncation=True, return_tensors="pt",
        )  # fmt: skip
        out = self.model(
            input_ids=t.input_ids.to(self.device), attention_mask=t.attention_mask.to(self.device),
            output_hidden_states=True,
        )  # fmt: skip
        last, keep = out.hidden_states[-1].float().cpu(), t.attention_mask.bool()
        hidden = torch.zeros(len(prompts), self.max_len, last.shape[-1])
        mask = torch.zeros(len(prompts), self.max_len, dtype=torch.long)
        for i, (h, m) in enumerate(zip(last, keep, strict=True)):
            caption = h[m][QWEN_IMAGE_DROP:]
            hidden[i, : len(caption)], mask[i, : len(caption)] = caption, 1
        return {"encoder_hidden_states": hidden, "encoder_hidden_states_mask": mask}

    def null(self, n: int) -> dict[str, Tensor]:
        return self([""] * n)


# the hidden states Flux2Pipeline (Mistral3) and Flux2KleinPipeline (Qwen3) concatenate
FLUX2_LAYERS = {"mistral3": (10, 20, 30), "qwen3": (9, 18, 27)}


class Flux2TextEncoder:
    """FLUX.2's text embeddings: three hidden states of its language model concatenated per
    token over the prompt padded/truncated to ``max_sequence_length`` tokens, as
    Flux2Pipeline._get_mistral_3_small_prompt_embeds (dev: Mistral3, the system message and the
    prompt through the processor's chat template) or Flux2KleinPipeline._get_qwen3_prompt_embeds
    (klein: Qwen3, a user turn with thinking off). The model class is the one its config names."""

    def __init__(
        self,
        path: str | Path,
        tokenizer_path: str | Path | None = None,
        max_sequence_length: int = 512,
        device: str = "cpu",
    ):
        import transformers

        path = local_folder(path, "FLUX.2 text encoder", TEXT_KEY)
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
        if config.model_type not in FLUX2_LAYERS:
            raise ValueError(
                f"diffusion.model.text_encoder_path: '{path}' holds a {config.model_type} model; "
                f"FLUX.2's text encoder is {' or '.join(FLUX2_LAYERS)} (dev or klein)"
            )
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        self.layers = FLUX2_LAYERS[config.model_type]
        self.mistral, self.system = config.model_type == "mistral3", SYSTEM_MESSAGE
        cls = getattr(transformers, (config.architectures or ["AutoModel"])[0])
        self.model = frozen(cls, path, device)
        tok = local_folder(tokenizer_path or path.parent / "tokenizer", "tokenizer", TOKENIZER_KEY)
        # dev's tokenizer/ is a Pixtral processor (AutoProcessor, as the pipeline loads it)
        self.tokenizer = transformers.AutoProcessor.from_pretrained(str(tok), local_files_only=True)
        self.max_len, self.device = max_sequence_length, device
        width = getattr(config, "text_config", config).hidden_size
        self.dim = len(self.layers) * width

    def _tokens(self, prompts: list[str]):
        pad = {"padding": "max_length", "truncation": True, "max_length": self.max_len,
               "return_tensors": "pt"}  # fmt: skip
        if self.mistral:
            system = {"role": "system", "content": [{"type": "text", "text": self.system}]}
            batch = [
                [system, {"role": "user", "content": [{"type": "text", "text": p}]}]
                for p in (p.replace("[IMG]", "") for p in prompts)  # as the pipeline's format_input
            ]
            return self.tokenizer.apply_chat_template(
                batch, add_generation_prompt=False, tokenize=True, return_dict=True, **pad
            )
        texts = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
                enable_thinking=False,
            )
            for p in prompts
        ]  # fmt: skip
        return self.tokenizer(texts, **pad)

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        t = self._tokens(list(prompts))
        out = self.model(
            input_ids=t["input_ids"].to(self.device),
            attention_mask=t["attention_mask"].to(self.device), output_hidden_states=True,
            use_cache=False,
        )  # fmt: skip
        hidden = torch.cat([out.hidden_states[k] for k in self.layers], dim=-1)  # per token
        return {"encoder_hidden_states": hidden.float().cpu()}

    def null(self, n: int) -> dict[str, Tensor]:
        return self([""] * n)


def load_text_encoder(kind: str, parts: dict, device: str = "cpu", width: int | None = None):
    """``kind``'s text encoder from ``diffusion.model``'s part keys (``parts``), its models on
    ``device`` in the dtype their configs name (transformers' ``dtype="auto"``); ``width``: the
    transformer's text width (SD3 without T5 fills its part with zeros that wide)."""
    length = parts.get("max_sequence_length", 512)
    path, tokenizer = parts["text_encoder_path"], parts.get("tokenizer_path")
    if kind == "sd3":
        return SD3TextEncoder(
            path, parts.get("text_encoder_2_path"), parts.get("text_encoder_3_path"), tokenizer,
            parts.get("tokenizer_2_path"), length, width=width, device=device,
        )  # fmt: skip
    if kind == "wan":
        return WanTextEncoder(path, tokenizer, length, device=device)
    if kind == "flux":
        return FluxTextEncoder(
            path, parts.get("text_encoder_2_path"), tokenizer, parts.get("tokenizer_2_path"), length,
            device=device,
        )  # fmt: skip
    if kind == "z_image":
        return ZImageTextEncoder(path, tokenizer, length, device=device)
    if kind == "qwen_image":
        return QwenImageTextEncoder(path, tokenizer, length, device=device)
    if kind == "flux2":
        return Flux2TextEncoder(path, tokenizer, length, device=device)
    raise ValueError(
        f"diffusion.model.text_encoder_path: kind '{kind}' has no text encoder wired; kinds with "
        f"one: {', '.join(TEXT_ENCODER_KINDS)}"
    )
