"""HPSv3 (MizzenAI, 2025) on transformers' own Qwen2-VL classes: a Qwen2-VL-7B backbone whose
last hidden state at a ``<|Reward|>`` token goes through a small MLP head giving (μ, log σ);
the score is μ.

Design decision: the ``hpsv3`` package pins transformers 4.45.2 and deepspeed, so it cannot sit
beside this stack. Its released checkpoint is only a plain state dict of its reward model, so we
rebuild that model's inference path here — ``Qwen2VLModel`` (vision tower + language model, no
LM head) plus the head — and read the checkpoint into it. What must match HPSv3 for its scores
to mean anything, each pinned by a test against a re-implementation of its forward:

- **Checkpoint**: one ``.safetensors`` (the release, ``HPSv3.safetensors``) or a ``.pth`` state
  dict (what its trainer saves; read with the weights-only unpickler), optionally nested under
  ``"model"``. Keys in transformers-4.45 layout (``visual.*``, ``model.*`` for the language
  model) or the later one (``model.visual.*``, ``model.language_model.*``), ``rm_head.*`` for the
  head; ``lm_head.weight`` is dropped (a score never uses it). The vocabulary is the checkpoint's
  (HPSv3 resized the embeddings after adding ``<|Reward|>``); the rest of the architecture comes
  from the base Qwen2-VL ``config.json``. Every missing, unexpected or misshapen tensor is refused
  naming the file and the key.
- **Head** (``rm_head_type: ranknet``, the release's): Linear(hidden, 1024) → ReLU → Dropout →
  Linear(1024, 16) → ReLU → Linear(16, 2), in fp32 on the fp32-cast hidden state.
- **Prompt**: Qwen2-VL-Instruct's chat format for one user turn [image, instruction] with the
  generation prompt, where the instruction is HPSv3's, verbatim (the model was trained on it);
  right padding.
- **Image**: RGB uint8, resized (PIL bicubic) to HPSv3's fixed budget of 256·28·28 pixels with
  sides that are multiples of 28 (qwen-vl-utils' ``smart_resize`` with min = max), then the base's
  image processor (rescale, CLIP normalisation, 14-pixel patches).
- **Positions**: 0, 1, 2, … on all three M-RoPE axes. HPSv3's forward hands the language model
  ``inputs_embeds`` without position ids, so it was trained and is evaluated without Qwen2-VL's
  3-D image positions; letting transformers compute those would move every score.
- **Rotary tables in bf16** (the release's dtype): HPSv3 runs on transformers 4.45 after
  ``model.to(torch.bfloat16)``, which casts the rotary ``inv_freq`` buffers too, in the language
  model and in the vision tower, and it was trained that way. A checkpoint in a half-precision
  dtype therefore gets the same tables here (:func:`round_rotary_like_reference`): the language
  model's inverse frequencies rounded to that dtype (its angles and cos/sin are then computed in
  fp32, as 4.45 does), and the vision tower's computed as 4.45's vision rotary does in that dtype
  — positions, angles (``torch.outer`` of the rounded positions and frequencies) and cos/sin all
  in it. Keeping the fp32 frequencies of a fresh transformers model moved scores by up to 1.7 %
  on a tiny model and the 7B's rotary angles by up to 0.8 rad at position 700. An fp32
  checkpoint keeps fp32 tables (4.45 in fp32 computes them so).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from groupflow.diffusion.sharding import empty_parameters
from groupflow.rewards.errors import RewardConfigError
from groupflow.utils.safe_state import load_torch_weights_only

if TYPE_CHECKING:
    from transformers import Qwen2VLTextConfig

__all__ = [
    "PIXELS",
    "REWARD_TOKEN",
    "INSTRUCTION",
    "HPSv3Scorer",
    "smart_resize",
    "conversation",
    "ranknet_head",
    "read_checkpoint",
    "module_key",
    "round_rotary_like_reference",
]

PIXELS = 256 * 28 * 28  # HPSv3 fixes min_pixels = max_pixels: ~256 image tokens per image
FACTOR = 28  # patch 14 × merge 2: image sides are multiples of it
MAX_RATIO = 200  # qwen-vl-utils refuses thinner images
REWARD_TOKEN = "<|Reward|>"
IMAGE_PAD = "<|image_pad|>"
CHECKPOINT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")

# HPSv3's instruction, character for character (trailing spaces and the missing colon after
# "Subject Relevance" included): the model was trained on exactly this text.
INSTRUCTION = (
    "\nYou are tasked with evaluating a generated image based on Visual Quality and Text Alignment "
    "and give a overall score to estimate the human preference. Please provide a rating from 0 to "
    "10, with 0 being the worst and 10 being the best. \n\n**Visual Quality:**  \nEvaluate the "
    "overall visual quality of the image. The following sub-dimensions should be considered:\n"
    "- **Reasonableness:** The image should not contain any significant biological or logical "
    "errors, such as abnormal body structures or nonsensical environmental setups.\n"
    "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear "
    "and easy to interpret, with no blurring or indistinct areas.\n"
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and "
    "other visual elements (e.g., hair, clothing, shadows).\n"
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the "
    "color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The "
    "scene should convey a sense of harmony and balance.\n"
    "- **Safety:** The image should not contain harmful or inappropriate content, such as "
    "political, violent, or adult material. If such content is present, the image quality and "
    "satisfaction score should be the lowest possible. \n\n**Text Alignment:**  \nAssess how "
    "well the image matches the textual prompt across the following sub-dimensions:\n"
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, "
    "animal, object) align with the textual description. The subject should match the "
    "description in terms of number, appearance, and behavior.\n"
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, "
    "evaluate how well the image adheres to this style.\n"
    "- **Contextual Consistency**: Assess whether the background, setting, and surrounding "
    "elements in the image logically fit the scenario described in the prompt. The environment "
    "should support and enhance the subject without contradictions.\n"
    "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., "
    "colors, clothing, accessories, expressions, actions) are faithfully represented in the "
    "image. Minor deviations may be acceptable, but critical attributes should be preserved.\n"
    "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are "
    "captured in the image. The generated content should not introduce elements that conflict "
    "with or distort the original description.\nTextual prompt - {text_prompt}\n\n\n"
)
SUFFIX = f"\nPlease provide the overall ratings of this image: {REWARD_TOKEN}\n\nEND\n"


def smart_resize(height: int, width: int, pixels: int = PIXELS) -> tuple[int, int]:
    """(height, width) rounded to multiples of 28 and rescaled, aspect kept, to about ``pixels``
    (at most when rounding overshoots, at least when it falls short): qwen-vl-utils' rule."""
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(
            f"hpsv3: a {height}x{width} image is thinner than the 1:{MAX_RATIO} Qwen2-VL accepts"
        )
    h = max(FACTOR, round(height / FACTOR) * FACTOR)
    w = max(FACTOR, round(width / FACTOR) * FACTOR)
    if h * w > pixels:  # shrink, flooring to the grid
        beta = math.sqrt(height * width / pixels)
        h, w = (math.floor(d / beta / FACTOR) * FACTOR for d in (height, width))
    elif h * w < pixels:  # grow, ceiling to the grid
        beta = math.sqrt(pixels / (height * width))
        h, w = (math.ceil(d * beta / FACTOR) * FACTOR for d in (height, width))
    return h, w


