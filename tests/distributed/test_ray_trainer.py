"""The same driver on Ray: 1 worker equals local, 2 FSDP2 workers match, sharded checkpoints resume.

Slow (Ray start-up and worker processes); each test uses one torch thread per process.
"""

import json
import math
import shutil

import pytest
import torch
import yaml

from groupflow.cli.commands import main
from groupflow.config import load_config
from groupflow.distributed import WorkerError
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
    "validation.samples_per_prompt=1",
    "actor.lr=1e-3",
    "actor.lr_schedule=cosine",
    "actor.warmup_steps=2",
]
NOT_TRAINED = ("time/", "perf/", "wall_time", "val/")
KEYS = (
    "reward/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "actor/lr",
    "response_length/mean",
)


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
    return metrics(tmp_path / name)


def metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "reward/mean" in r}


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """``local_run(staleness)``: the run directory of the local 3-step run with
    rollout.max_staleness ``staleness`` (samples kept), run once for all the tests that compare
    with it."""
    root, done = tmp_path_factory.mktemp("local"), set()

    def get(staleness):
        name = f"local{staleness}"
        if staleness not in done:
            run(root, name, 3, f"rollout.max_staleness={staleness}", "run.samples_every=1")
            done.add(staleness)
        return root / name

    return get


def test_one_ray_worker_gives_the_local_numbers_and_two_fsdp_workers_match_it(tmp_path, local_run):
    local = metrics(local_run(0))
    one = run(tmp_path, "one", 3, "run.backend=ray")
    for step in (1, 2, 3):
        for k in KEYS:
            assert one[step][k] == local[step][k], (step, k)
    two = run(tmp_path, "two", 3, "run.backend=ray", "run.num_workers=2")
    # step 1: same samples (per-sample seeds), same loss and gradient up to float reduction order
    for k in KEYS:
        assert two[1][k] == pytest.approx(one[1][k], rel=1e-5, abs=1e-7), k
    assert two[2]["actor/grad_norm"] > 0  # training proceeds on the sharded model
    for step in (2, 3):
        for k in KEYS:
            assert two[step][k] == pytest.approx(one[step][k], rel=1e-4, abs=1e-6), (step, k)


def test_sharded_checkpoint_resumes_on_two_and_on_one_worker_and_exports(tmp_path):
    """Also: the 2-worker run, stopped at step 2, then loses its rank-1 process: it stops with a
    clear error, and the resume from the step-2 checkpoint continues (exactly)."""
    two = ["run.backend=ray", "run.num_workers=2", "run.save_every=2"]
    full = run(tmp_path, "full", 4, *two)
    args = [*BASE, f"run.output_dir={tmp_path}", "run.name=part", *two]
    part = Trainer(load_config(None, [*args, "run.total_steps=2", "run.worker_timeout_s=60"]))
    part.fit()
    assert (tmp_path / "part" / "checkpoints" / "step_2" / "shards").is_dir()
    # resharded: the 2-worker checkpoint continues on a single worker ...
    shutil.copytree(tmp_path / "part", tmp_path / "single")
    part.cfg.run.total_steps = 4
    ray.kill(part.policy.actor._hosts[1])  # the rank-1 process dies
    with pytest.raises(
        WorkerError, match=r"ActorRolloutWorker rank 1: \w+\(\) failed: the worker process died"
    ):
        part.fit()
    part.shutdown()
    resumed = run(tmp_path, "part", 4, *two)
    single = run(tmp_path, "single", 4, "run.backend=ray", "run.save_every=2")
    assert sorted(resumed) == [1, 2, 3, 4]
    assert torch.isfinite(torch.tensor(resumed[4]["actor/pg_loss"]))
    for step in (3, 4):
        for k in KEYS:
            assert resumed[step][k] == full[step][k], (step, k)
            assert single[step][k] == pytest.approx(full[step][k], rel=1e-5, abs=1e-7), (step, k)
    # ... and exports to a plain HF directory
    out = tmp_path / "export"
    config = str(tmp_path / "part" / "config.yaml")  # the resolved config the run saved
    assert main(["export", config, "--checkpoint", str(tmp_path / "part"), "--out", str(out)]) == 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_single_worker_checkpoint_resumes_on_two_workers(tmp_path):
    full = run(tmp_path, "full", 4, "run.save_every=2")
    run(tmp_path, "part", 2, "run.save_every=2")
    # the one-worker checkpoint (full weights + index-keyed AdamW state) is sharded over 2 ranks
    two = run(tmp_path, "part", 4, "run.backend=ray", "run.num_workers=2", "run.save_every=2")
    for step in (3, 4):
        for k in KEYS:
            assert two[step][k] == pytest.approx(full[step][k], rel=1e-5, abs=1e-7), (step, k)


