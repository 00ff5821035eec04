"""Vision-language models: a prompt's image tensors, their batching, positions and the forward.

Design decision: a prompt with images is, for groupflow, its token ids (the processor's, image
placeholder tokens expanded: token-in/token-out holds, the placeholders are prompt tokens and so
never in the loss) plus a ``VisionInputs`` — the processor's other tensors for that prompt
(``pixel_values``, ``image_grid_thw`` for Qwen2/2.5/3-VL; ``pixel_values``,
``pixel_attention_mask`` for Idefics3 / SmolVLM), kept on the CPU. Samples carry it next to their
ids (``Batch`` key ``vision``, one per sample, shared by a prompt's G samples), so rollout,
log-prob and update see the same images, and a micro-batch collates only its own rows'.

The forward goes through the model's multimodal base (``model.model``: it embeds the images and
scatters them into the placeholder positions) for the prompt, then through the language model
(``get_decoder()``) on that cache for the response — as generation runs them, so a sampled token
that happens to be a placeholder id is text, never matched against image features
(``causal_lm._image_prompt_hidden``). Positions are computed here and passed explicitly, for two
reasons: left padding (the base would count pad tokens), and Qwen-VL's multimodal RoPE, whose
positions come from the image grids (``get_rope_index``) — a generated token's position is the
prompt's last position + 1 + t in all three sections, so decoding needs only the prompt's next
position. HF's own ``rope_deltas`` state is never used: it is per call batch and would go stale
when the cache is repeated for G samples.

Switched off for image prompts, with the reason: sharing one prompt pass among a prompt's G rows
in the training forward (``causal_lm.response_hidden_states``' K/V reuse) — rows are matched by
token ids, and two prompts with equal ids but different images would be merged; each row runs its
own prompt pass (the image tower too: cheap next to the language model, and with
``model.freeze_vision`` it has no backward). The static decode cache (``rollout.static_cache``)
drives Llama layers with 1-D positions and knows nothing of merged image embeddings, so image
prompts decode with the HF dynamic cache; the shared prefill of generation (one per prompt, its
cache repeated G times) works as for text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "VisionInputs",
    "collate_vision",
    "multimodal_base",
    "is_vision_model",
    "vision_positions",
    "freeze_vision_tower",
    "encode_image_prompt",
    "encode_text_with_images",
    "join_vision",
    "placeholder_ids",
    "collapse_placeholders",
]

# Idefics3's (SmolVLM's) image block markers, in its processor's vocabulary.
IDEFICS3_MARKS = ("<fake_token_around_image>", "<global-img>")
# Per-token outputs of processors that groupflow recomputes from the ids, not per-prompt tensors.
_PER_TOKEN = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


@dataclass(eq=False)
class VisionInputs:
    """The processor's image tensors of one prompt (CPU), e.g. ``pixel_values`` and
    ``image_grid_thw``; ``num_images`` for logging and checks; ``images``: the decoded images
    themselves, in placeholder order, for engines that take raw images (vLLM's multimodal
    inputs). Compared by identity: the G samples of a prompt share one object (pickled once)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    num_images: int = 0
    images: list = field(default_factory=list)


def is_vision_model(model: nn.Module) -> bool:
    """An HF vision-language model (its config has a ``vision_config``)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def multimodal_base(model: nn.Module) -> nn.Module:
    """The base that embeds images and runs the language model (``XForConditionalGeneration.model``)."""
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "forward"):
        raise ValueError(f"{type(model).__name__} has no multimodal base model (.model)")
    return base


def collate_vision(items: Sequence[VisionInputs | None], device=None) -> dict[str, torch.Tensor]:
    """The model inputs of several rows' images, in row order (rows without images add nothing).

    Per-image tensors (Qwen: ``pixel_values`` [patches, D], ``image_grid_thw`` [images, 3])
    concatenate along dim 0; Idefics3's [1, images, ...] tensors along the image dim 1, into one
    pseudo-row: both models scatter image features into the placeholder tokens in order, so the
    pairing of images with rows is the order of the rows' placeholders.
    """
    present = [v for v in items if v is not None and v.tensors]
    if not present:
        return {}
    keys = list(present[0].tensors)
    out: dict[str, torch.Tensor] = {}
    for k in keys:
        parts = [v.tensors[k] for v in present]
        per_row = all(p.dim() >= 4 and p.shape[0] == 1 for p in parts)
        if per_row and len({p.shape[2:] for p in parts}) > 1:
            parts = _pad_trailing(parts)  # Idefics3 pads images of one call to the largest
        t = torch.cat(parts, dim=1 if per_row else 0) if len(parts) > 1 else parts[0]
        out[k] = t.to(device) if device is not None else t
    return out


def _pad_trailing(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Zero-pad [1, n, ..., H, W] tensors to the largest H, W (pixels and their attention mask:
    padded pixels are masked out, as the processor pads within one call)."""
    h = max(p.shape[-2] for p in parts)
    w = max(p.shape[-1] for p in parts)
    return [torch.nn.functional.pad(p, (0, w - p.shape[-1], 0, h - p.shape[-2])) for p in parts]


def _rope_index_fn(model: nn.Module):
    base = getattr(model, "model", None)
    return getattr(base, "get_rope_index", None)