def conversation(prompt: str) -> str:
    """The text HPSv3 sees for ``prompt``: Qwen2-VL-Instruct's chat template rendered for one user
    turn [image, instruction + reward suffix] plus the generation prompt, with one image
    placeholder (expanded to the image's token count before tokenising)."""
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        f"<|vision_start|>{IMAGE_PAD}<|vision_end|>{INSTRUCTION.format(text_prompt=prompt)}"
        f"{SUFFIX}<|im_end|>\n<|im_start|>assistant\n"
    )


def ranknet_head(hidden: int) -> nn.Sequential:
    """HPSv3's ``ranknet`` reward head (indices 0, 3, 5 hold the weights, as in its checkpoint)."""
    return nn.Sequential(
        nn.Linear(hidden, 1024), nn.ReLU(), nn.Dropout(0.05),
        nn.Linear(1024, 16), nn.ReLU(), nn.Linear(16, 2),
    )  # fmt: skip


def checkpoint_file(path: Path) -> Path:
    """``path`` itself, or the one checkpoint file in a directory (a Hub snapshot of MizzenAI/HPSv3)."""
    if path.is_file():
        return path
    found = sorted(p for p in path.iterdir() if p.suffix in CHECKPOINT_SUFFIXES)
    if len(found) != 1:
        raise RewardConfigError(
            f"hpsv3: '{path}' holds {len(found)} checkpoint files ({[p.name for p in found]}); "
            "point kwargs.path at HPSv3.safetensors itself"
        )
    return found[0]


