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
    with pytest.raises(ValueError, match="frames must be 'first', a positive integer"):
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


def _tiny_clip(path):
    """A random-weight CLIP (16-px images, a 10-word vocabulary) saved like a downloaded scorer."""
    import json

    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    path.mkdir()
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    vocab.update(
        {w: i + 2 for i, w in enumerate(["red</w>", "blue</w>", "r", "e", "d", "b", "l", "u"])}
    )
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    tok = CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt"))
    images = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    layer = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), max_position_embeddings=16, **layer),
        vision_config=dict(image_size=16, patch_size=8, **layer),
        projection_dim=8,
    )
    torch.manual_seed(0)
    CLIPModel(cfg).save_pretrained(path)
    CLIPProcessor(image_processor=images, tokenizer=tok).save_pretrained(path)


@pytest.mark.slow  # transformers' CLIP import and save/load dominate; the model is tiny
def test_clip_style_scorer_from_a_local_directory(tmp_path):
    _tiny_clip(tmp_path / "clip")
    reward = make_image_scorer_reward(path=str(tmp_path / "clip"), kind="pickscore")
    g = torch.Generator().manual_seed(0)
    image, video = torch.rand(3, 16, 16, generator=g), torch.rand(3, 3, 16, 16, generator=g)
    scores = reward(["red", "blue"], [image, video])
    from groupflow.diffusion.rewards import CLIPStyleScorer

    scorer = CLIPStyleScorer(tmp_path / "clip")
    # the video is scored on its first frame, each image against its own prompt
    assert scores[0] == pytest.approx(float(scorer(image[None], ["red"])[0]), abs=1e-5)
    assert scores[1] == pytest.approx(float(scorer(video[:, 0][None], ["blue"])[0]), abs=1e-5)
    m = scorer.model
    inputs = scorer.processor(
        text=["red"],
        images=[(image.permute(1, 2, 0) * 255).round().byte().numpy()],
        return_tensors="pt",
        padding=True,
    )
    out = m(**inputs)
    cos = torch.nn.functional.cosine_similarity(out.image_embeds, out.text_embeds)
    assert scores[0] == pytest.approx(float(m.logit_scale.exp() * cos[0]), abs=1e-4)


def _pickscore_layout(root):
    """PickScore's layout: weights (a CLIPModel) in one directory, the processor in another."""
    import shutil

    _tiny_clip(root / "full")
    (root / "model").mkdir()
    (root / "processor").mkdir()
    for f in (root / "full").iterdir():
        is_model = f.name in ("config.json", "model.safetensors")
        shutil.copy(f, root / ("model" if is_model else "processor") / f.name)
    return root / "model", root / "processor"


@pytest.mark.slow  # transformers' CLIP import and save/load dominate; the model is tiny
def test_pickscore_layout_batching_frames_and_an_isolated_failing_sample(tmp_path):
    from groupflow.diffusion.rewards import CLIPStyleScorer

    model, processor = _pickscore_layout(tmp_path)
    with pytest.raises(OSError):  # the weights directory alone has no processor
        make_image_scorer_reward(path=str(model), kind="pickscore")
    spec = {"name": "image_scorer", "kwargs": {"path": str(model), "kind": "pickscore",
            "processor_path": str(processor), "frames": 2, "batch_size": 3}}  # fmt: skip
    runner = build_reward_runner([spec])
    g = torch.Generator().manual_seed(1)
    videos = [torch.rand(3, 4, 16, 16, generator=g) for _ in range(3)]
    prompts = ["red", "blue", "red " * 40]  # the last is longer than the text tower: truncated
    scorer = CLIPStyleScorer(model, processor_path=processor)
    calls = []
    real = scorer.model.forward
    scorer.model.forward = lambda *a, **k: calls.append(1) or real(*a, **k)
    result = runner(prompts, videos)
    # frames 0 and 2 of each video, each against its own prompt, averaged
    want = [float(scorer(v[:, ::2].permute(1, 0, 2, 3), [p] * 2).mean()) for v, p in zip(videos, prompts)]  # fmt: skip
    assert result.total.tolist() == pytest.approx(want, abs=1e-5)
    from groupflow.diffusion.rewards import score_in_batches

    calls.clear()
    chosen = [select_frames(v, 2) for v in videos]
    assert score_in_batches(scorer, chosen, prompts, 4) == pytest.approx(want, abs=1e-5)
    assert len(calls) == 2  # 6 frames, 4 per call
    bad = videos[1].clone()
    bad[0, 0, 0, 0] = float("nan")
    result = runner(prompts, [videos[0], bad, videos[2]])
    assert result.metrics["reward/image_scorer/failures"] == 1.0
    assert result.total[0].item() == pytest.approx(want[0], abs=1e-5)
    assert result.total[2].item() == pytest.approx(want[2], abs=1e-5)
    with pytest.raises(RewardConfigError, match="batch_size must be an integer >= 1"):
        make_image_scorer_reward(path=str(model), processor_path=str(processor), batch_size=0)
    with pytest.raises(RewardConfigError, match="processor_path .* does not exist"):
        make_image_scorer_reward(path=str(model), processor_path=str(tmp_path / "nope"))


@pytest.mark.slow  # a tiny CLIP and a one-step diffusion run (tests/test_builtin_rewards_e2e.py)
def test_every_image_builtin_in_a_one_step_diffusion_run(tmp_path):
    import json

    import yaml

    from groupflow.cli.commands import main
    from groupflow.diffusion.models import TinyFlowModel, save_tiny_model
    from groupflow.diffusion.pretrain import COLORS

    torch.manual_seed(0)
    save_tiny_model(TinyFlowModel(list(COLORS), image_size=8, width=8), tmp_path / "flow")
    _tiny_clip(tmp_path / "clip")
    (tmp_path / "p.jsonl").write_text('{"prompt": "red"}\n{"prompt": "blue"}\n')
    rewards = [
        {"name": "target_color", "kwargs": {"color": [1.0, 0.0, 0.0]}},
        {"name": "brightness"},
        {"name": "compressibility", "kwargs": {"min_pixels": 16}},  # 8x8 images
        {"name": "image_scorer", "kwargs": {"path": str(tmp_path / "clip"), "kind": "clip"}},
    ]
    config = {
        "run": {"name": "img", "output_dir": str(tmp_path), "total_steps": 1, "loggers": [],
                "num_threads": 1},
        "diffusion": {"model": {"kind": "tiny", "path": str(tmp_path / "flow")}, "num_steps": 2},
        "data": {"train_files": [str(tmp_path / "p.jsonl")], "prompts_per_step": 2},
        "rollout": {"samples_per_prompt": 2},
        "validation": {"every_steps": 0, "before_training": False},
        "reward": {"functions": rewards},
    }  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "c.yaml"), "--no-plot"]) == 0
    lines = (tmp_path / "img" / "metrics.jsonl").read_text().splitlines()
    metrics = json.loads(lines[-1])
    for spec in rewards:
        assert math.isfinite(metrics[f"reward/{spec['name']}/mean"]), spec["name"]
        assert metrics[f"reward/{spec['name']}/failures"] == 0.0, spec["name"]
    assert 0.0 <= metrics["reward/brightness/mean"] <= 1.0
