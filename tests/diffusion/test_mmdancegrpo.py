"""examples/mmdancegrpo_wan.yaml end to end on a tiny random Wan-shaped transformer (CPU).

Only what a CPU cannot hold changes: the transformer (a random 1-layer WanTransformer3DModel
with the real class and file layout), its text encoder and VAE (tiny random UMT5 and
AutoencoderKLWan in the second test, none in the first), the latent size, the worker count, the step counts, and the
reward (a 7B HPSv3 does not fit a CPU test — its scorer is tested on tiny checkpoints in
test_hpsv3.py; `brightness` on the same first frame with the same 0.1 coefficient stands in). Every other key — DanceGRPO's SDE, shift, same noise per group,
every step trained, advantage clip, reward threshold, warm-up + cosine LR, ratio clip, gradient
clip, micro-batches, LoRA on the attention projections, the online test — is the recipe's.
"""

from pathlib import Path

import pytest
import torch
import yaml

from groupflow.config import apply_overrides, config_from_dict
from groupflow.run.tracking import read_metrics
from groupflow.trainer import Trainer

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "mmdancegrpo_wan.yaml"


def _tiny_wan(path):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=16, num_layers=1, rope_max_seq_len=32,
    ).save_pretrained(path)  # fmt: skip
    return path


def _recipe(tmp_path, model, **over):
    data = yaml.safe_load(RECIPE.read_text())
    data["reward"]["functions"][0] = {
        "name": "brightness", "weight": 0.1, "kwargs": {"frames": "first"},
    }  # fmt: skip
    data["data"]["train_files"] = data["data"]["val_files"] = [
        str(RECIPE.parent / "data" / "video_prompts.jsonl")
    ]
    small = {
        "run.output_dir": str(tmp_path), "run.backend": "local", "run.num_workers": 1,
        "run.total_steps": 2, "run.num_threads": 1, "placement.actor.gpus_per_worker": 0.0,
        "diffusion.model.path": str(model), "diffusion.model.latent_shape": [4, 3, 8, 8],
        "diffusion.model.text_encoder_path": None, "diffusion.model.vae_path": None,
        "diffusion.model.lora.rank": 4, "diffusion.num_steps": 3, "data.prompts_per_step": 2,
        "rollout.samples_per_prompt": 3, "validation.every_steps": 1, "actor.lr": 1e-3,
        "actor.warmup_steps": 2,
    }  # fmt: skip
    return config_from_dict(apply_overrides(data, {**small, **over}))


@pytest.mark.slow  # diffusers' import dominates; the model is tiny
def test_the_recipe_trains_a_wan_shaped_transformer_end_to_end(tmp_path):
    torch.set_num_threads(1)
    model = _tiny_wan(tmp_path / "wan")
    cfg = _recipe(tmp_path, model, **{"algorithm.reward_threshold": -1.0})
    assert cfg.diffusion.sampler == "dance_sde" and cfg.actor.clip_eps_low == 1e-4
    trainer = Trainer(cfg)
    trainer.fit()
    rows = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["batch/trained_steps_per_sample"] == 3.0  # timestep_fraction 1
    assert rows[1]["actor/grad_norm"] > 0
    assert [r["actor/lr"] for r in rows[1:]] == pytest.approx([5e-4, 1e-3])  # linear warm-up
    assert 0 <= rows[1]["reward/mean"] <= 0.1  # 0.1 × brightness of the first frame
    assert all("val/reward/mean" in r for r in rows)
    grids = sorted(p.name for p in (trainer.run_dir / "images").iterdir())
    assert grids == ["step_000000.png", "step_000001.png", "step_000002.png"]
    # the threshold filter: every group's mean is below 0.5 -> no advantage, no gradient
    filtered = Trainer(_recipe(tmp_path, model, **{"run.name": "filtered"}))
    filtered.fit()
    rows = read_metrics(filtered.run_dir / "metrics.jsonl")
    assert rows[1]["advantages/max"] == 0.0 == rows[1]["advantages/min"]
    assert rows[1]["actor/grad_norm"] == 0.0


@pytest.mark.slow
def test_the_recipe_with_the_pipelines_text_encoder_and_vae(tmp_path):
    """Prompts through UMT5, rewards on VAE-decoded first frames: the whole Wan pipeline's path."""
    from tests.diffusion.test_encoders import wan_parts

    torch.set_num_threads(1)
    text, vae = wan_parts(tmp_path / "parts")
    model = _tiny_wan(tmp_path / "wan")
    parts = {"diffusion.model.text_encoder_path": str(text), "diffusion.model.vae_path": str(vae),
             "diffusion.model.max_sequence_length": 8, "algorithm.reward_threshold": -1.0,
             "run.samples_every": 1}  # fmt: skip
    trainer = Trainer(_recipe(tmp_path, model, **parts))
    trainer.fit()
    rows = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert rows[-1]["actor/grad_norm"] > 0 and 0 <= rows[-1]["reward/mean"] <= 0.1
    sample = (trainer.run_dir / "samples.jsonl").read_text().splitlines()[0]
    assert "<image 3x5x16x16" in sample  # decoded video: 5 frames of 16x16, not a latent preview
