"""``groupflow train``: a run from a config file, then a summary and plots.

Design decision: the command is the Python API's ``Run`` (``groupflow.Run``), looked up on the
module at call time, so a CLI run and a notebook run are one code path; this module adds only
what a terminal wants at the end (the before/after accuracy or reward, the plots).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from groupflow import api
from groupflow.cli.plotting import plot_run
from groupflow.run.tracking import read_metrics

__all__ = ["train"]


def train(args: argparse.Namespace) -> int:
    with api.Run(args.config, overrides=args.overrides) as run:  # the workers stop before plotting
        final = run.fit()
    _print_summary(run.run_dir, final)
    if args.plot:
        paths = plot_run(run.run_dir)
        print(f"plots: {', '.join(str(p) for p in paths)}")
    return 0


def _print_summary(run_dir: Path, final: dict) -> None:
    rows = read_metrics(run_dir / "metrics.jsonl")
    key = "val/greedy/acc"
    before = next((r[key] for r in rows if r.get(key) is not None), None)
    after = next((r[key] for r in reversed(rows) if r.get(key) is not None), None)
    print(f"run directory: {run_dir}")
    if before is not None and after is not None:
        print(
            f"held-out greedy accuracy: before {before:.1%} → after {after:.1%} ({(after - before) * 100:+.1f} points)"
        )
    key = "val/reward/mean"  # the diffusion policy's online test (fixed prompts and noise, ODE)
    before = next((r[key] for r in rows if r.get(key) is not None), None)
    after = next((r[key] for r in reversed(rows) if r.get(key) is not None), None)
    if before is not None and after is not None:
        print(f"eval reward (fixed prompts and noise): before {before:.4f} → after {after:.4f}")