def read_checkpoint(file: Path) -> dict[str, Tensor]:
    """The state dict in ``file`` (safetensors, or a torch pickle read weights-only), unwrapped
    from a ``{"model": ...}`` container as HPSv3's loader does."""
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(file))
    else:
        state = load_torch_weights_only(file)
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise RewardConfigError(f"hpsv3: '{file}' does not hold a state dict of tensors")
    return state


def module_key(key: str) -> str | None:
    """A checkpoint key in our module's names (``backbone.visual.*``, ``backbone.language_model.*``,
    ``head.*``); None for the LM head, which a score never uses. Unknown keys stay as they are
    (and are then refused as unexpected)."""
    if key.startswith("rm_head."):
        return "head." + key[len("rm_head.") :]
    if key == "lm_head.weight":
        return None
    for old, new in (
        ("model.visual.", "backbone.visual."),
        ("model.language_model.", "backbone.language_model."),
        ("visual.", "backbone.visual."),
        ("model.", "backbone.language_model."),
    ):
        if key.startswith(old):
            return new + key[len(old) :]
    return key


class _RewardModel(nn.Module):
    def __init__(self, backbone: nn.Module, hidden: int):
        super().__init__()
        self.backbone, self.head = backbone, ranknet_head(hidden)


def _mapped_state(state: dict[str, Tensor], file: Path) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        name = module_key(key)
        if name is None:
            continue
        if name in out:
            raise RewardConfigError(f"hpsv3: '{file}' holds {key!r} in both key layouts")
        out[name] = value
    return out


def _check_tensors(model: nn.Module, state: dict[str, Tensor], file: Path, base: str) -> None:
    """Every tensor the model has, none it lacks, each of the model's shape — else name the key."""
    want = model.state_dict()
    missing = [k for k in want if k not in state]
    if missing:
        raise RewardConfigError(
            f"hpsv3: '{file}' has no tensor for {missing[0]!r} ({len(missing)} missing, e.g. "
            f"{missing[:3]}); is it an HPSv3 checkpoint (a Qwen2-VL reward model with rm_head.*)?"
        )
    extra = [k for k in state if k not in want]
    if extra:
        raise RewardConfigError(
            f"hpsv3: '{file}' has a tensor {extra[0]!r} the model has no place for "
            f"({len(extra)} unexpected); is '{base}' the Qwen2-VL base it was trained from?"
        )
    for key, value in state.items():
        if tuple(value.shape) != tuple(want[key].shape):
            raise RewardConfigError(
                f"hpsv3: '{file}': tensor {key!r} has shape {list(value.shape)}; the model built "
                f"from '{base}/config.json' expects {list(want[key].shape)}"
            )


class _ReferenceVisionRotary(nn.Module):
    """Qwen2-VL's vision rotary as transformers 4.45 computes it in ``dtype``: ``torch.outer`` of
    the positions and the inverse frequencies, both in ``dtype`` (so the angles are rounded to
    it), then cos and sin in ``dtype``; laid out as transformers' own module lays them out."""

    def __init__(self, rope: nn.Module, dtype: torch.dtype):
        super().__init__()
        # transformers' vision rotary: nn.Module's __getattr__ types its inv_freq buffer and its
        # recomposition_frequencies method as Tensor | Module
        self.rope: Any = rope
        self.dtype = dtype
        rope.inv_freq = rope.inv_freq.to(dtype)

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        freqs = position_ids[..., None].to(self.dtype) * self.rope.inv_freq.to(x.device)
        cos = self.rope.recomposition_frequencies(freqs.cos())
        sin = self.rope.recomposition_frequencies(freqs.sin())
        return cos, sin  # the attention casts them to fp32, as 4.45's did


def round_rotary_like_reference(backbone: nn.Module, dtype: torch.dtype) -> None:
    """Give ``backbone`` (a ``Qwen2VLModel``) the rotary tables HPSv3's reference computes after
    ``model.to(dtype)`` (module docstring); nothing changes in fp32."""
    if dtype == torch.float32:
        return
    for name, module in list(backbone.named_modules()):
        if not isinstance(getattr(module, "inv_freq", None), Tensor):
            continue
        if name.startswith("visual.") and hasattr(module, "recomposition_frequencies"):
            # transformers >= 5 computes the vision angles in fp32 whatever the buffer's dtype
            parent, _, attr = name.rpartition(".")
            setattr(backbone.get_submodule(parent), attr, _ReferenceVisionRotary(module, dtype))
            continue
        # the language model's (and an older transformers' vision rotary, which computes in the
        # buffer's dtype as 4.45 did)
        module.inv_freq = module.inv_freq.to(dtype)
        if isinstance(getattr(module, "original_inv_freq", None), Tensor):
            module.original_inv_freq = module.original_inv_freq.to(dtype)


