"""Reproduce a recipe's result and record it: train an example config for each seed (and, with
``--control``, once with shuffled advantages), read the held-out metric before and after from each
run's metrics.jsonl, and write ``examples/results/<config name>.json`` — the file the docs and the
README's results table are rendered from (groupflow.utils.results).

    python scripts/reproduce.py examples/reverse_demo.yaml --seeds 0 1 2 --control

Each run is a fresh ``groupflow train`` process (``run.overwrite=true``) under runs/reproduce/.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from groupflow.utils.results import write_results  # noqa: E402


def _metric(run_dir: Path, metric: str) -> tuple[float, float]:
    """The metric's first and last logged values (before training, after the last step)."""
    values = [row[metric] for row in map(json.loads, (run_dir / "metrics.jsonl").open())
              if metric in row]  # fmt: skip
    if len(values) < 2:
        raise SystemExit(f"{run_dir}/metrics.jsonl: {metric!r} is logged {len(values)} time(s)")
    return values[0], values[-1]


def _train(config: Path, name: str, overrides: list[str], threads: int) -> float:
    argv = [str(ROOT / ".venv/bin/groupflow"), "train", str(config), f"run.name={name}",
            "run.output_dir=runs/reproduce", "run.overwrite=true", f"run.num_threads={threads}",
            "--no-plot", *overrides]  # fmt: skip
    print("+", shlex.join(argv), flush=True)
    start = time.monotonic()
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", type=Path)
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--control", action="store_true", help="also seed 0 with shuffled advantages")
    p.add_argument("--metric", default="val/greedy/acc")
    p.add_argument("--what", default="held-out greedy exact match")
    p.add_argument("--guide", default="", help="the docs page that explains the recipe")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="default: examples/results/NAME.json")
    args = p.parse_args(argv)
    config = args.config.resolve()
    stem = config.stem
    runs = [(f"seed {s}", f"{stem}-seed{s}", [f"run.seed={s}"]) for s in args.seeds]
    if args.control:
        runs.append(("control (shuffled advantages)", f"{stem}-control",
                     ["run.seed=0", "algorithm.shuffle_advantages=true"]))  # fmt: skip
    rows = []
    for label, name, extra in runs:
        seconds = _train(config, name, [*args.overrides, *extra], args.threads)
        before, after = _metric(ROOT / "runs/reproduce" / name, args.metric)
        rows.append({"run": label, f"{args.metric} before": round(before, 4),
                     f"{args.metric} after": round(after, 4), "seconds": round(seconds)})  # fmt: skip
        print(rows[-1], flush=True)
    trained = [r for r in rows if r["run"].startswith("seed")]
    lo = min(r[f"{args.metric} before"] for r in trained)
    hi = max(r[f"{args.metric} before"] for r in trained)
    lo2 = min(r[f"{args.metric} after"] for r in trained)
    hi2 = max(r[f"{args.metric} after"] for r in trained)
    pct = lambda a, b: f"{100 * a:.0f} %" if a == b else f"{100 * a:.0f}–{100 * b:.0f} %"  # noqa: E731
    rel = config.relative_to(ROOT) if config.is_relative_to(ROOT) else config
    command = shlex.join(["python", "scripts/reproduce.py", str(rel), *(argv or sys.argv[1:])[1:]])
    summary = {"recipe": str(rel), "what": f"{args.what}, {len(trained)} seed(s)",
               "before": pct(lo, hi), "after": pct(lo2, hi2), "guide": args.guide}  # fmt: skip
    out = args.out or ROOT / "examples" / "results" / f"{stem}.json"
    write_results(out, name=stem, command=command, rows=rows, summary=summary)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
