"""Two Ray nodes on one machine (the ``two_nodes`` fixture): pools pinned to a node by a custom
resource land there; a run whose rollout pool (or reference, or critic) is on the other node
than its actor gives the one-process numbers with no weights through the driver and nothing read
from or written to the driver's run directory by node B; node B dying mid-run is named, and a
fresh node B resumes exactly.

Slow (a cluster start and worker processes); one torch thread per process.
"""

import json
import re
from pathlib import Path

import pytest
import torch

from groupflow.config import load_config
from groupflow.distributed import PlacementError, PoolSpec
from groupflow.distributed.placement import RayPool
from groupflow.distributed.transport import tensors_nbytes
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
    "run.samples_every=1",
    "validation.before_training=false",
    "validation.every_steps=0",
    "validation.samples_per_prompt=1",
    "actor.lr=1e-3",
    "actor.lr_schedule=cosine",
    "actor.warmup_steps=2",
]
KEYS = (
    "reward/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "actor/lr",
    "response_length/mean",
)
ON_A = "{nodes: 1, workers_per_node: 1, cpus_per_worker: 0.5, resources: {node_a: 1}}"
ON_B = "{workers_per_node: 1, cpus_per_worker: 0.5, resources: {node_b: 1}}"


def config(out, name, steps, *extra):
    return load_config(
        None,
        [*BASE, f"run.output_dir={out}", f"run.name={name}", f"run.total_steps={steps}", *extra],
    )


def metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "reward/mean" in r}


def samples(run_dir):
    out: dict = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], []).append((row["prompt"], row["completion"]))
    return out


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """``local_run(*overrides)``: the run directory of the same run on run.backend=local (one
    process, no Ray), made once per distinct override list."""
    root, done = tmp_path_factory.mktemp("local"), {}

    def get(steps, *extra):
        key = (steps, *extra)
        if key not in done:
            name = f"local{len(done)}"
            trainer = Trainer(config(root, name, steps, *extra))
            try:
                trainer.fit()
            finally:
                trainer.shutdown()
            done[key] = root / name
        return done[key]

    return get


@ray.remote(num_cpus=0)
def _node_id():
    return ray.get_runtime_context().get_node_id()


def test_a_pool_pinned_to_a_node_resource_lands_there_and_a_missing_one_is_named(two_nodes):
    for resource, node in (("node_a", two_nodes.a), ("node_b", two_nodes.b)):
        pool = RayPool(PoolSpec(cpus_per_worker=0.1, name="rollout", resources={resource: 1}))
        try:
            strategy = pool.options(0)["scheduling_strategy"]
            assert ray.get(_node_id.options(scheduling_strategy=strategy).remote()) == node
        finally:
            pool.remove()
    with pytest.raises(PlacementError, match=r"pool 'rollout'.*no node has node_c"):
        RayPool(PoolSpec(name="rollout", resources={"node_c": 1}), timeout_s=1)


def test_node_b_cannot_open_the_driver_only_directory(two_nodes):
    """The fixture's premise: a path under ``driver_only`` exists for the driver, not on node B."""
    marker = two_nodes.driver_only / "here.txt"
    marker.write_text("driver")

    @ray.remote(num_cpus=0)
    def read(path):
        try:
            return open(path).read()
        except FileNotFoundError as e:
            return f"missing: {e}"

    on = {
        n: ray.get(read.options(resources={n: 0.01}).remote(str(marker)))
        for n in ("node_a", "node_b")
    }
    assert on["node_a"] == "driver"
    assert on["node_b"].startswith("missing:") and "on the driver's node only" in on["node_b"]


# max_staleness 1 also saves at step 2 with a constant LR: the node-failure test resumes from it
APART = {0: ("rollout.max_staleness=0",),
         1: ("rollout.max_staleness=1", "run.save_every=2", "actor.lr_schedule=constant")}  # fmt: skip
PINNED = ("run.backend=ray", f"placement.actor={ON_A}", f"placement.rollout={ON_B}")
NOT_TRAINED = ("time/", "perf/", "wall_time", "val/")


