"""PPO roles on Ray: the critic group gives the local numbers on 1 Ray worker, matches them on 2
FSDP2 workers, and its sharded checkpoint (with the KL controller) resumes exactly.

Slow (Ray start-up and worker processes); each test uses one torch thread per process.
"""

import json

import pytest

from groupflow.config import load_config
from groupflow.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]  # tests/conftest.py
ray = pytest.importorskip("ray")
RAY_CPUS = 6  # the Ray instance declares actor + critic (two 1-CPU workers each) and the probe

BASE = [
    "model.tiny={hidden_size: 32, num_layers: 2, num_heads: 2}",
    "data.task={name: reverse, digits: 4, num_train: 200, num_val: 16}",
    "data.prompts_per_step=4",
    "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=6",
    "run.loggers=[]",
    "run.num_threads=1",
    "validation.before_training=false",
    "validation.every_steps=0",
    "actor.lr=1e-3",
    "algorithm.estimator=gae",
    "algorithm.lam=0.95",
    "algorithm.kl_in_reward={coef: 0.05, controller: adaptive, target_kl: 0.01, horizon: 50}",
    "critic={lr: 1e-3, micro_batch_samples: 3}",
]


KEYS = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm",
        "kl_in_reward/kl", "kl_in_reward/coef")  # fmt: skip


def run(tmp_path, name, steps, *extra):
    cfg = load_config(
        None,
        [
            *BASE,
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            f"run.total_steps={steps}",
            *extra,
        ],
    )
    trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "critic/vf_loss" in r}


def test_critic_on_ray_one_and_two_workers_and_its_sharded_checkpoint_resumes_exactly(tmp_path):
    # one test, one Ray instance: the 2-worker run compared with 1 worker also writes the sharded
    # checkpoint (step 2) that the resume continues from
    local = run(tmp_path, "local", 2)
    one = run(tmp_path, "one", 2, "run.backend=ray")
    two = run(tmp_path, "two", 2, "run.backend=ray", "run.num_workers=2", "run.save_every=2")
    for k in KEYS:
        assert one[1][k] == local[1][k] and one[2][k] == local[2][k], k
        assert two[1][k] == pytest.approx(one[1][k], rel=1e-5, abs=1e-7), k
        assert two[2][k] == pytest.approx(one[2][k], rel=1e-4, abs=1e-6), k
    assert (tmp_path / "two" / "checkpoints" / "step_2" / "critic_shards").is_dir()
    full = run(tmp_path, "full", 3, "run.backend=ray", "run.num_workers=2", "run.save_every=2")
    resumed = run(tmp_path, "two", 3, "run.backend=ray", "run.num_workers=2", "run.save_every=2")
    for k in KEYS:
        assert resumed[3][k] == full[3][k], k
