"""A Ray rollout pool generating with vLLM (runs in .venv-vllm, which has Ray too).

One actor worker, one rollout worker, one thread each, the tiny model in float32 (head dim 64, as
vLLM's CPU attention needs): the pool's worker builds the vLLM engine and receives every version
through the weight transport — synchronously the collective broadcast, asynchronously
(``max_staleness: 1``, the rollout loop in a Ray actor on the pool) Ray's object store — so no
weight passes the driver; the ids the actor trains are the ids vLLM sampled, and the training
forward's log-probs match vLLM's within fp32 kernel differences. On run.backend=local the pool's
one worker generates with vLLM in the trainer's process.
"""

import json

import pytest
import torch

from groupflow.rollout.vllm_engine import vllm_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not vllm_available(),
        reason="vLLM is not installed here; runs in .venv-vllm (bash scripts/setup_vllm.sh)",
    ),
]


BASE = [
    "model.tiny={hidden_size: 128, num_layers: 2, num_heads: 2, max_positions: 32}",
    "data.task={name: reverse, digits: 4, num_train: 200, num_val: 4}",
    "data.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=5",
    "rollout.engine=vllm", "rollout.vllm.dtype=float32", "rollout.vllm.cpu_kv_cache_gib=1",
    "run.num_workers=1", "run.num_threads=1", "run.loggers=[]",
    "validation.before_training=false", "validation.every_steps=0",
    "validation.samples_per_prompt=1",
]  # fmt: skip


def _rows(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "reward/mean" in r}


def _token_lists(batch):
    """Each sample's prompt ids and response ids, padding removed."""
    out = []
    for p, pm, r, rm in zip(batch["prompt_ids"], batch["prompt_mask"], batch["responses"],
                            batch["response_mask"]):  # fmt: skip
        out.append((p[pm.bool()].tolist(), r[rm.bool()].tolist()))
    return out


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_ray_rollout_pool_generates_with_vllm(tmp_path, monkeypatch, staleness):
    pytest.importorskip("ray")
    from groupflow.config import load_config
    from groupflow.trainer import Trainer

    cfg = load_config(
        None,
        [*BASE, f"rollout.max_staleness={staleness}", "run.backend=ray", "run.total_steps=2",
         f"run.output_dir={tmp_path}", "run.name=pool",
         "placement.actor={nodes: 1, workers_per_node: 1, cpus_per_worker: 0.5}",
         "placement.rollout={workers_per_node: 1, cpus_per_worker: 0.5}"],
    )  # fmt: skip
    trainer = Trainer(cfg)
    sampled, trained = [], []
    try:
        policy = trainer.policy
        pool = policy.rollout_pool
        assert pool is not policy.actor
        assert policy.transport.name == ("ray" if staleness else "collective")
        generate, update = pool.generate, policy.update

        def recording_generate(*args, **kwargs):
            out = generate(*args, **kwargs)
            sampled.append(out)
            return out

        def recording_update(batch, **kwargs):
            trained.append(batch)
            return update(batch, **kwargs)

        monkeypatch.setattr(pool, "generate", recording_generate)  # the driver's calls
        monkeypatch.setattr(policy, "update", recording_update)
        trainer.fit()
        engines = pool.engine_state()
        pool_samples, actor_samples = pool.generated(), policy.actor.generated()
    finally:
        trainer.shutdown()
    rows = _rows(tmp_path / "pool")
    assert sorted(rows) == [1, 2]
    # the pool's worker holds a vLLM engine whose weights came by transport, not the driver: the
    # last version it received (-1: the initial ones) is the final validation's (2) synchronously,
    # the scheduled version of step 2's batch (2 - 1 - staleness = 0) asynchronously
    assert engines == [("vllm", 0 if staleness else 2)], engines
    assert [rows[s]["weights/bytes_via_driver"] for s in (1, 2)] == [0.0, 0.0]
    assert all(rows[s]["time/weight_transfer"] > 0 for s in (1, 2))
    train_samples = 2 * 4 * 4  # steps × prompts × samples per prompt
    assert len(trained) == 2
    if staleness:
        # the rollout loop's Ray actor called the pool for exactly the training batches; the
        # final validation ran on the actor's own engine (the current weights)
        assert pool_samples == [train_samples] and actor_samples[0] > 0 and not sampled
        # step 1 trains version-0 samples with version-0 weights: vLLM and the forward agree
        assert rows[1]["rollout/logprob_diff_max"] < 1e-3, rows[1]
        assert [rows[s]["async/staleness"] for s in (1, 2)] == [0.0, 1.0]
        return
    # synchronous: the pool generated every batch (training, then the final validation)
    assert pool_samples[0] > train_samples and actor_samples == [0]
    # the trained ids are the sampled ones: the first two generate calls are the training batches
    for got, seen in zip(trained, sampled[:2]):
        assert _token_lists(got) == _token_lists(seen)
        assert torch.equal(got["rollout_logprobs"][got["response_mask"].bool()],
                           seen["rollout_logprobs"][seen["response_mask"].bool()])  # fmt: skip
    for s in (1, 2):
        # vLLM's sampling log-probs against the actor's training forward (fp32 on both sides)
        assert rows[s]["rollout/logprob_diff_max"] < 1e-3, rows[s]


def test_a_local_rollout_pool_generates_with_vllm(tmp_path):
    """run.backend=local (also what ``groupflow generate`` / ``eval`` force on a Ray config): the
    pool's one worker runs in this process with the only vLLM engine (the actor keeps HF's)."""
    from groupflow.config import load_config
    from groupflow.trainer import Trainer

    cfg = load_config(
        None,
        [*BASE, "run.total_steps=1", f"run.output_dir={tmp_path}", "run.name=local",
         "placement.rollout={workers_per_node: 1}"],
    )  # fmt: skip
    trainer = Trainer(cfg)
    try:
        trainer.fit()
        engines = trainer.policy.rollout_pool.engine_state()
        pool_samples = trainer.policy.rollout_pool.generated()
        actor_samples = trainer.policy.actor.generated()
        actor_engine = trainer.policy.actor.engine.name
    finally:
        trainer.shutdown()
    row = _rows(tmp_path / "local")[1]
    assert engines == [("vllm", 1)] and actor_engine == "hf", (engines, actor_engine)
    assert pool_samples[0] > 4 * 4 and actor_samples == [0]
    assert row["rollout/logprob_diff_max"] < 1e-3, row