@pytest.fixture(scope="module")
def apart_run(two_nodes):
    """``apart_run(staleness)``: (run directory, what the trainer saw) of the 3-step run with the
    actor on node A and the rollout pool on node B, made once per module."""
    done = {}

    def get(staleness):
        if staleness not in done:
            name = f"apart{staleness}"
            trainer = Trainer(config(two_nodes.driver_only, name, 3, *APART[staleness], *PINNED))
            try:
                seen = {
                    "transport": trainer.policy.transport.name,
                    "actor": two_nodes.node_of(trainer.policy.actor),
                    "rollout": two_nodes.node_of(trainer.policy.rollout_pool),
                    "nbytes": tensors_nbytes(trainer.policy.snapshot()),
                }
                trainer.fit()
                seen["generated"] = trainer.policy.rollout_pool.generated()
            finally:
                trainer.shutdown()
            done[staleness] = two_nodes.driver_only / name, seen
        return done[staleness]

    return get


@pytest.mark.parametrize("staleness", [0, 1])
def test_actor_on_node_a_and_rollout_pool_on_node_b_give_the_single_node_run(
    two_nodes, local_run, apart_run, staleness
):
    """The actor on node A (the driver's), the rollout pool on node B; synchronously (the
    collective transport: the actor rank broadcasts to the pool across nodes) and with
    max_staleness 1 (Ray's object store; the asynchronous side runs on the pool). The run
    directory is on the driver's node only: node B never opens it (the tokenizer the run
    trained travels with the workers' spec). Every batch is generated on node B, no byte of the
    weights passes the driver, each version crosses nodes once (logged per step), and the
    samples and numbers are those of the one-process run."""
    run_dir, seen = apart_run(staleness)
    assert seen["transport"] == ("ray" if staleness else "collective")
    assert (seen["actor"], seen["rollout"]) == ([two_nodes.a], [two_nodes.b])
    rows, local_dir = metrics(run_dir), local_run(3, *APART[staleness])
    local = metrics(local_dir)
    assert [rows[s]["weights/bytes_via_driver"] for s in (1, 2, 3)] == [0.0, 0.0, 0.0]
    # each step's version crosses from node A to the one worker on node B once (the
    # deterministic schedule loads every version), whole
    assert [rows[s]["weights/bytes_between_nodes"] for s in (1, 2, 3)] == [seen["nbytes"]] * 3
    train_samples = 3 * 4 * 4  # steps × prompts × samples per prompt
    if staleness:  # the side generated exactly the training batches (validation: the actor)
        assert seen["generated"] == [train_samples]
    else:  # the training batches and the final validation
        assert seen["generated"][0] > train_samples
    # what was sampled on node B is what was trained: the one-process run's samples and numbers
    assert samples(run_dir) == samples(local_dir)
    for step in (1, 2, 3):
        for key in KEYS:
            assert rows[step][key] == pytest.approx(local[step][key], rel=1e-5, abs=1e-7), (
                step, key,
            )  # fmt: skip


def test_reference_on_node_b_gives_the_colocated_kl(two_nodes, local_run):
    """The reference in a pool on node B (fed once through Ray's object store), the actor and
    rollout on node A: the KL loss and the rest are the one-process run's."""
    kl = "actor.kl_coef=0.1"
    cfg = config(two_nodes.driver_only, "reference", 2, kl, "run.backend=ray",
                 f"placement.actor={ON_A}", f"placement.reference={ON_B}")  # fmt: skip
    trainer = Trainer(cfg)
    try:
        assert two_nodes.node_of(trainer.policy.reference) == [two_nodes.b]
        trainer.fit()
    finally:
        trainer.shutdown()
    rows, local = metrics(two_nodes.driver_only / "reference"), metrics(local_run(2, kl))
    for step in (1, 2):
        assert rows[step]["weights/bytes_via_driver"] == 0.0
        for key in (*KEYS, "actor/kl_loss"):
            assert rows[step][key] == pytest.approx(local[step][key], rel=1e-5, abs=1e-7), (
                step, key,
            )  # fmt: skip


PPO = (
    "rollout.samples_per_prompt=2",
    "algorithm.estimator=gae",
    "algorithm.lam=0.95",
    "algorithm.kl_in_reward={coef: 0.05, controller: adaptive, target_kl: 0.01, horizon: 50}",
    "critic={lr: 1e-3, micro_batch_samples: 3}",
)


