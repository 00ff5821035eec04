"""A reward that looks at the prompt's images (``vlm_reward_helpers:red_share``), for the trainer's
image tests. Not collected by pytest; tests import it through the ``helpers_on_path`` fixture."""

from __future__ import annotations

import numpy as np

SEEN: list[int] = []  # how many images each scored sample showed (in call order)


def red_share(prompts, completions, images):
    """The share of strongly red pixels in the sample's first image (the completion is ignored):
    a reward that can only be computed from the image the prompt showed."""
    out = []
    for imgs in images:
        SEEN.append(len(imgs))
        a = np.asarray(imgs[0]).astype(int)
        out.append(float(((a[..., 0] > 150) & (a[..., 1] < 100)).mean()))
    return out
