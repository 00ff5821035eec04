"""The OCR reward: how well the text read off a generated image matches the prompt's target text.

Design decision: Flow-GRPO's text-rendering reward, computed the way flow_grpo's ``ocr.py`` does —
both strings lower-cased with spaces removed; a target contained in the recognised text scores 1;
otherwise ``1 − min(d, n) / n`` with d the Levenshtein distance and n the target's length — on
RapidOCR (``rapidocr-onnxruntime``, the ``ocr`` extra), whose detection and recognition models
ship inside the wheel, so scoring never downloads. The target is the text between the first pair
of double quotes of the prompt (Flow-GRPO's prompts: ``a sign that says "OPEN"``), or a dataset
field named by ``target_field``. Reading nothing is a legitimate 0; an image that cannot be read
(wrong shape, non-finite pixels) or a sample without a target raises for that sample, so the
runner gives it the failure value and counts it in ``reward/ocr/failures``, never a crash.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from groupflow.rewards.base import RewardConfigError
from groupflow.rewards.frames import check_frames, select_frames
from groupflow.rewards.registry import register_reward

__all__ = ["levenshtein", "ocr_similarity", "quoted_target", "make_ocr_reward"]


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each)."""
    if len(a) < len(b):
        a, b = b, a
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def ocr_similarity(recognised: str, target: str) -> float:
    """Flow-GRPO's OCR score in [0, 1] (see the module docstring); ``target`` must not be empty
    once spaces are removed."""
    seen = recognised.replace(" ", "").lower()
    want = target.replace(" ", "").lower()
    if not want:
        raise ValueError(f"the OCR target text {target!r} is empty")
    if want in seen:
        return 1.0
    # many unrelated characters cost at most the whole target, as in Flow-GRPO
    return 1.0 - min(levenshtein(seen, want), len(want)) / len(want)


def quoted_target(prompt: str) -> str:
    """The text between the first pair of double quotes of ``prompt``."""
    parts = prompt.split('"')
    if len(parts) < 3:
        raise ValueError(
            f"prompt {prompt[:80]!r} has no text in double quotes to read back (OCR target); "
            "quote it, or give the reward a target_field"
        )
    return parts[1]


def _to_bgr_uint8(frame: Tensor) -> np.ndarray:
    """[3, H, W] in [0, 1] -> [H, W, 3] uint8 BGR (the OpenCV order RapidOCR reads arrays in)."""
    if not bool(torch.isfinite(frame).all()):
        raise ValueError("the image has non-finite pixels and cannot be read")
    rgb = (frame.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return np.ascontiguousarray(rgb[:, :, ::-1])


@functools.lru_cache(maxsize=1)
def _engine():
    """One RapidOCR engine per process (stateless inference; loading its models takes seconds)."""
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError as exc:
        raise RewardConfigError(
            "reward 'ocr' needs RapidOCR: pip install 'groupflow[ocr]' "
            f"(rapidocr-onnxruntime; {exc})"
        ) from None
    return RapidOCR()


class RapidOCRReader:
    """Recognised text of an image: RapidOCR's lines with confidence > ``min_confidence``,
    concatenated in its reading order."""

    def __init__(self, min_confidence: float = 0.0):
        self.engine = _engine()
        self.min_confidence = min_confidence

    def __call__(self, frame: Tensor) -> str:
        lines, _ = self.engine(_to_bgr_uint8(frame))
        return "".join(text for _, text, conf in lines or () if float(conf) > self.min_confidence)


def make_ocr_reward(
    target_field: str | None = None, frames: str | int = "first", min_confidence: float = 0.0
):
    check_frames(frames)
    if target_field is not None and not (isinstance(target_field, str) and target_field):
        raise RewardConfigError(
            f"ocr: target_field must be a dataset field name, got {target_field!r}"
        )
    if not (isinstance(min_confidence, (int, float)) and 0 <= min_confidence < 1):
        raise RewardConfigError(f"ocr: min_confidence must be in [0, 1), got {min_confidence!r}")
    read = RapidOCRReader(float(min_confidence))

    def reward(prompts: Sequence[str], completions: Sequence[Tensor], **fields) -> list[float]:
        if target_field is None:
            targets = [quoted_target(p) for p in prompts]
        else:
            targets = [str(t) if t is not None else "" for t in fields[target_field]]
        scores = []
        for media, target in zip(completions, targets):
            chosen = select_frames(media, frames)
            scores.append(sum(ocr_similarity(read(f), target) for f in chosen) / len(chosen))
        return scores

    # a row must hold the target field (checked per row before training, groupflow.rewards.base)
    reward.reference_fields = (target_field,) if target_field else ()
    reward.engine = read
    return reward


register_reward("ocr", make_ocr_reward, overwrite=True)
