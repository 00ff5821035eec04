"""Weighted sum vs per-reward group normalisation on examples/diffusion_two_rewards.yaml: each
reward's eval mean (fixed prompts and noise, ODE sampler) before and after training, and each
trained reward's mean share of the within-group signal, per seed, side by side.

One torch thread; the runs go one after another in this process.

    .venv/bin/python benchmarks/diffusion_multi_reward.py --steps 80 --seeds 0 1 2 \
        --results examples/results/diffusion_two_rewards.json

``--results`` writes the table as a results file (``groupflow.utils.results``), which
docs/guides/data-rewards.md and the README's results table are rendered from.
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
CONFIG = ROOT / "examples" / "diffusion_two_rewards.yaml"
REWARDS = ("sky", "compressibility", "sky_pixel")


def run(mode: str, seed: int, steps: int, every: int, out: Path) -> dict:
    from groupflow.config import apply_overrides, config_from_dict
    from groupflow.run.tracking import read_metrics
    from groupflow.trainer import Trainer

    data = yaml.safe_load(CONFIG.read_text())
    data["data"]["train_files"] = [str(ROOT / f) for f in data["data"]["train_files"]]
    data["data"]["val_files"] = [str(ROOT / f) for f in data["data"]["val_files"]]
    data["diffusion"]["model"]["path"] = str(ROOT / data["diffusion"]["model"]["path"])
    for f in data["reward"]["functions"]:
        if "function" in f:
            f["function"] = str(ROOT / f["function"])
    over = {
        "reward.normalize": mode, "run.name": f"{mode}-{seed}", "run.output_dir": str(out),
        "run.seed": seed, "run.total_steps": steps, "run.loggers": [],
        "run.console_every": 10**6, "validation.every_steps": every,
        "diffusion.save_images": False, "run.save_final": False,
    }  # fmt: skip
    trainer = Trainer(config_from_dict(apply_overrides(data, over)))
    trainer.fit()
    rows = read_metrics(trainer.run_dir / "metrics.jsonl")
    evals = [r for r in rows if "val/reward/sky/mean" in r]
    train = [r for r in rows if "reward/sky/share" in r]
    result = {"mode": mode, "seed": seed}
    for name in REWARDS:
        result[name] = (evals[0][f"val/reward/{name}/mean"], evals[-1][f"val/reward/{name}/mean"])
    for name in REWARDS[:2]:
        result[f"{name}_share"] = sum(r[f"reward/{name}/share"] for r in train) / len(train)
    result["train_seconds"] = sum(r.get("time/step", 0.0) for r in rows)
    return result


def _row(r: dict, steps: int) -> dict[str, str]:
    cells = {f"{n} before → after {steps} steps": f"{r[n][0]:.3f} → {r[n][1]:.3f}" for n in REWARDS}
    return {"reward.normalize": r["mode"], "seed": str(r["seed"]), **cells,
            "mean share sky / compressibility":
                f"{r['sky_share']:.2f} / {r['compressibility_share']:.2f}",
            "training time": f"{r['train_seconds']:.0f} s"}  # fmt: skip


def _write(args, results: list[dict], rows: list[dict]) -> None:
    from groupflow.utils.results import write_results

    def span(mode: str, name: str, at: int) -> str:
        values = [r[name][at] for r in results if r["mode"] == mode]
        return f"{min(values):.2f}–{max(values):.2f}"

    write_results(
        args.results, name="diffusion_two_rewards", rows=rows,
        command="python benchmarks/diffusion_multi_reward.py "
                f"--steps {args.steps} --seeds {' '.join(map(str, args.seeds))} --results {args.results}",
        summary={
            "recipe": "examples/diffusion_two_rewards.yaml (sky ×100 + compressibility)",
            "what": "eval compressibility, weighted sum vs normalize: group",
            "before": span("none", "compressibility", 0),
            "after": f"{span('none', 'compressibility', 1)} vs {span('group', 'compressibility', 1)}",
            "guide": "docs/guides/data-rewards.md",
        },
    )  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--results", type=Path, help="write a results file (groupflow.utils.results)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for mode in ("none", "group"):
                results.append(run(mode, seed, args.steps, args.eval_every, Path(tmp)))
                print(json.dumps(results[-1]), flush=True)
    rows = [_row(r, args.steps) for r in results]
    print("\n| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(row.values()) + " |")
    if args.results:
        _write(args, results, rows)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
