"""Weight sync to a Ray rollout pool: the old path (actor rank 0 → driver → pool) against the Ray
weight transport (rank 0 → Ray object store → pool; the driver forwards a ticket) and the
collective one (every actor rank broadcasts its FSDP2 shard to the pool over gloo), side by side.

Methodology: one Trainer per model on ``run.backend=ray`` with 2 actor workers (FSDP2) and a
rollout pool of 1 worker, one torch thread each. For each of ``--repeats`` rounds the three paths
run back to back (old, ray, collective, old, ...; same machine load), each a full sync of the actor's
current weights into the pool. Per path: the median wall time, the bytes that passed through the
driver (tensor bytes it received or sent), and the peak extra RSS of the driver, of the busiest
actor rank and of the rollout worker (the kernel's high-water mark, reset before each sync after every
process returned its freed heap to the OS). Then, from the
measured seconds per byte, what a sync would cost for 7B and 70B parameters in bf16 — a linear
extrapolation of *this* machine's costs, not a measurement.

``--two-nodes`` adds, per model, the same measurement across two Ray nodes on this machine
(``ray.cluster_utils.Cluster``: the actor pinned to node A, the pool to node B by
``placement.<role>.resources``), so the object store's buckets are copied between the nodes'
stores and the collective's gloo runs between nodes' processes — the cross-node cost of the
transports without the network a real cluster adds (rows ``<model>@2n``).

    .venv/bin/python benchmarks/bench_weights.py [--models medium smollm2] [--repeats 5]
        [--bucket-mb 64] [--two-nodes] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time

MODELS = {
    # bench_async's ~2.7M-parameter Llama shape
    "medium": "{hidden_size: 192, num_layers: 6, num_heads: 4, max_positions: 64}",
    # SmolLM2-135M's body: 30 layers, hidden 576, MLP 1536 (with the tiny character vocabulary and
    # full multi-head attention instead of its 49k vocabulary and 3 KV heads: ~120M parameters)
    "smollm2": "{hidden_size: 576, num_layers: 30, num_heads: 9, intermediate_size: 1536, "
    "max_positions: 64}",
}


def build(model: str, out_dir: str, bucket_mb: float, two_nodes: bool = False):
    from groupflow.config import load_config
    from groupflow.trainer import Trainer

    def pin(node: str) -> str:
        return f", resources: {{node_{node}: 1}}" if two_nodes else ""

    overrides = [
        f"model.tiny={MODELS[model]}",
        "data.task={name: reverse, digits: 4, num_train: 64, num_val: 8}",
        f"run.output_dir={out_dir}", f"run.name={model}", "run.total_steps=1", "run.loggers=[]",
        "run.num_threads=1", "run.resume=never", "run.backend=ray", "run.num_workers=2",
        "run.worker_timeout_s=1200",
        f"placement.actor={{nodes: 1, workers_per_node: 2, cpus_per_worker: 0.5{pin('a')}}}",
        f"placement.rollout={{workers_per_node: 1, cpus_per_worker: 0.5{pin('b')}}}",
        f"rollout.weight_bucket_mb={bucket_mb}", "validation.before_training=false", "sft.steps=0",
        "rollout.weight_transport=collective",
    ]  # fmt: skip
    return Trainer(load_config(None, overrides))


def worker_pids(*groups) -> list[int]:
    """The processes of the groups' Ray actors (each asked for its own pid)."""
    import os

    import ray

    hosts = [h for g in groups for h in g._hosts]
    return ray.get([h.__ray_call__.remote(lambda _self: os.getpid()) for h in hosts])


