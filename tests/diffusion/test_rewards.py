import math

import pytest
import torch

from groupflow.diffusion.rewards import (
    make_brightness_reward,
    make_compressibility_reward,
    make_image_scorer_reward,
    make_target_color_reward,
    select_frames,
)
from groupflow.rewards import RewardConfigError, RewardOutputError, build_reward_runner


def _solid(rgb, size=16):
    return torch.tensor(rgb, dtype=torch.float32)[:, None, None].expand(3, size, size).clone()


def test_target_color_hand_values():
    r = make_target_color_reward(color=(1.0, 0.0, 0.0))
    # exact colour -> 1; black -> 1 − 1/√3; white -> 1 − √2/√3
    got = r([_solid((1, 0, 0)), _solid((0, 0, 0)), _solid((1, 1, 1))])
    assert got == pytest.approx([1.0, 1 - 1 / math.sqrt(3), 1 - math.sqrt(2) / math.sqrt(3)])
    # mean mode scores a half-red/half-blue image by its mean colour; pixel mode by each pixel
    img = _solid((1, 0, 0))
    img[:, :, 8:] = torch.tensor([0.0, 0.0, 1.0])[:, None, None]
    assert r([img])[0] == pytest.approx(1 - math.sqrt(0.25 + 0.25) / math.sqrt(3))
    pix = make_target_color_reward(color=(1.0, 0.0, 0.0), mode="pixel")
    assert pix([img])[0] == pytest.approx(0.5 * 1 + 0.5 * (1 - math.sqrt(2) / math.sqrt(3)))
    with pytest.raises(RewardConfigError, match="color must be 3 values"):
        make_target_color_reward(color=(1.0, 0.0))


def test_brightness_is_luma():
    r = make_brightness_reward()
    assert r([_solid((1, 1, 1)), _solid((1, 0, 0))]) == pytest.approx([1.0, 0.299])


def test_compressibility_prefers_flat_images_and_refuses_tiny_ones():
    r = make_compressibility_reward()
    noise = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(0))
    flat, noisy = r([_solid((0.5, 0.5, 0.5)), noise])
    assert flat > 0.9 and noisy < 0.1
    with pytest.raises(RewardConfigError, match="too small to compare"):
        r([_solid((0.5, 0.5, 0.5), size=8)])


def test_video_frames_first_or_every_kth():
    video = torch.zeros(3, 4, 16, 16)
    video[:, 0] = 1.0  # only the first frame is white
    assert select_frames(video, "first").shape == (1, 3, 16, 16)
    assert select_frames(video, 2).shape == (2, 3, 16, 16)
    assert make_brightness_reward(frames="first")([video]) == pytest.approx([1.0])
    assert make_brightness_reward(frames=2)([video]) == pytest.approx([0.5])  # frames 0 and 2
    with pytest.raises(ValueError, match="expects \\[3, H, W\\] or \\[3, F, H, W\\]"):
        select_frames(torch.zeros(4, 16, 16))
    with pytest.raises(ValueError, match="frames must be 'first' or a positive integer"):
        select_frames(video, 0)


def test_registered_by_name_with_weights_and_wrong_shape_is_an_error(tmp_path):
    runner = build_reward_runner([{"name": "brightness", "weight": 0.1}])
    result = runner(["a", "b"], [_solid((1, 1, 1)), _solid((0, 0, 0))])
    assert result.total.tolist() == pytest.approx([0.1, 0.0])

    def two_values(completions):
        return [1.0, 2.0]

    from groupflow.rewards import RewardFunction, RewardRunner

    bad = RewardRunner([RewardFunction("bad", two_values)])
    with pytest.raises(RewardOutputError, match="returned 2 values for 3 completions"):
        bad(["a"] * 3, [_solid((1, 1, 1))] * 3)


def test_image_scorer_needs_a_local_path(tmp_path):
    with pytest.raises(RewardConfigError, match="model path .* does not exist"):
        make_image_scorer_reward(path=str(tmp_path / "pickscore"))
    with pytest.raises(RewardConfigError, match="unknown kind 'hps9'; valid kinds"):
        make_image_scorer_reward(path=str(tmp_path), kind="hps9")
