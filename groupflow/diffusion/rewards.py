"""Image and video rewards behind the ordinary reward protocol.

Design decision: a generated image is just another "completion": the diffusion policy hands the
reward runner the decoded images (``completions``: one float tensor [3, H, W] — or [3, F, H, W]
for video — in [0, 1] per sample), so weights, failure isolation, metrics and user rewards by
import path work exactly as for LLMs. The built-ins below are registered by name:

- ``target_color`` — 1 − ‖mean colour − target‖ / √3 (``mode: mean``), or the per-pixel distance
  averaged (``mode: pixel``); optimum 1.
- ``brightness`` — mean luma (Rec. 601) in [0, 1]; optimum 1.
- ``compressibility`` — 1 − zlib-compressed size / raw size of the 8-bit pixels (Flow-GRPO's
  compressibility reward, deterministic). Refused below ``min_pixels`` pixels per frame, where the
  compressor's fixed overhead, not the image, decides the score.
- ``image_scorer`` — a model-based scorer from a local path or a Hub id (resolved through the
  Hugging Face cache, ``groupflow.utils.hub``): ``kind: clip | pickscore | hps`` are CLIP-style
  (image–text cosine similarity × logit scale, as PickScore and HPS v2 use), ``kind: hpsv3`` is
  HPSv3 rebuilt on transformers' Qwen2-VL classes (``groupflow.diffusion.hpsv3``). A missing path
  is a clear error. PickScore ships its weights (``yuvalkirstain/PickScore_v1``) apart from its
  processor (``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``): ``processor_path`` names the latter's
  directory; for HPSv3 ``path`` is ``HPSv3.safetensors`` (or ``MizzenAI/HPSv3``) and
  ``processor_path`` the Qwen2-VL base (default ``Qwen/Qwen2-VL-7B-Instruct``, of which only the
  config, tokenizer and image processor files are read or downloaded).
  The chosen frames of all samples are scored ``batch_size`` at a time (prompts truncated to the
  text tower's length, as PickScore does); a sample with non-finite pixels raises, so the runner
  isolates it (a failed batch is retried per sample) and counts it.

Every reward takes ``frames``: ``first`` (MMDanceGRPO scores the first video frame), an integer
k (every k-th frame, averaged) or a list of frame indices (averaged); images are single-frame
videos. A selection the clip cannot give (an index beyond it, or k ≥ its length, which would
silently score only frame 0) is a :class:`RewardConfigError` naming ``frames``: it stops the step
rather than being counted as one failed sample. MMDanceGRPO's coefficient 0.1 on
HPSv3 is the reward's ``weight`` in the config.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from groupflow.rewards.base import RewardConfigError
from groupflow.rewards.frames import check_frames, select_frames
from groupflow.rewards.registry import register_reward
from groupflow.utils.hub import is_hub_id, resolve_repo

__all__ = [
    "select_frames",
    "check_frames",
    "make_target_color_reward",
    "make_brightness_reward",
    "make_compressibility_reward",
    "make_image_scorer_reward",
    "CLIPStyleScorer",
    "score_in_batches",
]

_LUMA = torch.tensor([0.299, 0.587, 0.114])


def _per_sample(score: Callable[[Tensor], Tensor], frames: str | int):
    """Lift a frame scorer ([n, 3, H, W] -> [n]) to the reward protocol (mean over chosen frames)."""

    def reward(completions: Sequence[Tensor]) -> list[float]:
        return [float(score(select_frames(c, frames)).mean()) for c in completions]

    return reward


def make_target_color_reward(
    color: Sequence[float] = (1.0, 1.0, 1.0), mode: str = "mean", frames: str | int = "first"
):
    check_frames(frames)
    target = torch.tensor([float(c) for c in color])
    if target.numel() != 3 or not bool(((target >= 0) & (target <= 1)).all()):
        raise RewardConfigError(
            f"target_color: color must be 3 values in [0, 1], got {list(color)}"
        )
    if mode not in ("mean", "pixel"):
        raise RewardConfigError(f"target_color: mode must be 'mean' or 'pixel', got {mode!r}")

    def score(x: Tensor) -> Tensor:
        t = target[None, :, None, None]
        if mode == "mean":
            return 1 - (x.mean((2, 3)) - target).norm(dim=1) / math.sqrt(3)
        return 1 - ((x - t).norm(dim=1) / math.sqrt(3)).mean((1, 2))

    return _per_sample(score, frames)


def make_brightness_reward(frames: str | int = "first"):
    check_frames(frames)
    return _per_sample(lambda x: (x * _LUMA[None, :, None, None]).sum(1).mean((1, 2)), frames)


def make_compressibility_reward(min_pixels: int = 256, frames: str | int = "first"):
    check_frames(frames)

    def score(x: Tensor) -> Tensor:
        if x.shape[2] * x.shape[3] < min_pixels:
            raise RewardConfigError(
                f"compressibility: {x.shape[2]}x{x.shape[3]} frames are too small to compare "
                f"(fewer than min_pixels={min_pixels} pixels; the compressor's overhead would decide)"
            )
        raw = (x.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
        sizes = [len(zlib.compress(f.numpy().tobytes(), 9)) / f.numel() for f in raw]
        return 1 - torch.tensor(sizes)

    return _per_sample(score, frames)


class CLIPStyleScorer:
    """Image–text score of a CLIP-family model from a local directory (transformers format):
    ``logit_scale · cos(image, text)``, the form PickScore and HPS v2 use."""

    def __init__(
        self, path: str | Path, device: str = "cpu", processor_path: str | Path | None = None
    ):
        from transformers import AutoModel, AutoProcessor

        self.model = AutoModel.from_pretrained(str(path), local_files_only=True).eval().to(device)
        self.processor = AutoProcessor.from_pretrained(
            str(processor_path or path), local_files_only=True
        )
        self.max_length = self.model.config.text_config.max_position_embeddings
        self.device = device

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        pixels = [img.permute(1, 2, 0).mul(255).round().to(torch.uint8).numpy() for img in images]
        inputs = self.processor(
            text=list(prompts), images=pixels, return_tensors="pt", padding=True,
            truncation=True, max_length=self.max_length,
        )  # fmt: skip
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        # logits_per_image[i, j] = logit_scale · cos(image_i, text_j); each image pairs with its prompt
        out = self.model(**inputs)
        return out.logits_per_image.diagonal().float().cpu()


def _hpsv3(path: Path, device: str = "cpu", processor_path=None):
    # lazy: breaks the cycle diffusion.hpsv3 -> rewards (whose __init__ registers these image
    # rewards) -> diffusion.rewards -> diffusion.hpsv3, for a process that imports hpsv3 first
    from groupflow.diffusion.hpsv3 import HPSv3Scorer

    return HPSv3Scorer(path, device, processor_path)


_SCORERS = {
    "clip": CLIPStyleScorer,
    "pickscore": CLIPStyleScorer,
    "hps": CLIPStyleScorer,
    "hpsv3": _hpsv3,
}
# HPSv3 was trained from this base; only its config, tokenizer and image processor are read
HPSV3_BASE = "Qwen/Qwen2-VL-7B-Instruct"
_BASE_FILES = ["*.json", "*.jinja", "*.txt"]  # not its 16 GB of weights: the checkpoint has them


def _local(value: str, key: str, allow_patterns: list[str] | None = None) -> Path:
    """A local path as given, or the HF-cache snapshot of a Hub id (``groupflow.utils.hub``)."""
    if is_hub_id(value):
        return resolve_repo(
            value, None, f"image_scorer kwargs.{key}", allow_patterns=allow_patterns
        )
    return Path(value).expanduser()


def make_image_scorer_reward(
    path: str,
    kind: str = "pickscore",
    frames: str | int = "first",
    device: str = "cpu",
    processor_path: str | None = None,
    batch_size: int = 16,
):
    check_frames(frames)
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise RewardConfigError(
            f"image_scorer: batch_size must be an integer >= 1, got {batch_size!r}"
        )
    if kind not in _SCORERS:
        raise RewardConfigError(
            f"image_scorer: unknown kind {kind!r}; valid kinds: {sorted(_SCORERS)}"
        )
    p = _local(path, "path")
    if not p.exists():
        raise RewardConfigError(
            f"image_scorer ({kind}): model path '{p}' does not exist; give a local path or a Hub "
            "id (owner/name, resolved through the Hugging Face cache)"
        )
    if kind == "hpsv3" and processor_path is None:
        processor_path = HPSV3_BASE
    processor = None
    if processor_path is not None:
        processor = _local(processor_path, "processor_path", _BASE_FILES)
        if not processor.exists():
            raise RewardConfigError(
                f"image_scorer ({kind}): processor_path '{processor}' does not exist"
            )
    scorer = _SCORERS[kind](p, device, processor)

    def reward(prompts: Sequence[str], completions: Sequence[Tensor]) -> list[float]:
        chosen = [select_frames(media, frames) for media in completions]
        for i, c in enumerate(chosen):
            if not bool(torch.isfinite(c).all()):
                raise ValueError(f"image_scorer: completion {i} has non-finite pixels")
        return score_in_batches(scorer, chosen, prompts, batch_size)

    return reward


def score_in_batches(
    scorer: Callable[[Tensor, Sequence[str]], Tensor],
    chosen: Sequence[Tensor],
    prompts: Sequence[str],
    batch_size: int,
) -> list[float]:
    """Score every sample's chosen frames [n_i, 3, H, W] against its prompt, ``batch_size`` frames
    per call (frames of one size per call: a call's images are stacked), and average per sample."""
    flat = [(i, f) for i, c in enumerate(chosen) for f in c]
    scores = torch.empty(len(flat))
    start = 0
    while start < len(flat):
        end = min(start + batch_size, len(flat))
        size = flat[start][1].shape
        # a call takes frames of one size only (they are stacked)
        end = next((j for j in range(start, end) if flat[j][1].shape != size), end)
        frames = torch.stack([f for _, f in flat[start:end]])
        scores[start:end] = scorer(frames, [prompts[i] for i, _ in flat[start:end]]).float()
        start = end
    owners = torch.tensor([i for i, _ in flat])
    return [float(scores[owners == i].mean()) for i in range(len(chosen))]


for _name, _factory in (
    ("target_color", make_target_color_reward),
    ("brightness", make_brightness_reward),
    ("compressibility", make_compressibility_reward),
    ("image_scorer", make_image_scorer_reward),
):
    register_reward(_name, _factory, overwrite=True)