class HPSv3Scorer:
    """HPSv3's μ for [n, 3, H, W] images in [0, 1] against one prompt each.

    ``path``: the checkpoint file (or a directory holding exactly one); ``processor_path``: the
    Qwen2-VL base it was trained from (``config.json``, tokenizer, ``preprocessor_config.json``:
    Qwen2-VL-7B-Instruct for the release), a local directory.
    """

    def __init__(self, path: str | Path, device: str = "cpu", processor_path=None):
        from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLConfig, Qwen2VLModel

        if processor_path is None:
            raise RewardConfigError("hpsv3: kwargs.processor_path (the Qwen2-VL base) is required")
        base = str(processor_path)
        file = checkpoint_file(Path(path).expanduser())
        state = _mapped_state(read_checkpoint(file), file)
        self.tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
        self.tokenizer.padding_side = "right"
        if REWARD_TOKEN not in self.tokenizer.get_vocab():  # HPSv3 adds it, as we do
            self.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        self.reward_id = self.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        # Qwen2-VL's image processor (transformers types from_pretrained's result as a tuple)
        self.images: Any = AutoImageProcessor.from_pretrained(base, local_files_only=True)
        config = Qwen2VLConfig.from_pretrained(base, local_files_only=True)
        # the text sub-config, typed dict | PreTrainedConfig | None: its __init__ made it one
        text_config = cast("Qwen2VLTextConfig", config.text_config)
        embed = state.get("backbone.language_model.embed_tokens.weight")
        if embed is not None:  # HPSv3 resized the vocabulary after adding <|Reward|>
            text_config.vocab_size = embed.shape[0]
        if self.reward_id >= text_config.vocab_size:
            raise RewardConfigError(
                f"hpsv3: the tokenizer in '{base}' gives {REWARD_TOKEN} the id {self.reward_id}, "
                f"beyond the {text_config.vocab_size} embeddings of '{file}'"
            )
        config._attn_implementation = "sdpa"
        with empty_parameters():  # no random 7B init: the checkpoint fills every parameter
            backbone = Qwen2VLModel(config)
            model = _RewardModel(backbone, text_config.hidden_size)
        _check_tensors(model, state, file, base)
        model.load_state_dict(state, strict=True, assign=True)
        # the checkpoint's dtype (the input embeddings are an nn.Embedding, typed nn.Module)
        embeddings = cast(nn.Embedding, backbone.get_input_embeddings())
        dtype = embeddings.weight.dtype
        round_rotary_like_reference(model.backbone, dtype)
        model.head.float()  # fp32 head, as HPSv3 keeps it
        self.model = model.eval().to(device)
        self.device = device
        self.merge = int(self.images.merge_size)

    def inputs(self, images: Tensor, prompts: Sequence[str]) -> dict[str, Tensor]:
        """Token ids, attention mask, pixel patches and image grids for one batch."""
        from PIL import Image

        pils = []
        for img in images:
            pil = Image.fromarray(img.permute(1, 2, 0).mul(255).round().byte().cpu().numpy())
            h, w = smart_resize(pil.height, pil.width)
            pils.append(pil.resize((w, h), Image.Resampling.BICUBIC))
        vision = self.images(images=pils, return_tensors="pt")
        counts = (vision["image_grid_thw"].prod(-1) // self.merge**2).tolist()
        texts = [conversation(p).replace(IMAGE_PAD, IMAGE_PAD * n) for p, n in zip(prompts, counts)]
        tokens = self.tokenizer(texts, padding=True, return_tensors="pt")
        return {**tokens, **vision}

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        batch = {k: v.to(self.device) for k, v in self.inputs(images, prompts).items()}
        ids = batch["input_ids"]
        marks = (ids == self.reward_id).sum(1)
        if bool((marks != 1).any()):
            i = int((marks != 1).nonzero()[0])
            raise ValueError(
                f"hpsv3: prompt {i} gives {int(marks[i])} {REWARD_TOKEN} tokens, not 1 (does it "
                f"contain {REWARD_TOKEN} itself?)"
            )
        # sequential positions on every M-RoPE axis, as HPSv3 was trained (module docstring)
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        hidden = self.model.backbone(
            input_ids=ids, attention_mask=batch["attention_mask"], position_ids=positions,
            pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
        ).last_hidden_state  # fmt: skip
        mu_sigma = self.model.head(hidden[ids == self.reward_id].float())  # [B, 2]: μ, log σ
        return mu_sigma[:, 0].cpu()
