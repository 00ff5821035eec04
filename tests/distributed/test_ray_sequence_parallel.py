"""Ulysses sequence parallelism through the whole driver on Ray: 2 workers as one group of 2
(1 data-parallel replica × 2 sequence-parallel ranks) train like 1 worker, and a checkpoint they
write resumes as 2 plain data-parallel workers (another sequence-parallel size).

A KL term and recomputed old log-probs make ``compute_logprobs`` under sequence parallelism part
of every step, on the reference and on the generation copy (which then generates the next step's
samples with its attention switched to the Ulysses function: plain SDPA outside it). Slow (Ray start-up, worker processes); one torch thread each.
"""

import json
import shutil

import pytest

from groupflow.config import load_config
from groupflow.trainer import Trainer

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")

BASE = [
    "model.tiny={hidden_size: 32, num_layers: 2, num_heads: 2}",
    "data.task={name: reverse, digits: 4, num_train: 200, num_val: 16}",
    "data.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=8",
    "run.loggers=[]",
    "run.num_threads=1",
    "validation.before_training=false",
    "validation.every_steps=0",
    "actor.lr=1e-3",
    "actor.kl_coef=0.05",
    "actor.recompute_old_logprobs=always",
]
KEYS = ("reward/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy",
        "response_length/mean")  # fmt: skip
SP2 = ["run.backend=ray", "run.num_workers=2", "parallel.sequence_parallel=2"]


def run(tmp_path, name, steps, *extra):
    cfg = load_config(None, [*BASE, f"run.output_dir={tmp_path}", f"run.name={name}",
                             f"run.total_steps={steps}", *extra])  # fmt: skip
    trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    rows = [
        json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    ]
    return {r["step"]: r for r in rows if "reward/mean" in r}


def test_one_sequence_parallel_group_of_two_trains_like_one_worker_and_resumes_as_two_replicas(
    tmp_path,
):
    one = run(tmp_path, "one", 3)
    sp = run(tmp_path, "sp", 2, *SP2, "run.save_every=2")
    assert sp[1]["actor/kl_loss"] == 0 and sp[2]["actor/kl_loss"] > 0  # the reference is used
    for step in (1, 2):
        for k in KEYS:
            assert sp[step][k] == pytest.approx(one[step][k], rel=1e-4, abs=1e-6), (step, k)
    # the 1 × 2 checkpoint continues as 2 × 1 (sequence_parallel may change on resume)
    shutil.copytree(tmp_path / "sp", tmp_path / "dp")
    dp = run(tmp_path, "dp", 3, "run.backend=ray", "run.num_workers=2", "run.save_every=2")
    assert sorted(dp) == [1, 2, 3]  # steps 1-2 from the checkpoint's run, 3 after resuming
    for k in KEYS:
        assert dp[3][k] == pytest.approx(one[3][k], rel=1e-4, abs=1e-6), k
