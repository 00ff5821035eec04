"""Per-step overhead of the Ray backend (1 worker) against the embedded local backend.

Methodology: two trainers on the same config and seed — one with ``run.backend=local`` (the worker
lives in this process), one with ``run.backend=ray`` (the worker is a Ray actor) — are built once,
then their training steps are interleaved (local, ray, local, ray, ...) so that both see the same
machine load. The first step of each is discarded (warm-up); the median step time of each, their
ratio and the overhead in percent are printed. Both use one torch thread, so the comparison is
between the same computation with and without the remote-call and serialisation layer.

    .venv/bin/python benchmarks/bench_backends.py [--steps 12] [--prompts 16] [--samples 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def build(backend: str, out_dir: str, prompts: int, samples: int, steps: int):
    from groupflow.config import load_config
    from groupflow.trainer import Trainer

    overrides = [
        f"run.output_dir={out_dir}",
        f"run.name={backend}",
        f"run.backend={backend}",
        f"run.total_steps={steps}",
        "run.loggers=[]",
        "run.num_threads=1",
        "run.resume=never",
        f"data.prompts_per_step={prompts}",
        f"rollout.samples_per_prompt={samples}",
        "validation.before_training=false",
        "sft.steps=0",
    ]
    return Trainer(load_config("examples/reverse_demo.yaml", overrides))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--results", help="also write the measured rows to this results file (JSON)")
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        trainers = {
            b: build(b, out, args.prompts, args.samples, args.steps + 1) for b in ("local", "ray")
        }
        times: dict[str, list[float]] = {b: [] for b in trainers}
        for _ in range(args.steps + 1):
            for backend, trainer in trainers.items():
                start = time.perf_counter()
                trainer.train_step()
                times[backend].append(time.perf_counter() - start)
        trainers["ray"].shutdown()
    local = statistics.median(times["local"][1:])
    ray = statistics.median(times["ray"][1:])
    print(
        f"steps: {args.steps} (after 1 warm-up), {args.prompts} prompts x {args.samples} samples per step"
    )
    print(f"{'backend':<10}{'median s/step':>15}{'min':>10}{'max':>10}")
    for b in ("local", "ray"):
        t = times[b][1:]
        print(f"{b:<10}{statistics.median(t):>15.4f}{min(t):>10.4f}{max(t):>10.4f}")
    print(
        f"ray / local = {ray / local:.3f}  (overhead {100 * (ray / local - 1):+.1f} %; target <= +10 %)"
    )
    if args.results:
        write_backend_results(args, local, ray)


def write_backend_results(args, local: float, ray: float) -> None:
    """The two medians and their ratio as a results file (the docs render its table)."""
    import sys

    from groupflow.utils.results import write_results

    rows = [
        {"backend": "local", "s/step": round(local, 3), "ratio to local": 1.0},
        {"backend": "ray (1 worker)", "s/step": round(ray, 3), "ratio to local": round(ray / local, 3)},
    ]  # fmt: skip
    write_results(
        args.results,
        name="backends",
        command="python benchmarks/bench_backends.py " + " ".join(sys.argv[1:]),
        rows=rows,
        summary={
            "recipe": "benchmarks/bench_backends.py: the reverse demo, 1 worker",
            "what": "median s/step, run.backend=ray against run.backend=local",
            "before": f"local {local:.3f} s/step",
            "after": f"ray {ray:.3f} s/step ({100 * (ray / local - 1):+.1f} %)",
            "guide": "docs/benchmarks/backends-weights.md",
        },
        notes=f"{args.prompts} prompts × {args.samples} samples per step, median of {args.steps} "
        "interleaved steps after one warm-up, one torch thread each. Target: Ray overhead ≤ 10 %.",
    )


if __name__ == "__main__":
    main()
