"""Which frames of an image or video completion a reward looks at.

Design decision: one small module that only torch and the reward errors sit under, so that every
reward that takes ``frames`` — the image rewards, OCR, the judge sending images — reads a clip
the same way, below the reward registry (which imports the judge) and the diffusion package.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from groupflow.rewards.errors import RewardConfigError

__all__ = ["check_frames", "select_frames"]


def check_frames(frames) -> str | int | list[int]:
    """``frames`` must be 'first', a positive integer or a non-empty list of indices >= 0."""
    if frames == "first" or (
        isinstance(frames, int) and not isinstance(frames, bool) and frames >= 1
    ):
        return frames
    if (
        isinstance(frames, (list, tuple))
        and frames
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in frames)
    ):
        return list(frames)
    raise RewardConfigError(
        "frames must be 'first', a positive integer k (every k-th frame) or a list of frame "
        f"indices >= 0, got {frames!r}"
    )


def select_frames(media: Tensor, frames: str | int | Sequence[int] = "first") -> Tensor:
    """[3, H, W] -> [1, 3, H, W]; [3, F, H, W] -> the first frame, every k-th, or the listed
    indices: [n, 3, H, W]."""
    if not isinstance(media, Tensor) or media.dim() not in (3, 4) or media.shape[0] != 3:
        shape = list(media.shape) if isinstance(media, Tensor) else type(media).__name__
        raise ValueError(
            f"an image reward expects [3, H, W] or [3, F, H, W] in [0, 1], got {shape}"
        )
    if media.dim() == 3:
        return media[None].float()
    video = media.permute(1, 0, 2, 3).float()  # [F, 3, H, W]
    frames = check_frames(frames)
    n = video.shape[0]
    if isinstance(frames, str):  # "first": check_frames allows no other string
        return video[:1]
    if isinstance(frames, int):
        if frames >= n > 1:
            raise RewardConfigError(
                f"frames={frames} (every {frames}-th frame) on a {n}-frame clip scores only frame "
                "0; use frames: first, or a smaller k"
            )
        return video[::frames]
    beyond = [i for i in frames if i >= n]
    if beyond:
        raise RewardConfigError(
            f"frames={frames}: index {beyond[0]} is beyond the {n}-frame clip (indices 0..{n - 1})"
        )
    return video[frames]