def test_rollout_and_reference_pools_on_ray_match_the_colocated_run(tmp_path):
    kl = "actor.kl_coef=0.1"
    colocated = run(tmp_path, "colo", 2, kl)
    apart = run(
        tmp_path, "apart", 2, kl, "run.backend=ray", "run.num_workers=2",
        "placement.actor={nodes: 1, workers_per_node: 2, cpus_per_worker: 0.5}",
        "placement.rollout={workers_per_node: 1, cpus_per_worker: 0.5}",
        "placement.reference={workers_per_node: 1, cpus_per_worker: 0.5}",
    )  # fmt: skip
    for step in (1, 2):
        for k in (*KEYS, "actor/kl_loss"):
            assert apart[step][k] == pytest.approx(colocated[step][k], rel=1e-5, abs=1e-7), (
                step,
                k,
            )


def test_async_rollout_with_a_ray_rollout_pool_matches_the_local_process_worker(
    tmp_path, local_run
):
    # rollout.max_staleness=1 on Ray: the rollout pool holds the scheduled (one version old)
    # weights and generates in the background; the numbers are those of the local child process.
    k1 = "rollout.max_staleness=1"
    local = metrics(local_run(1))
    on_ray = run(
        tmp_path, "ray", 3, k1, "run.backend=ray",
        "placement.actor={nodes: 1, workers_per_node: 1, cpus_per_worker: 0.5}",
        "placement.rollout={workers_per_node: 1, cpus_per_worker: 0.5}",
    )  # fmt: skip
    for step in (1, 2, 3):
        assert on_ray[step]["async/staleness"] == local[step]["async/staleness"]
        for k in KEYS:
            assert on_ray[step][k] == pytest.approx(local[step][k], rel=1e-5, abs=1e-7), (step, k)


def test_in_flight_updates_reach_a_ray_rollout_pool_s_workers_between_decode_steps(
    tmp_path, monkeypatch
):
    """rollout.async_mode=in_flight with a Ray rollout pool of 2 workers: each fetches the
    versions the loop actor's board posts, between its own decode steps (the switch itself,
    pinned, is tests/workers/test_inference.py; the board, tests/rollout/test_ray_host.py). Every
    trained token records a version within the staleness bound, a sample is as old as its first
    token and never goes back, the metrics report it, and no weights pass the driver."""
    from tests.rollout.test_hosts import _capture_trained

    trained = _capture_trained(monkeypatch)
    rows = run(
        tmp_path, "in_flight", 4, "rollout.max_staleness=1", "rollout.async_mode=in_flight",
        "actor.off_policy=decoupled", "rollout.max_new_tokens=32", "run.backend=ray",
        "placement.actor={nodes: 1, workers_per_node: 1, cpus_per_worker: 0.5}",
        "placement.rollout={workers_per_node: 2, cpus_per_worker: 0.5}",
    )  # fmt: skip
    assert sorted(trained) == [0, 1, 2, 3]
    for step, batch in trained.items():
        mask, versions = batch["response_mask"].bool(), batch["token_versions"]
        assert (versions[~mask] == -1).all() and (versions[mask] >= max(0, step - 1)).all()
        assert (versions[mask] <= step).all(), step
        for row, m, v in zip(versions, mask, batch["version"].tolist()):
            assert row[m].tolist() == sorted(row[m].tolist()) and row[m][0] == v
        logged = rows[step + 1]
        assert logged["weights/bytes_via_driver"] == 0.0
        stale = (step - versions)[mask].float()
        assert logged["async/token_staleness_mean"] == pytest.approx(float(stale.mean()))
        assert 0.0 <= logged["async/samples_switched_frac"] <= 1.0
        assert math.isfinite(logged["actor/loss"])
    # batch 0 ran before version 1 existed; the later ones decode 32 tokens, which takes longer
    # than the update that publishes the next version (measured: 50-80 % of samples switch)
    switched = [rows[s]["async/samples_switched_frac"] for s in (1, 2, 3, 4)]
    assert switched[0] == 0.0 and max(switched) > 0.0, switched