def _token_types(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Qwen-VL's ``mm_token_type_ids``: 1 at image placeholders, 2 at video ones, 0 for text."""
    cfg = model.config
    types = torch.zeros_like(ids, dtype=torch.int)
    for value, name in ((1, "image_token_id"), (2, "video_token_id")):
        token = getattr(cfg, name, None)
        if token is not None:
            types = types.masked_fill(ids == token, value)
    return types


def vision_positions(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                     tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Position ids for left-padded rows ``ids`` [B, L] and each row's next position [B].

    Multimodal RoPE (Qwen-VL): [3, B, L] from the image grids, next = max + 1. Otherwise the
    1-D positions of the text models, [B, L] (0 at the first real token), next = the row's length.
    """
    rope_index = _rope_index_fn(model)
    if rope_index is not None:
        grid = tensors.get("image_grid_thw")
        if grid is None:  # a text row: 1-D positions broadcast to the three sections
            pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
            return pos[None].expand(3, -1, -1), mask.long().sum(-1)
        pos, deltas = rope_index(
            ids, mm_token_type_ids=_token_types(model, ids), image_grid_thw=grid,
            video_grid_thw=tensors.get("video_grid_thw"), attention_mask=mask,
        )  # fmt: skip
        return pos, mask.long().sum(-1) + deltas.view(-1).to(mask.device)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return pos, mask.long().sum(-1)


def vision_tower_modules(model: nn.Module) -> list[nn.Module]:
    """The image encoder and its projector of an HF VLM (names differ per family)."""
    base = getattr(model, "model", model)
    names = ("visual", "vision_model", "vision_tower", "connector", "multi_modal_projector")
    return [getattr(base, n) for n in names if isinstance(getattr(base, n, None), nn.Module)]


def freeze_vision_tower(model: nn.Module) -> int:
    """Stop gradients into the image encoder and projector (``model.freeze_vision``); returns
    the number of parameters frozen. Qwen-VL's merger sits inside ``visual`` and freezes with it."""
    frozen = 0
    for module in vision_tower_modules(model):
        for p in module.parameters():
            if p.requires_grad:
                p.requires_grad_(False)
                frozen += p.numel()
    return frozen


# --------------------------------------------------------------------------------------------
# Prompts -> ids and VisionInputs
# --------------------------------------------------------------------------------------------


def template_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list]:
    """Messages for ``processor.apply_chat_template`` (image parts without their pixels: the
    template writes placeholders only) and the images in placeholder order."""
    out, images = [], []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.get("type") == "image":
                    images.append(p["image"])
                    parts.append({"type": "image"})
                else:
                    parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out, images


def encode_image_prompt(processor, messages: list[dict[str, Any]],
                        add_generation_prompt: bool = True) -> tuple[str, list[int], VisionInputs]:  # fmt: skip
    """(templated text, token ids with the placeholders expanded, VisionInputs) of one prompt."""
    plain, images = template_messages(messages)
    text = processor.apply_chat_template(
        plain, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return text, *encode_text_with_images(processor, text, images)


def encode_text_with_images(processor, text: str, images: list) -> tuple[list[int], VisionInputs]:
    """Token ids of ``text`` (a templated prompt, or a fragment such as an observation) with its
    image placeholders expanded for ``images`` (decoded PIL images, in placeholder order), and
    their VisionInputs (empty without images)."""
    if not images:
        ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        return list(ids), VisionInputs()
    enc = processor(text=[text], images=_images_arg(processor, images), return_tensors="pt",
                    add_special_tokens=False)  # fmt: skip
    ids = enc["input_ids"][0].tolist()
    tensors = {k: v for k, v in enc.items() if k not in _PER_TOKEN and isinstance(v, torch.Tensor)}
    return ids, VisionInputs(tensors, len(images), list(images))


def join_vision(items: Sequence[VisionInputs | None]) -> VisionInputs | None:
    """One row's VisionInputs from the parts of its sequence in order (a prompt's images, then
    each observation's): the tensors ``collate_vision`` makes of them, as one row. None: no
    images in any part."""
    present = [v for v in items if v is not None and v.tensors]
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    return VisionInputs(
        collate_vision(present),
        sum(v.num_images for v in present),
        [im for v in present for im in v.images],
    )


def collapse_placeholders(ids: Sequence[int], model_config, tokenizer) -> list[int]:
    """``ids`` with each image's expanded placeholder block put back to the one token the chat
    template writes for it — the token prompt vLLM's multimodal processor expands itself.

    Idefics3 / SmolVLM: a block runs from ``<fake_token_around_image>`` to the one that closes
    its ``<global-img>`` image run (tiles and their row/column tokens included) and becomes
    ``<image>``. Qwen-VL and others: each run of image (video) tokens becomes one token."""
    image = getattr(model_config, "image_token_id", None)
    kind = getattr(model_config, "model_type", "")
    out: list[int] = []
    if kind in ("idefics3", "smolvlm"):
        if image is None:
            raise ValueError(f"a {kind} model config without image_token_id")
        fake, glob = (tokenizer.convert_tokens_to_ids(t) for t in IDEFICS3_MARKS)
        i = 0
        while i < len(ids):
            if ids[i] != fake:
                out.append(ids[i])
                i += 1
                continue
            j, seen_global = i + 1, False
            while j < len(ids):
                seen_global |= ids[j] == glob
                if ids[j] == fake and seen_global and ids[j - 1] == image:
                    break
                j += 1
            if j == len(ids):  # a stray marker, not an image block
                out.append(ids[i])
                i += 1
                continue
            out.append(image)
            i = j + 1
        return out
    runs = set(placeholder_ids(model_config))
    for t in ids:
        if not (t in runs and out and out[-1] == t):
            out.append(t)
    return out


def placeholder_ids(model_config) -> list[int]:
    """The token ids the multimodal base replaces by image (or video) features."""
    ids = [getattr(model_config, k, None) for k in ("image_token_id", "video_token_id")]
    return [int(i) for i in ids if i is not None]


def _images_arg(processor, images: list):
    # Idefics3 / SmolVLM processors take images nested per text; Qwen's a flat list.
    name = type(processor).__name__
    return [images] if ("Idefics" in name or "SmolVLM" in name) else images
