"""The diffusion algorithm switches side by side on the tiny demo: eval reward after N steps and
the step at which 80 % of the gap to the optimum (reward 1) was closed, per seed.

Each variant is examples/diffusion_demo.yaml with one switch flipped (hyperparameters otherwise
the demo's, untuned per variant), trained for ``--steps`` steps with the fixed-noise ODE eval
every ``--eval-every`` steps, one torch thread, runs one after another in this process.

    .venv/bin/python benchmarks/diffusion_algorithms.py --steps 40 --seeds 0 1 2

``--results PATH`` writes the table's rows as a results file (groupflow.utils.results), the file
the docs render (``benchmarks/results/diffusion_algorithms.json`` is ``--steps 80``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "flow_grpo": {},
    "cps": {"diffusion.sampler": "cps"},
    "mixgrpo": {"diffusion.sde_window": {"size": 4, "shift_interval": 10, "stride": 1}},
    "grpo_guard": {"diffusion.ratio_norm": True},
    "nft": {"diffusion.objective": "nft", "diffusion.sampler": "ode",
            "diffusion.same_noise_per_group": False},
    # with one optimizer step per batch (the demo's) every ratio is 1: Flow-DPPO's mask and the
    # PPO clip never act, and flow_dppo equals flow_grpo; they differ with several epochs
    "flow_dppo": {"diffusion.objective": "flow_dppo"},
    "flow_grpo_mu4": {"actor.ppo_epochs": 4},
    "flow_dppo_mu4": {"diffusion.objective": "flow_dppo", "actor.ppo_epochs": 4},
    "awm": {"diffusion.objective": "awm", "diffusion.sampler": "ode",
            "diffusion.same_noise_per_group": False},
}  # fmt: skip


def run(variant: str, seed: int, steps: int, every: int, out: Path) -> dict:
    from groupflow.config import apply_overrides, config_from_dict
    from groupflow.run.tracking import read_metrics
    from groupflow.trainer import Trainer

    data = yaml.safe_load((ROOT / "examples" / "diffusion_demo.yaml").read_text())
    data["data"]["train_files"] = [str(ROOT / f) for f in data["data"]["train_files"]]
    data["data"]["val_files"] = [str(ROOT / f) for f in data["data"]["val_files"]]
    data["diffusion"]["model"]["path"] = str(ROOT / data["diffusion"]["model"]["path"])
    over = dict(VARIANTS[variant])
    if "diffusion.sde_window" in over:
        del data["diffusion"]["timestep_fraction"]  # the window decides the trained steps
    over.update({
        "run.name": f"{variant}-{seed}", "run.output_dir": str(out), "run.seed": seed,
        "run.total_steps": steps, "run.loggers": [], "run.console_every": 10**6,
        "validation.every_steps": every, "diffusion.save_images": False, "run.save_final": False,
    })  # fmt: skip
    trainer = Trainer(config_from_dict(apply_overrides(data, over)))
    trainer.fit()
    rows = read_metrics(trainer.run_dir / "metrics.jsonl")
    evals = [(r["step"], r["val/reward/mean"]) for r in rows if "val/reward/mean" in r]
    before, after = evals[0][1], evals[-1][1]
    target = before + 0.8 * (1.0 - before)
    reached = next((int(s) for s, v in evals if v >= target), None)
    seconds = sum(r.get("time/step", 0.0) for r in rows)
    to_80 = (
        None
        if reached is None
        else sum(r.get("time/step", 0.0) for r in rows if r["step"] <= reached)
    )
    return {"variant": variant, "seed": seed, "before": before, "after": after,
            "gap_closed": (after - before) / (1.0 - before), "reached_80": reached,
            "seconds_to_80": to_80, "train_seconds": seconds, "evals": evals}  # fmt: skip


def label(variant: str) -> str:
    """A variant's name in the table: ``flow_grpo_mu4`` is ``flow_grpo, 4 epochs``."""
    return variant.replace("_mu4", ", 4 epochs")


def table_rows(results: list[dict], steps: int) -> list[dict]:
    """The printed table's rows, one dict per variant and seed (the results file's rows)."""
    rows = []
    for r in results:
        at = (f"{r['reached_80']} ({r['seconds_to_80']:.0f} s)" if r["reached_80"] is not None
              else f"not by {steps}")  # fmt: skip
        rows.append({"variant": label(r["variant"]), "seed": str(r["seed"]),
                     f"eval reward before → after {steps} steps":
                         f"{r['before']:.3f} → {r['after']:.3f}",
                     "gap closed": f"{100 * r['gap_closed']:.0f} %",
                     "80 % of the gap at step (training time to it)": at,
                     "training time": f"{r['train_seconds']:.0f} s"})  # fmt: skip
    return rows


def write_variant_results(path: Path, results: list[dict], args: argparse.Namespace,
                          argv: list[str]) -> Path:  # fmt: skip
    """The measured rows as a results file, with the command that measures them again."""
    import shlex

    from groupflow.utils.results import write_results

    one_step = [r for r in results if not r["variant"].endswith("_mu4")] or results

    def rng(xs: list[float]) -> str:
        lo, hi = f"{min(xs):.2f}", f"{max(xs):.2f}"
        return lo if lo == hi else f"{lo}–{hi}"

    variants = sorted({r["variant"] for r in one_step})
    command = shlex.join(["python", "benchmarks/diffusion_algorithms.py", *argv])
    summary = {"recipe": "benchmarks/diffusion_algorithms.py (examples/diffusion_demo.yaml, one "
                         "switch flipped)",
               "what": f"eval reward, {len(variants)} variants × {len(args.seeds)} seeds",
               "before": rng([r["before"] for r in one_step]),
               "after": rng([r["after"] for r in one_step]),
               "guide": "docs/guides/diffusion.md"}  # fmt: skip
    notes = (f"One torch thread, the runs one after another in one process; eval every "
             f"{args.eval_every} steps, so a gap reached at a step was reached within the "
             f"{args.eval_every} steps before it. Times are sums of step times; the ranges in the "
             "summary leave out the 4-epoch variants.")  # fmt: skip
    return write_results(path, name=path.stem, command=command, rows=table_rows(results, args.steps),
                         summary=summary, notes=notes)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--results", type=Path, help="also write the table as a results file")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants:
            for seed in args.seeds:
                r = run(variant, seed, args.steps, args.eval_every, Path(tmp))
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "evals"}), flush=True)
    print(f"\n| variant | seed | eval reward before → after {args.steps} steps | gap closed | "
          "80 % of the gap at step (training time to it) | training time |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in results:
        at = (f"{r['reached_80']} ({r['seconds_to_80']:.0f} s)" if r["reached_80"] is not None
              else f"not by {args.steps}")  # fmt: skip
        print(f"| {r['variant']} | {r['seed']} | {r['before']:.3f} → {r['after']:.3f} | "
              f"{100 * r['gap_closed']:.0f} % | {at} | {r['train_seconds']:.0f} s |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.results:
        print(f"wrote {write_variant_results(args.results, results, args, argv or sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