def samples(run_dir):
    """step -> [(prompt, completion)] of the run's samples.jsonl (run.samples_every=1)."""
    out: dict = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], []).append((row["prompt"], row["completion"]))
    return out


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_ray_rollout_pool_generates_and_no_weights_pass_the_driver(
    tmp_path, staleness, monkeypatch, local_run
):
    """2 actor ranks, 1 rollout worker: the pool's worker generates every training batch (the
    asynchronous side too, whose whole loop runs in a Ray actor on the pool, not in the driver),
    versions reach it without the driver (weights/bytes_via_driver is 0 at every step) —
    synchronously broadcast by both actor ranks (the collective transport, the default there),
    asynchronously through Ray's object store — and the run is the local run's (colocated, or
    the local child process): the same prompts at every step and, while the weights are the
    initial ones on both, the same sampled tokens."""
    import groupflow.rollout.side

    k = f"rollout.max_staleness={staleness}"
    local = metrics(local_run(staleness))
    cfg = load_config(
        None,
        [*BASE, f"run.output_dir={tmp_path}", "run.name=pool", "run.total_steps=3", k,
         "run.backend=ray", "run.num_workers=2", "run.samples_every=1",
         "placement.actor={nodes: 1, workers_per_node: 2, cpus_per_worker: 0.5}",
         "placement.rollout={workers_per_node: 1, cpus_per_worker: 0.5}"],
    )  # fmt: skip

    def not_in_the_driver(*args, **kwargs):
        raise AssertionError("the asynchronous rollout side collected in the driver's process")

    monkeypatch.setattr(groupflow.rollout.side, "collect_step", not_in_the_driver)
    trainer = Trainer(cfg)
    try:
        assert trainer.policy.transport.name == ("ray" if staleness else "collective")
        trainer.fit()
        pool = trainer.policy.rollout_pool.generated()
        actor = trainer.policy.actor.generated()
    finally:
        trainer.shutdown()
    rows = metrics(tmp_path / "pool")
    assert [rows[s]["weights/bytes_via_driver"] for s in (1, 2, 3)] == [0.0, 0.0, 0.0]
    assert [rows[s]["weights/bytes_between_nodes"] for s in (1, 2, 3)] == [0.0] * 3  # one node
    assert all(rows[s]["time/weight_transfer"] > 0 for s in (1, 2, 3))
    train_samples = 3 * 4 * 4  # steps × prompts × samples per prompt
    if staleness:  # the side generated exactly the training batches; the final validation
        assert pool == [train_samples]  # ran on the actor (the current weights)
    else:  # training batches and the final validation, all on the pool
        assert pool[0] > train_samples and actor == [0, 0]
    # the first batch (k=1: the first two) comes from the initial weights on both: the very same
    # sampled tokens; later ones from weights equal up to float reduction order (2 ranks vs 1)
    ours, theirs = samples(tmp_path / "pool"), samples(local_run(staleness))
    assert [[p for p, _ in ours[s]] for s in (1, 2, 3)] == [
        [p for p, _ in theirs[s]] for s in (1, 2, 3)
    ]
    for step in range(1, 2 + staleness):
        assert ours[step] == theirs[step], step
        assert rows[step]["reward/mean"] == local[step]["reward/mean"]
        assert rows[step]["response_length/mean"] == local[step]["response_length/mean"]
    for step in (1, 2, 3):
        for key in KEYS:
            assert rows[step][key] == pytest.approx(local[step][key], rel=1e-5, abs=1e-7), (
                step,
                key,
            )


