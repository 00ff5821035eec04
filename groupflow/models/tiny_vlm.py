"""Tiny vision-language models built from scratch: Idefics3 (SmolVLM's architecture) and Qwen2-VL.

Design decision: the CPU demo and the tests use real HF architectures with tiny random configs —
a small ViT patch encoder plus the tiny Llama-style language model the text demo uses (Idefics3),
or Qwen2-VL's own tower and multimodal RoPE — with processors built around groupflow's character
tokenizer, so everything they exercise (processor, placeholder expansion, the multimodal forward,
generation, LoRA, checkpoints) is the code path of a downloaded SmolVLM or Qwen2.5-VL, only
smaller. The chat template is minimal and explicit (``<user>...<assistant>``) so token counts are
easy to reason about.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = [
    "CHAT_TEMPLATE",
    "IDEFICS3_TOKENS",
    "QWEN_VL_TOKENS",
    "idefics3_processor",
    "image_only_qwen_processor",
    "load_processor",
    "tiny_idefics3",
    "tiny_qwen2_vl",
]

IDEFICS3_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")
QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def chat_template(image_marker: str) -> str:
    """A minimal Jinja chat template: ``<role>`` before each message, images as ``image_marker``."""
    return (
        "{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}"
        "{% else %}{% for p in m.content %}{% if p.type == 'image' %}" + image_marker +
        "{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )  # fmt: skip


CHAT_TEMPLATE = chat_template("<image>")


def _with_tokens(tokenizer, tokens) -> None:
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})


def idefics3_processor(tokenizer, *, image_size: int = 32, patch_size: int = 8,
                       scale_factor: int = 2):  # fmt: skip
    """The Idefics3 processor of ``tiny_idefics3`` (``tokenizer`` gains its special tokens)."""
    from transformers import Idefics3Processor

    try:
        from transformers import Idefics3ImageProcessorPil as ImageProcessor
    except ImportError:  # older transformers: one PIL-based class
        from transformers import Idefics3ImageProcessor as ImageProcessor

    side = image_size // patch_size
    if side * patch_size != image_size or side % scale_factor:
        raise ValueError(
            f"image_size {image_size} must be a multiple of patch_size {patch_size} and the patch "
            f"grid ({side}) a multiple of scale_factor {scale_factor}"
        )
    _with_tokens(tokenizer, IDEFICS3_TOKENS)
    edge = {"longest_edge": image_size}
    images = ImageProcessor(do_resize=True, size=edge, do_image_splitting=False,
                            max_image_size=edge)  # fmt: skip
    return Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=(side // scale_factor) ** 2,
        chat_template=CHAT_TEMPLATE,
    )  # fmt: skip


def tiny_idefics3(tokenizer, *, image_size: int = 32, patch_size: int = 8, scale_factor: int = 2,
                  hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                  vision_hidden: int = 32, vision_layers: int = 1, seed: int = 0,
                  max_positions: int = 256) -> tuple[nn.Module, object]:  # fmt: skip
    """(model, processor): an Idefics3 with a ``vision_layers``-deep ViT over ``patch_size``
    patches of an ``image_size`` square image, pixel-shuffled by ``scale_factor`` into
    ``(image_size / patch_size / scale_factor)²`` image tokens, and a Llama language model.
    ``tokenizer`` gains Idefics3's special tokens (in place)."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    processor = idefics3_processor(
        tokenizer, image_size=image_size, patch_size=patch_size, scale_factor=scale_factor
    )
    config = Idefics3Config(
        text_config=dict(
            model_type="llama", vocab_size=len(tokenizer), hidden_size=hidden_size,
            intermediate_size=int(hidden_size * 8 / 3 + 7) // 8 * 8, num_hidden_layers=num_layers,
            num_attention_heads=num_heads, num_key_value_heads=num_heads,
            max_position_embeddings=max_positions, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
            num_hidden_layers=vision_layers, num_attention_heads=max(1, vision_hidden // 16),
            image_size=image_size, patch_size=patch_size,
        ),
        scale_factor=scale_factor, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        # PretrainedConfig's own keys (the typed signature names Idefics3's only)
        **{"tie_word_embeddings": True, "pad_token_id": tokenizer.pad_token_id},
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config)
    return model, processor


def tiny_qwen2_vl(tokenizer, *, hidden_size: int = 32, num_layers: int = 2, seed: int = 0,
                  min_pixels: int = 56 * 56, max_pixels: int = 112 * 112,
                  qwen25: bool = False, qwen3: bool = False) -> tuple[nn.Module, object]:  # fmt: skip
    """(model, processor): a Qwen2-VL (Qwen2.5-VL, Qwen3-VL) with a one-block vision tower
    (14-pixel patches, 16 for Qwen3-VL; 2x2 merge) and multimodal RoPE. The processor handles
    images only: this transformers' video processor needs torchvision, which groupflow does not
    require."""
    import torch

    try:
        from transformers import Qwen2VLImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import Qwen2VLImageProcessor as ImageProcessor

    _with_tokens(tokenizer, QWEN_VL_TOKENS)
    patch = 16 if qwen3 else 14
    images = ImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch,
                            merge_size=2, temporal_patch_size=2)  # fmt: skip
    processor = image_only_qwen_processor(
        image_processor=images, tokenizer=tokenizer,
        chat_template=chat_template("<|vision_start|><|image_pad|><|vision_end|>"),
    )  # fmt: skip
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VL_TOKENS}
    text = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    common = dict(
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    if qwen3:
        from transformers import Qwen3VLConfig as Config
        from transformers import Qwen3VLForConditionalGeneration as Model

        text = {k: v for k, v in text.items() if k != "rope_scaling"}
        text.update(head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                 "mrope_section": [1, 1, 2],
                                                 "mrope_interleaved": True})  # fmt: skip
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=hidden_size, patch_size=16, spatial_merge_size=2,
                      temporal_patch_size=2, num_position_embeddings=64,
                      deepstack_visual_indexes=[0])  # fmt: skip
    elif qwen25:
        from transformers import Qwen2_5_VLConfig as Config
        from transformers import Qwen2_5_VLForConditionalGeneration as Model

        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=hidden_size, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0])  # fmt: skip
    else:
        from transformers import Qwen2VLConfig as Config
        from transformers import Qwen2VLForConditionalGeneration as Model

        vision = dict(depth=1, embed_dim=32, hidden_size=hidden_size, num_heads=2, mlp_ratio=2,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    config: Any = Config(text_config=text, vision_config=vision, **common)  # one of three
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Model(config)
    return model, processor


def image_only_qwen_processor(**kwargs):
    """Qwen2-VL's processor without its video processor (which needs torchvision here)."""
    from transformers import Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    return ImageOnlyQwen2VLProcessor(**kwargs)


def load_processor(path: str, tokenizer=None, trust_remote_code: bool = False):
    """The processor of a local VLM directory (``AutoProcessor``). Qwen-VL processors of this
    transformers need torchvision for their video half; without it, the image half is assembled
    from the directory's image processor, tokenizer and chat template."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (ImportError, AttributeError, TypeError) as err:
        if "qwen" not in _model_type(path):
            raise
        reason = err
    tok = tokenizer or AutoTokenizer.from_pretrained(path, local_files_only=True)
    template = _chat_template(path) or getattr(tok, "chat_template", None)
    if template is None:
        raise ValueError(f"{path}: no chat template for its processor ({reason})")
    return image_only_qwen_processor(
        image_processor=AutoImageProcessor.from_pretrained(path, local_files_only=True),
        tokenizer=tok, chat_template=template,
    )  # fmt: skip


def _model_type(path: str) -> str:
    import json
    from pathlib import Path

    cfg = Path(path) / "config.json"
    return json.loads(cfg.read_text()).get("model_type", "") if cfg.is_file() else ""


def _chat_template(path: str) -> str | None:
    import json
    from pathlib import Path

    for name in ("chat_template.jinja", "chat_template.json"):
        f = Path(path) / name
        if f.is_file():
            text = f.read_text()
            return json.loads(text)["chat_template"] if name.endswith(".json") else text
    return None