def test_critic_on_node_b_gives_the_one_process_ppo_numbers(two_nodes, local_run):
    """PPO with the critic's pool on node B (initialised from the policy through Ray's object
    store, its tokenizer carried in the spec), the actor on node A: the one-process run's critic
    and policy numbers, exactly (one worker per role, as on one node)."""
    cfg = config(two_nodes.driver_only, "critic", 2, *PPO, "run.backend=ray",
                 f"placement.actor={ON_A}", f"placement.critic={ON_B}")  # fmt: skip
    trainer = Trainer(cfg)
    try:
        assert two_nodes.node_of(trainer.policy.critic) == [two_nodes.b]
        trainer.fit()
    finally:
        trainer.shutdown()
    rows, local = metrics(two_nodes.driver_only / "critic"), metrics(local_run(2, *PPO))
    for step in (1, 2):
        assert rows[step]["weights/bytes_via_driver"] == 0.0
        for key in ("reward/mean", "actor/pg_loss", "critic/vf_loss", "critic/grad_norm",
                    "kl_in_reward/kl"):  # fmt: skip
            assert rows[step][key] == local[step][key], (step, key)


def test_an_actor_with_a_rank_on_each_node_trains_as_two_ranks_on_one(two_nodes, tmp_path):
    """FSDP2 over gloo between nodes: the actor's two ranks, one per node (each node offers one
    ``one_per_node``), rendezvous at rank 0's node and train as two ranks on one node do (up to
    float reduction order, as there). Each rank writes its shard of the final checkpoint into
    the run directory, which must be on storage both nodes see (docs/guides/ray.md: on the
    driver's disk alone, save_sharded fails on node B naming the path)."""
    two = ("run.backend=ray", "run.num_workers=2")
    apart = config(tmp_path, "fsdp_apart", 2, *two,
                   "placement.actor={nodes: 2, workers_per_node: 1, cpus_per_worker: 0.5, "
                   "resources: {one_per_node: 1}}")  # fmt: skip
    trainer = Trainer(apart)
    try:
        assert sorted(two_nodes.node_of(trainer.policy.actor)) == sorted([two_nodes.a, two_nodes.b])
        trainer.fit()
    finally:
        trainer.shutdown()
    together = config(tmp_path, "fsdp_together", 2, *two,
                      "placement.actor={nodes: 1, workers_per_node: 2, cpus_per_worker: 0.5, "
                      "resources: {node_a: 1}}")  # fmt: skip
    trainer = Trainer(together)
    try:
        assert two_nodes.node_of(trainer.policy.actor) == [two_nodes.a] * 2
        trainer.fit()
    finally:
        trainer.shutdown()
    rows, one = metrics(tmp_path / "fsdp_apart"), metrics(tmp_path / "fsdp_together")
    assert rows[2]["actor/grad_norm"] > 0
    for step in (1, 2):
        for key in KEYS:
            assert rows[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-7), (
                step, key,
            )  # fmt: skip


TESTS = Path(__file__).resolve().parents[1]
AGENT = (
    "model.tiny={hidden_size: 32, num_layers: 2, num_heads: 2, max_positions: 256}",
    "data.task={name: calc, digits: 2, num_train: 64, num_val: 4}",
    "data.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
    "rollout.max_response_tokens=64", "rollout.workflow=agent",
    f"rollout.agent={TESTS}/serve_agents.py:two_calls_saying_where", "rollout.agent_timeout_s=30",
    "reward.failure_value=-1.0", "serve.describe_tools=false", "rollout.tool_parser=tag",
)  # fmt: skip