def test_driver_sigkill_and_a_killed_rollout_worker_with_a_rollout_pool_resume_exactly(
    tmp_path, train_until_sigkill
):
    """max_staleness 1 with a Ray rollout pool. (1) The driver (``groupflow train``, joined to
    this Ray instance as a driver joins a cluster) is SIGKILLed mid-run once the step-2
    checkpoint exists — a batch is always in flight — and the resume reproduces the
    uninterrupted run's metrics bit for bit: the checkpoint keeps the in-flight version, read
    back through the transport. (2) A rollout worker killed mid-run stops the run with an error
    naming the role, the rank and the policy version; the run resumes, again exactly."""
    from groupflow.rollout.hosts import RolloutError
    from groupflow.run.checkpoint import find_latest_checkpoint, load_checkpoint

    # a constant LR: the killed run is given more steps than it lives (it must not finish
    # first), and run.total_steps then changes nothing that is trained
    pool = ["rollout.max_staleness=1", "run.backend=ray", "run.save_every=2",
            "actor.lr_schedule=constant", "run.worker_timeout_s=60",
            "placement.actor={nodes: 1, workers_per_node: 1, cpus_per_worker: 0.5}",
            "placement.rollout={workers_per_node: 1, cpus_per_worker: 0.5}"]  # fmt: skip
    full = run(tmp_path, "full", 4, *pool)
    pool.append(f"run.ray_address={ray.get_runtime_context().gcs_address}")
    args = [*BASE, *pool, f"run.output_dir={tmp_path}", "run.name=crash"]
    config_file = tmp_path / "crash.yaml"
    config_file.write_text(
        yaml.safe_dump(load_config(None, [*args, "run.total_steps=8"]).to_dict())
    )
    train_until_sigkill(
        config_file, tmp_path / "crash" / "checkpoints" / "step_2" / "manifest.json"
    )
    latest = find_latest_checkpoint(tmp_path / "crash" / "checkpoints")
    assert latest is not None and latest.name in ("step_2", "step_4")
    step = int(latest.name.split("_")[1])
    assert load_checkpoint(latest)["async_rollout"]["versions"] == [step - 1]  # in flight

    trainer = Trainer(load_config(None, [*args, f"run.total_steps={step + 1}"]))
    trainer.fit()  # resumed after the SIGKILL: one step
    trainer.cfg.run.total_steps = step + 2
    ray.kill(trainer.policy.rollout_pool._hosts[0])  # the rollout worker's process dies
    with pytest.raises((RolloutError, WorkerError)) as err:
        trainer.fit()
    trainer.shutdown()
    text = f"{err.value} {' '.join(getattr(err.value, '__notes__', []))}"
    assert "InferenceWorker (rollout role) rank 0" in text and "the worker process died" in text
    assert f"batch of step {step + 1}, policy version {step}" in text
    resumed = run(tmp_path, "crash", 4, *pool)  # from the checkpoint the resumed run ended with
    assert sorted(resumed) == [1, 2, 3, 4]
    for s in resumed:  # what is trained, not how fast, nor validation at where a run ended
        keys = {k for k in full[s].keys() | resumed[s].keys() if not k.startswith(NOT_TRAINED)}
        differ = sorted(k for k in keys if full[s].get(k) != resumed[s].get(k))
        assert not differ, (s, differ)
