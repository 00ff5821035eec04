"""Bad input on the diffusion path: each a clear error naming the key (issue 15, item 5)."""

import types

import pytest
import torch

from groupflow.diffusion.models import check_latent_fits
from groupflow.diffusion.rewards import make_brightness_reward, select_frames
from groupflow.rewards import (
    RewardConfigError,
    RewardFunction,
    RewardOutputError,
    RewardRunner,
    build_reward_runner,
)

SD3 = types.SimpleNamespace(in_channels=4, patch_size=2, pos_embed_max_size=8)
WAN = types.SimpleNamespace(in_channels=4, patch_size=(1, 2, 2))


@pytest.mark.parametrize(
    "config, kind, shape, message",
    [
        (SD3, "sd3", (16, 8, 8), r"latent_shape=\[16, 8, 8\]: the SD3Transformer2DModel takes 4 latent channels, not 16"),
        (SD3, "sd3", (4, 7, 8), r"latent_shape=\[4, 7, 8\]: height 7 is not divisible by the patch size 2"),
        (SD3, "sd3", (4, 32, 8), r"16x4 patches exceed the position embedding's 8 per side"),
        (WAN, "wan", (4, 3, 8, 9), r"latent_shape=\[4, 3, 8, 9\]: width 9 is not divisible by the patch size 2"),
        (types.SimpleNamespace(in_channels=4, patch_size=(2, 2, 2)), "wan", (4, 3, 8, 8),
         r"frames 3 is not divisible by the patch size 2"),
    ],
)  # fmt: skip
def test_a_latent_shape_the_transformer_cannot_take_names_the_key(config, kind, shape, message):
    with pytest.raises(ValueError, match=f"diffusion.model.latent_shape.*{message}|{message}"):
        check_latent_fits(config, kind, shape)


def test_latent_shapes_the_transformer_takes_pass():
    check_latent_fits(SD3, "sd3", (4, 8, 8))
    check_latent_fits(WAN, "wan", (4, 3, 8, 8))


@pytest.mark.slow  # imports diffusers
def test_a_real_wan_transformer_refuses_the_wrong_channels(tmp_path):
    from groupflow.diffusion.models import load_diffusers_model
    from tests.diffusion.test_models import _wan

    with pytest.raises(ValueError, match="WanTransformer3DModel takes 4 latent channels, not 16"):
        load_diffusers_model(_wan(tmp_path), "wan", (16, 3, 8, 8))


def test_a_reward_scoring_every_frame_of_a_video_batch_is_named_with_the_cause():
    videos = [torch.rand(3, 4, 8, 8) for _ in range(3)]

    def per_frame(completions):  # a common mistake: one score per frame, not per video
        return [float(f.mean()) for v in completions for f in v.unbind(1)]

    with pytest.raises(
        RewardOutputError,
        match=r"reward 'per_frame' .* returned 12 values for 3 completions.*4 per completion: "
        r"scoring every video frame\?",
    ):
        RewardRunner([RewardFunction("per_frame", per_frame)])(["p"] * 3, videos)

    def frame_rows(completions):
        return torch.stack([v.mean((0, 2, 3)) for v in completions])  # [B, F]

    with pytest.raises(RewardOutputError, match=r"shape \(3, 4\).*a row per completion"):
        RewardRunner([RewardFunction("rows", frame_rows)])(["p"] * 3, videos)


def test_a_frame_index_beyond_the_clip_stops_the_step_naming_the_reward_and_key():
    runner = build_reward_runner([{"name": "brightness", "kwargs": {"frames": [0, 9]}}])
    with pytest.raises(
        RewardConfigError,
        match=r"reward 'brightness': frames=\[0, 9\]: index 9 is beyond the 4-frame clip "
        r"\(indices 0..3\)",
    ):
        runner(["a", "b"], [torch.zeros(3, 4, 8, 8)] * 2)
    with pytest.raises(
        RewardConfigError, match="frames=8 .* on a 4-frame clip scores only frame 0"
    ):
        select_frames(torch.zeros(3, 4, 8, 8), 8)


