"""The diffusion workflow with several rewards: examples/diffusion_two_rewards.yaml, shrunk to
two steps, trains on the group-normalised rewards and logs the held-out monitor beside them."""

from pathlib import Path

import pytest
import yaml

from groupflow.config import apply_overrides, config_from_dict
from groupflow.diffusion.pretrain import pretrain_tiny_model
from groupflow.run.tracking import read_metrics
from groupflow.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("normalize", ["group", "none"])
def test_two_rewards_example_logs_shares_and_the_monitor(tmp_path, normalize):
    labels = ["red", "green", "blue", "yellow", "cyan", "magenta"]  # the example data's prompts
    pretrain_tiny_model(tmp_path / "base", labels=labels, steps=10, seed=0)
    data = yaml.safe_load((ROOT / "examples" / "diffusion_two_rewards.yaml").read_text())
    data["data"]["train_files"] = data["data"]["val_files"] = [
        str(ROOT / "examples" / "data" / "diffusion_colors.jsonl")
    ]
    data["reward"]["functions"][0]["function"] = str(
        ROOT / "examples/rewards/wide_scale.py:sky_x100"
    )
    cfg = config_from_dict(apply_overrides(data, {
        "reward.normalize": normalize, "run.output_dir": str(tmp_path), "run.total_steps": 2,
        "run.loggers": [], "diffusion.model.path": str(tmp_path / "base"),
        "diffusion.num_steps": 4, "diffusion.save_images": False, "data.prompts_per_step": 2,
        "rollout.samples_per_prompt": 4, "validation.every_steps": 2, "run.save_final": False,
    }))  # fmt: skip
    trainer = Trainer(cfg)
    trainer.fit()
    rows = read_metrics(trainer.run_dir / "metrics.jsonl")
    train = [r for r in rows if "reward/sky/share" in r]
    assert len(train) == 2
    for r in train:
        assert r["reward/sky/share"] + r["reward/compressibility/share"] == pytest.approx(1.0)
        assert "reward/sky_pixel/mean" in r and "reward/sky_pixel/share" not in r
        if normalize == "none":  # the trained total is the plain weighted sum of the two
            total = r["reward/sky/mean"] + r["reward/compressibility/mean"]
            assert r["reward/total/mean"] == pytest.approx(total, rel=1e-5)
        else:  # a sum of z-scores is centred in every group
            assert r["reward/total/mean"] == pytest.approx(0.0, abs=1e-5)
    assert any("val/reward/sky_pixel/mean" in r for r in rows)  # validated, not trained on
