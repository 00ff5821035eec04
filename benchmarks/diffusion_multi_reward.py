"""Weighted sum vs per-reward group normalisation on examples/diffusion_two_rewards.yaml: each
reward's eval mean (fixed prompts and noise, ODE sampler) before and after training, and each
trained reward's mean share of the within-group signal, per seed, side by side.

One torch thread; the runs go one after another in this process.

    .venv/bin/python benchmarks/diffusion_multi_reward.py --steps 80 --seeds 0 1
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
    from groupflow.tracking import read_metrics
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--json", type=Path)
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
    print(f"\n| reward.normalize | seed | sky (×100) before → after {args.steps} steps | "
          "compressibility | sky_pixel (monitor) | mean share sky / compressibility | "
          "training time |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in results:
        cells = [f"{r[n][0]:.3f} → {r[n][1]:.3f}" for n in REWARDS]
        print(f"| {r['mode']} | {r['seed']} | {' | '.join(cells)} | "
              f"{r['sky_share']:.2f} / {r['compressibility_share']:.2f} | "
              f"{r['train_seconds']:.0f} s |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