def test_the_agent_workflow_s_server_and_episodes_run_on_the_rollout_pool_s_node(two_nodes):
    """The agent workflow, max_staleness 1, the actor on node A and the rollout pool on node B:
    the loop actor on node B runs the run's OpenAI-compatible server (127.0.0.1 there) and the
    episodes, whose every call reaches it (the agent says where it ran: node B); each
    episode's two calls train as one sample, whose recorded log-probs are the training
    forward's at step 1 (the weights that sampled them); node B never opens the run directory,
    and no weight passes the driver."""
    trained = []
    cfg = config(two_nodes.driver_only, "agent", 2, *AGENT, "rollout.max_staleness=1",
                 *PINNED)  # fmt: skip
    trainer = Trainer(cfg)
    prepare = trainer.policy.prepare

    def keep(batch, timer=None):
        trained.append(batch)
        return prepare(batch, timer)

    trainer.policy.prepare = keep
    try:
        assert two_nodes.node_of(trainer.policy.rollout_pool) == [two_nodes.b]
        trainer.fit()
        generated = trainer.policy.rollout_pool.generated()
    finally:
        trainer.shutdown()
    rows = metrics(two_nodes.driver_only / "agent")
    for step in (1, 2):
        assert rows[step]["rollout/agent/on_node_b"] == 1.0, rows[step]
        assert rows[step]["rollout/agent/failures"] == 0.0
        assert rows[step]["rollout/agent/calls/mean"] == 2.0
        assert rows[step]["weights/bytes_via_driver"] == 0.0
        assert rows[step]["weights/bytes_between_nodes"] > 0  # each version to node B
    assert generated == [2 * 4 * 2]  # steps × episodes × calls, all on node B's worker
    assert len(trained) == 2 and all(len(b) == 4 for b in trained)
    assert rows[1]["rollout/agent/samples_per_episode"] == 1.0
    # step 1 trains version 0, the actor's weights: the ratio of its forward to the recorded
    # log-probs (which serve as the old ones) is 1 on every token
    assert rows[1]["actor/ratio_max"] == pytest.approx(1.0, abs=1e-5), rows[1]
    assert rows[1]["actor/ratio_min"] == pytest.approx(1.0, abs=1e-5), rows[1]
    for batch in trained:
        assert batch["response_mask"].sum(1).min() > 0


