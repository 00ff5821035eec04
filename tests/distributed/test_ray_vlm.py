"""Image prompts on Ray: the tiny VLM (model.tiny.vision) gives the local numbers on one Ray
worker and matches them on two FSDP2 workers (images travel with the samples to each rank).

Slow (Ray start-up and worker processes); one torch thread per process.
"""

import json

import pytest

from groupflow.config import load_config
from groupflow.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]  # tests/conftest.py
ray = pytest.importorskip("ray")

BASE = [
    "model.tiny={hidden_size: 32, num_layers: 1, num_heads: 2, max_positions: 32, vision: "
    "{image_size: 32, patch_size: 8, scale_factor: 2, hidden_size: 16, num_layers: 1}}",
    "data.task={name: shapes, num_train: 64, num_val: 8}",
    "data.min_pixels=1024",
    "data.prompts_per_step=4",
    "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=2",
    "run.loggers=[]",
    "run.num_threads=1",
    "validation.before_training=false",
    "validation.every_steps=0",
    "actor.lr=1e-3",
]
KEYS = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean")


def run(tmp_path, name, *extra):
    cfg = load_config(None, [*BASE, f"run.output_dir={tmp_path}", f"run.name={name}",
                             "run.total_steps=2", *extra])  # fmt: skip
    trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "actor/pg_loss" in r}


@pytest.mark.parametrize("freeze", [True, False])
def test_image_prompts_on_one_and_two_ray_workers(tmp_path, freeze):
    flag = f"model.freeze_vision={str(freeze).lower()}"
    local = run(tmp_path, "local", flag)
    one = run(tmp_path, "one", flag, "run.backend=ray")
    two = run(tmp_path, "two", flag, "run.backend=ray", "run.num_workers=2")
    for k in KEYS:
        assert one[1][k] == local[1][k] and one[2][k] == local[2][k], k
        assert two[1][k] == pytest.approx(one[1][k], rel=1e-5, abs=1e-7), k
        assert two[2][k] == pytest.approx(one[2][k], rel=1e-4, abs=1e-6), k


def test_multi_turn_observation_images_on_two_fsdp_workers(tmp_path, helpers_on_path):
    """Each rank's rows may or may not show observation images: the ranks agree on the image
    pass (models/causal_lm.py), so two workers give the local numbers and never hang."""
    mt = [
        "model.tiny.max_positions=96", "data.max_prompt_tokens=64", "rollout.max_new_tokens=3",
        "rollout.max_turns=2", "rollout.max_response_tokens=40",
        "rollout.environment={class: 'agent_helpers:NumberPictureEnv'}",
        "sft={steps: 20, batch_samples: 16, lr: 0.02, check_every: 100}", "run.total_steps=1",
    ]  # fmt: skip
    local = run(tmp_path, "mt_local", *mt)
    two = run(tmp_path, "mt_two", *mt, "run.backend=ray", "run.num_workers=2")
    assert local[1]["rollout/observation_tokens/mean"] > 0
    for k in (*KEYS, "rollout/observation_tokens/mean"):
        assert two[1][k] == pytest.approx(local[1][k], rel=1e-5, abs=1e-7), k