def test_frame_lists_average_the_chosen_frames_and_bad_values_fail_at_build():
    video = torch.zeros(3, 4, 8, 8)
    video[:, 3] = 1.0
    assert make_brightness_reward(frames=[0, 3])([video]) == pytest.approx([0.5])
    assert make_brightness_reward(frames=[3])([video]) == pytest.approx([1.0])
    for bad in (0, -1, [], [-1], "last", True):
        with pytest.raises(RewardConfigError, match="rewards\\[0\\]: frames must be"):
            build_reward_runner([{"name": "brightness", "kwargs": {"frames": bad}}])


@pytest.mark.slow  # imports diffusers and transformers
def test_a_wrong_text_encoder_folder_fails_the_cli_before_any_worker(tmp_path, capsys, monkeypatch):
    import json

    import yaml

    from groupflow.cli.commands import main
    from groupflow.policies import diffusion as policy
    from tests.diffusion.test_models import _sd3
    from tests.diffusion.test_text_encoders import flux_parts, sd3_parts

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker group started before the text encoders were checked")

    monkeypatch.setattr(policy, "role_group", no_workers)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a cat"}) + "\n")
    sd3 = _sd3(tmp_path)
    wrong = flux_parts(tmp_path / "flux_parts")  # FLUX.1's CLIPTextModel: no projection
    right = sd3_parts(tmp_path / "sd3_parts", t5_dim=24)
    t5 = right.parent / "text_encoder_3"
    cases = [
        ({"text_encoder_path": str(wrong)},
         f"diffusion.model.text_encoder_path: '{wrong}' holds a CLIPTextModel (model_type "
         "clip_text_model), but diffusion.model.kind 'sd3' takes a CLIPTextModelWithProjection"),
        ({"text_encoder_path": str(right), "text_encoder_3_path": str(t5)},
         "diffusion.model.text_encoder_3_path: its embeddings have 24 features; the transformer "
         f"at '{sd3}' takes joint_attention_dim=16 (text encoder: '{t5}')"),
    ]  # fmt: skip
    capsys.readouterr()  # the tiny models' saving progress
    for i, (model, message) in enumerate(cases):
        config = tmp_path / f"c{i}.yaml"
        config.write_text(yaml.safe_dump({
            "run": {"name": f"bad{i}", "output_dir": str(tmp_path), "total_steps": 1,
                    "loggers": []},
            "diffusion": {"model": {"kind": "sd3", "path": str(sd3), "latent_shape": [4, 8, 8],
                                    **model}},
            "data": {"train_files": [str(prompts)], "prompts_per_step": 1},
            "reward": {"functions": [{"name": "brightness"}]},
        }))  # fmt: skip
        assert main(["train", str(config), "--no-plot"]) == 2
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert "Traceback" not in err
        assert lines[0] == f"groupflow train: error: {message}", err
        assert lines[1:] == ["(run with --log-level DEBUG for the full traceback)"], err


@pytest.mark.slow  # imports diffusers and transformers
def test_a_distillation_teacher_is_built_without_the_students_encoders(tmp_path, monkeypatch):
    """The teacher scores the student's states under the student's conditions: its spec names
    no text encoder or VAE (they would load onto the worker's device and never run)."""
    import json

    from groupflow.config import load_config
    from groupflow.policies import diffusion as policy
    from tests.diffusion.test_models import _sd3
    from tests.diffusion.test_text_encoders import sd3_parts

    seen = {}

    def no_workers(*args, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop before the workers")

    monkeypatch.setattr(policy, "role_group", no_workers)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a cat"}) + "\n")
    sd3 = _sd3(tmp_path)
    clip = sd3_parts(tmp_path / "sd3_parts")
    cfg = load_config(None, [
        "run.name=t", f"run.output_dir={tmp_path}", "run.total_steps=1", "run.loggers=[]",
        "diffusion.model.kind=sd3", f"diffusion.model.path={sd3}",
        "diffusion.model.latent_shape=[4,8,8]", f"diffusion.model.text_encoder_path={clip}",
        f"teacher.path={sd3}", f"data.train_files=[{prompts}]", "data.prompts_per_step=1",
        "reward.functions=[{name: brightness}]",
    ])  # fmt: skip
    with pytest.raises(RuntimeError, match="stop before the workers"):
        policy.DiffusionPolicy(cfg, tmp_path, [])
    student, teacher = seen["spec"], seen["teacher_spec"]
    assert student.parts["text_encoder_path"] == str(clip)
    assert teacher.path == student.path and teacher.parts == {"guidance": 3.5}