def _diffusion_config(out, name, model_dir, prompts, *extra):
    return load_config(None, [
        f"run.output_dir={out}", f"run.name={name}", "run.seed=0", "run.total_steps=2",
        "run.loggers=[]", "run.num_threads=1", "run.samples_every=1",
        f"diffusion={{model: {{kind: tiny, path: {model_dir}}}, num_steps: 3, "
        "timestep_fraction: 0.67, eval_samples_per_prompt: 2}",
        f"data.train_files=[{prompts}]", "data.prompts_per_step=2", "rollout.samples_per_prompt=3",
        "validation.every_steps=1", "actor.lr=1e-3", "reward.functions=[{name: brightness}]",
        *extra,
    ])  # fmt: skip


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_diffusion_rollout_pool_on_node_b_gives_the_one_process_run(
    two_nodes, tmp_path, staleness
):
    """A diffusion policy (the tiny flow model, read from storage both nodes see) with the actor
    on node A and the rollout pool on node B: synchronously (the collective transport across
    nodes) and with max_staleness 1 (the loop actor on node B, Ray's object store). Every
    training trajectory is drawn on node B, node B never opens the run directory, no weight passes the driver, and the samples and numbers are the
    one-process run's."""
    from groupflow.diffusion.models import TinyFlowModel, save_tiny_model
    from groupflow.diffusion.pretrain import COLORS

    torch.manual_seed(0)
    model_dir = tmp_path / "tiny-flow"
    save_tiny_model(TinyFlowModel(list(COLORS), image_size=8, width=8), model_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": c}) + "\n" for c in ("red", "blue", "green")))
    k = f"rollout.max_staleness={staleness}"
    local = _diffusion_config(tmp_path, "local", model_dir, prompts, k)
    trainer = Trainer(local)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    apart = _diffusion_config(two_nodes.driver_only, f"diffusion{staleness}", model_dir, prompts,
                              k, *PINNED)  # fmt: skip
    trainer = Trainer(apart)
    try:
        assert two_nodes.node_of(trainer.policy.rollout_pool) == [two_nodes.b]
        assert trainer.policy.transport.name == ("ray" if staleness else "collective")
        trainer.fit()
        generated = trainer.policy.rollout_pool.generated()
    finally:
        trainer.shutdown()
    run_dir = two_nodes.driver_only / f"diffusion{staleness}"
    rows, one = metrics(run_dir), metrics(tmp_path / "local")
    train = 2 * 2 * 3  # steps × prompts × samples per prompt
    assert generated == [train], generated  # every training trajectory, drawn on node B
    assert samples(run_dir) == samples(tmp_path / "local")
    between = [rows[step]["weights/bytes_between_nodes"] for step in (1, 2)]
    assert between[0] > 0 and between == [between[0]] * 2  # one version to node B per step
    for step in (1, 2):
        assert rows[step]["weights/bytes_via_driver"] == 0.0
        for key in ("reward/mean", "actor/grad_norm", "val/reward/mean"):
            assert rows[step][key] == pytest.approx(one[step][key], rel=1e-5), (step, key)


def test_node_b_dying_mid_run_is_named_and_a_fresh_node_b_resumes_exactly(two_nodes, apart_run):
    """max_staleness 1, the rollout pool (and the asynchronous loop) on node B. After step 2 (a
    checkpoint; a batch in flight) node B's raylet and workers are killed: the next step fails
    within a bounded time with an error naming the role, the rank, the step, the policy version
    and node B. A fresh node B with the same resources, run.resume=auto: the uninterrupted run's
    metrics, exactly. Runs last: it replaces node B."""
    import threading
    import time

    from groupflow.distributed import WorkerError
    from groupflow.rollout.hosts import RolloutError

    full_dir, _ = apart_run(1)
    args = (*APART[1], *PINNED, "run.worker_timeout_s=60")
    # more steps than it lives (the LR is constant: total_steps changes nothing trained)
    trainer = Trainer(config(two_nodes.driver_only, "crash", 6, *args))
    marker = two_nodes.driver_only / "crash" / "checkpoints" / "step_2" / "manifest.json"
    dead, killed_at = two_nodes.b, []

    def kill_once_saved():
        while not marker.is_file():
            time.sleep(0.02)
        two_nodes.kill_b()
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_once_saved, daemon=True)
    killer.start()
    try:
        with pytest.raises((RolloutError, WorkerError)) as err:
            trainer.fit()
        took = time.monotonic() - killed_at[0]
    finally:
        trainer.shutdown()
    text = f"{err.value} {' '.join(getattr(err.value, '__notes__', []))}"
    assert took < 60, took  # Ray notices the dead node; no wait for run.worker_timeout_s
    assert "(rollout role) rank 0" in text and "Ray actor died" in text, text
    # the steps and versions in flight when it died, from the driver's records (what the actor
    # last reported may be stale: it is said so). After the step-2 checkpoint the batches of
    # steps 2 and 3 are in flight, or 3 (and 4) if the driver took step 2's in time; each has
    # its scheduled version, step - max_staleness
    flight = re.search(r"batches in flight: ((?:step \d+ \(policy version \d+\)(?:, )?)+)", text)
    assert flight, text
    jobs = [tuple(map(int, j)) for j in re.findall(r"step (\d+) \(policy version (\d+)\)",
                                                   flight[1])]  # fmt: skip
    assert jobs and all(v == t - 1 and 2 <= t <= 4 for t, v in jobs), jobs
    assert 3 in {t for t, _ in jobs}, jobs  # step 3's job was submitted before the checkpoint
    assert f"it ran on node {dead} (" in text, text  # ", now dead" once Ray has noticed
    # the premise: the run died between its step-2 checkpoint and the next one
    saved = sorted(p.name for p in (two_nodes.driver_only / "crash" / "checkpoints").iterdir())
    assert [p for p in saved if p.startswith("step_")] == ["step_2"], saved
    two_nodes.start_b()
    trainer = Trainer(config(two_nodes.driver_only, "crash", 3, *args))
    try:
        assert two_nodes.node_of(trainer.policy.rollout_pool) == [two_nodes.b] != [dead]
        trainer.fit()
    finally:
        trainer.shutdown()
    full, resumed = metrics(full_dir), metrics(two_nodes.driver_only / "crash")
    # the killed run may have logged a step past its checkpoint (a batch was in flight); the
    # resumed run's rows come after its own and so win for the steps it ran again
    assert {1, 2, 3} <= set(resumed)
    lines = (two_nodes.driver_only / "crash" / "metrics.jsonl").read_text().splitlines()
    trained = [json.loads(x)["step"] for x in lines if "reward/mean" in json.loads(x)]
    assert trained[-1] == 3 and trained.count(3) >= 1  # the resumed run's step is the last row
    for s in (1, 2, 3):  # what is trained, not how fast
        keys = {k for k in full[s].keys() | resumed[s].keys() if not k.startswith(NOT_TRAINED)}
        differ = sorted(k for k in keys if full[s].get(k) != resumed[s].get(k))
        assert not differ, (s, differ)