def _trim() -> None:
    """Return freed heap memory to the OS, so RSS is what is in use (glibc keeps freed pages)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


class PeakRSS:
    """Peak resident memory above the starting point, of this process and of each worker, over
    the block: every process trims its heap, the kernel's high-water mark (VmHWM) is reset through
    ``/proc/<pid>/clear_refs``, and read back at the end — no sampling, no missed peak."""

    def __init__(self, groups):
        import os

        self.groups, self.me = groups, os.getpid()
        self.pids = [self.me, *worker_pids(*groups)]

    def __enter__(self):
        import ray

        _trim()
        hosts = [h for g in self.groups for h in g._hosts]
        ray.get([h.__ray_call__.remote(lambda _self: _trim()) for h in hosts])
        self.base = []
        for pid in self.pids:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")  # reset the peak to the current RSS
            self.base.append(_status_kb(pid, "VmRSS"))
        return self

    def __exit__(self, *exc):
        extra = [(_status_kb(pid, "VmHWM") - b) * 1024 for pid, b in zip(self.pids, self.base)]
        n_actor = len(self.groups[0]._hosts)
        self.driver_extra = extra[0]
        self.actor_extra = max(extra[1 : 1 + n_actor])  # the largest over the actor's ranks
        self.rollout_extra = max(extra[1 + n_actor :])  # over the rollout pool's workers


def old_path(policy, version: int) -> int:
    """What LLMPolicy.sync did before issue 21: gather to rank 0, return to the driver, push."""
    weights = policy.actor.full_weights()
    policy.rollout.load_weights(weights)
    return sum(t.numel() * t.element_size() for t in weights.values())


def ray_path(policy, version: int) -> int:
    """The ``ray`` transport: rank 0 puts the buckets into the object store, the pool fetches."""
    return policy._transfer(policy.rollout.receive_weights, version, policy.side_transport)


def collective_path(policy, version: int) -> int:
    """The ``collective`` transport: each actor rank broadcasts its shard while the pool receives."""
    return policy._transfer(policy.rollout.receive_weights, version, policy.transport)


PATHS = {"old": old_path, "ray": ray_path, "collective": collective_path}


@contextlib.contextmanager
def cluster(two_nodes: bool):
    """Two Ray nodes on this machine (node_a, node_b) for the cross-node rows; else nothing (the
    Trainer starts its local instance)."""
    if not two_nodes:
        yield
        return
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    one = {"OMP_NUM_THREADS": "1"}
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "resources": {"node_a": 9},
                                                      "include_dashboard": False, "env_vars": one})  # fmt: skip
    try:
        c.add_node(num_cpus=3, resources={"node_b": 9}, env_vars=one)
        c.wait_for_nodes()
        ray.init(address=c.address, include_dashboard=False)
        yield
    finally:
        ray.shutdown()
        c.shutdown()


def measure(model: str, repeats: int, bucket_mb: float, two_nodes: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as out, cluster(two_nodes):
        trainer = build(model, out, bucket_mb, two_nodes)
        try:
            policy = trainer.policy
            assert policy.transport.name == "collective", policy.transport
            assert policy.side_transport.name == "ray", policy.side_transport
            nbytes = sum(t.numel() * t.element_size() for t in policy.snapshot().values())
            groups = (policy.actor, policy.rollout_pool)
            rows = {name: [] for name in PATHS}
            for r in range(repeats + 1):  # the first round warms every path up, not counted
                for name, fn in PATHS.items():
                    with PeakRSS(groups) as mem:
                        start = time.perf_counter()
                        via_driver = fn(policy, r)
                        seconds = time.perf_counter() - start
                    if r:
                        rows[name].append((seconds, via_driver, mem.driver_extra,
                                           mem.actor_extra, mem.rollout_extra))  # fmt: skip
        finally:
            trainer.shutdown()
    out = {"model": f"{model}@2n" if two_nodes else model, "bytes": nbytes}
    for name, rs in rows.items():
        out[name] = {
            "seconds": statistics.median(r[0] for r in rs),
            "bytes_via_driver": rs[0][1],
            "driver_peak_extra_mb": max(r[2] for r in rs) / 2**20,
            "actor_rank_peak_extra_mb": max(r[3] for r in rs) / 2**20,
            "rollout_worker_peak_extra_mb": max(r[4] for r in rs) / 2**20,
        }
    return out


def report(results: list[dict]) -> None:
    print(f"{'model':<10}{'MB':>8}  {'path':<11}{'s':>8}{'ratio':>7}{'via driver MB':>15}"
          f"{'driver +MB':>12}{'actor +MB':>11}{'rollout +MB':>13}")  # fmt: skip
    for r in results:
        for name in PATHS:
            p = r[name]
            ratio = p["seconds"] / r["old"]["seconds"]
            print(f"{r['model']:<10}{r['bytes'] / 2**20:>8.1f}  {name:<11}{p['seconds']:>8.3f}"
                  f"{ratio:>7.2f}{p['bytes_via_driver'] / 2**20:>15.1f}"
                  f"{p['driver_peak_extra_mb']:>12.1f}{p['actor_rank_peak_extra_mb']:>11.1f}"
                  f"{p['rollout_worker_peak_extra_mb']:>13.1f}")  # fmt: skip
    big = max((r for r in results if "@" not in r["model"]), key=lambda r: r["bytes"])
    print(f"\nextrapolated from {big['model']}'s seconds per byte (this machine, linear):")
    for label, params in (("7B", 7e9), ("70B", 70e9)):
        nbytes = params * 2  # bf16
        cost = {n: big[n]["seconds"] / big["bytes"] * nbytes for n in PATHS}
        print(f"  {label} bf16 ({nbytes / 1e9:.0f} GB): old {cost['old']:.0f} s, ray "
              f"{cost['ray']:.0f} s, collective {cost['collective']:.0f} s per sync; driver "
              f"holds {nbytes / 1e9:.0f} GB (old) vs 0 (ray, collective)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--two-nodes", action="store_true", help="also across two Ray nodes")
    p.add_argument("--json", default=None)
    p.add_argument("--results", help="also write the measured rows to this results file (JSON)")
    args = p.parse_args()
    results = [measure(m, args.repeats, args.bucket_mb) for m in args.models]
    if args.two_nodes:
        import ray

        ray.shutdown()  # the one-node rows' local instance: one cluster at a time
        results += [measure(m, args.repeats, args.bucket_mb, True) for m in args.models]
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.results:
        write_weight_results(args, results)


def weight_rows(results: list[dict]) -> list[dict]:
    """One row per model and path, in the columns of ``benchmarks/results/weights.json``."""
    rows = []
    for r in results:
        for name in PATHS:
            p = r[name]
            rows.append({
                "model (fp32)": f"{r['model']} ({r['bytes'] / 2**20:.1f} MB)",
                "path": name,
                "s / sync": round(p["seconds"], 3),
                "ratio": round(p["seconds"] / r["old"]["seconds"], 2),
                "bytes via driver": f"{p['bytes_via_driver'] / 2**20:.1f} MB"
                if p["bytes_via_driver"] else "0",
                "driver +MB": round(p["driver_peak_extra_mb"], 1),
                "busiest actor rank +MB": round(p["actor_rank_peak_extra_mb"], 1),
                "rollout worker +MB": round(p["rollout_worker_peak_extra_mb"], 1),
            })  # fmt: skip
    return rows


def write_weight_results(args, results: list[dict]) -> None:
    import os
    import sys

    from groupflow.utils.results import write_results

    first = results[0]
    best = min(PATHS, key=lambda n: first[n]["seconds"])
    write_results(
        args.results,
        name=os.path.splitext(os.path.basename(args.results))[0],
        command="python benchmarks/bench_weights.py " + " ".join(sys.argv[1:]),
        rows=weight_rows(results),
        summary={
            "recipe": "benchmarks/bench_weights.py: 2 FSDP2 actor ranks → 1 rollout worker (Ray)",
            "what": "seconds and peak memory per weight sync: old driver path, ray, collective",
            "before": f"old {first['old']['seconds']:.3f} s / sync ({first['model']})",
            "after": f"{best} {first[best]['seconds']:.3f} s / sync",
            "guide": "docs/benchmarks/backends-weights.md",
        },
        notes=f"median of {args.repeats} rounds after one warm-up, {args.bucket_mb:g} MiB buckets; "
        "memory is the peak RSS (VmHWM) above the start, per process. "
        "A model tagged @2n ran with the actor on node A and the pool on node B.",
    )


if __name__ == "__main__":
    main()
