"""PNG curves of a run from its ``metrics.jsonl``: one file per panel plus an overview grid.

Design decision: panels are declared as data (a title plus metric-name glob patterns) and a panel
is drawn only if some logged key matches, so the same code plots LLM and diffusion runs, old runs
with fewer metrics, and runs still in progress. Rendering uses matplotlib's object API on an Agg
canvas rather than ``pyplot``, so no display is needed and the caller's global matplotlib backend is
left untouched. Noisy RL curves get a trailing moving average over the faint raw curve.

Several runs (seeds, a control, two algorithms) are compared with :func:`plot_runs`: one panel per
metric, one colour per run, the runs' directory names as labels — the figure a results table
cites, drawn from the same JSONL files. ``groupflow plot`` is :func:`plot_command`.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from groupflow.run.tracking import METRICS_FILE, read_metrics

__all__ = ["COMPARE_METRICS", "PANELS", "Panel", "plot_command", "plot_run", "plot_runs"]

# Below this many points a curve is drawn raw with markers; above it, raw (faint) plus smoothed.
_SMOOTH_MIN_POINTS = 20


@dataclass(frozen=True)
class Panel:
    """One plot: the keys matching ``include`` (and no ``exclude`` pattern), saved as ``<name>.png``."""

    name: str
    title: str
    include: tuple[str, ...]
    exclude: tuple[str, ...] = ()

    def keys(self, available: Sequence[str]) -> list[str]:
        chosen: list[str] = []
        for pattern in self.include:  # pattern order first, so "reward/mean" leads its panel
            for key in sorted(available):
                excluded = any(fnmatchcase(key, ex) for ex in self.exclude)
                if fnmatchcase(key, pattern) and not excluded and key not in chosen:
                    chosen.append(key)
        return chosen


# Spread/count statistics would squash the reward curves they share an axis with.
_NOT_A_REWARD = (
    "*std*",
    "*/min",
    "*/max",
    "*fail*",
    "*count*",
    "*num*",
    "*frac*",
    "*ratio*",
    "*all_none*",
)

PANELS: tuple[Panel, ...] = (
    Panel("reward", "Reward (mean and components)", ("reward/mean", "reward/*"), _NOT_A_REWARD),
    Panel("accuracy", "Accuracy (train and validation)", ("acc/*", "val/*acc*")),
    # the diffusion policy's online test (fixed prompts and noise): logged before the first step
    # too, so a run of 0 steps plots it, as an LLM run plots its validation accuracy
    Panel(
        "val_reward",
        "Validation reward (fixed prompts)",
        ("val/reward/mean", "val/reward/*"),
        _NOT_A_REWARD,
    ),
    Panel("kl", "KL to reference", ("actor/kl*",)),
    Panel("response_length", "Response length (mean)", ("response_length/mean",)),
    Panel("policy_loss", "Policy loss", ("actor/pg_loss",)),
    Panel("entropy", "Entropy", ("actor/entropy",)),
    Panel("grad_norm", "Gradient norm", ("actor/grad_norm",)),
)


def _series(rows: list[dict[str, float]], key: str) -> tuple[list[float], list[float]]:
    """Steps and values where ``key`` was logged (validation keys exist only every k steps)."""
    pairs = [(row["step"], row[key]) for row in rows if key in row]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` finite values at each point (NaN until one is seen)."""
    out, recent = [], []
    for value in values:
        if math.isfinite(value):
            recent = [*recent[-(window - 1) :], value] if window > 1 else [value]
        out.append(sum(recent) / len(recent) if recent else math.nan)
    return out


def _curve(ax, steps: list[float], values: list[float], color: str, label: str) -> None:
    """A short series raw with markers; a long one faint, under its trailing mean."""
    if len(steps) >= _SMOOTH_MIN_POINTS:
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
        smooth = _trailing_mean(values, max(3, len(values) // 20))
        ax.plot(steps, smooth, color=color, linewidth=2, label=label)
    else:
        ax.plot(steps, values, color=color, linewidth=1.5, marker="o", markersize=3, label=label)


def _draw(ax, rows: list[dict[str, float]], keys: list[str], title: str) -> None:
    for i, key in enumerate(keys):
        _curve(ax, *_series(rows, key), color=f"C{i % 10}", label=key)
    if keys and keys[0] == "reward/mean":
        _draw_std_band(ax, rows)
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step")
    if len(keys) == 1:
        ax.set_ylabel(keys[0])
    else:
        ax.legend(fontsize=8, loc="best")
    ax.grid(True, alpha=0.3)


def _draw_std_band(ax, rows: list[dict[str, float]]) -> None:
    both = [r for r in rows if "reward/mean" in r and "reward/std" in r]
    if both:
        steps = [r["step"] for r in both]
        low = [r["reward/mean"] - r["reward/std"] for r in both]
        high = [r["reward/mean"] + r["reward/std"] for r in both]
        ax.fill_between(steps, low, high, color="C0", alpha=0.12, linewidth=0, label="±1 std")


def _new_figure(width: float, height: float):
    # Figure + Agg canvas directly: no pyplot state, no GUI backend, safe in threads and servers.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _panels_for(metrics: Sequence[str] | None) -> tuple[Panel, ...]:
    if metrics is None:
        return PANELS
    if isinstance(metrics, str):
        metrics = [metrics]
    # A user pattern becomes its own panel, named after the pattern with unsafe characters replaced.
    return tuple(
        Panel(re.sub(r"[^A-Za-z0-9_.-]+", "_", p).strip("_") or "metric", p, (p,)) for p in metrics
    )


def _read_run(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no {METRICS_FILE} in {run_dir}: is this a groupflow run directory?"
        )
    rows = read_metrics(path)
    if not rows:
        raise ValueError(f"{path} is empty: the run has not logged any step yet")
    return rows


def plot_run(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    metrics: Sequence[str] | None = None,
) -> list[Path]:
    """Write PNG curves of ``run_dir/metrics.jsonl`` to ``out_dir`` (default ``run_dir/plots``).

    ``metrics``: glob patterns (e.g. ``["reward/*", "time/*"]``), one panel each, instead of the
    default panels. Returns the written paths: one PNG per non-empty panel, then ``overview.png``.
    """
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    rows = _read_run(run_dir)
    available = sorted({key for row in rows for key in row} - {"step", "wall_time"})
    panels = [(panel, panel.keys(available)) for panel in _panels_for(metrics)]
    panels = [(panel, keys) for panel, keys in panels if keys]
    if not panels:
        wanted = [p for panel in _panels_for(metrics) for p in panel.include]
        raise ValueError(
            f"no metric in {path} matches the patterns {wanted}; logged metrics: {available}. "
            "Pass metrics=[...] patterns to choose what to plot."
        )
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for panel, keys in panels:
        fig = _new_figure(6.4, 4.0)
        _draw(fig.add_subplot(), rows, keys, panel.title)
        written.append(out / f"{panel.name}.png")
        fig.savefig(written[-1])
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = _new_figure(5.2 * ncols, 3.6 * nrows)
    for i, (panel, keys) in enumerate(panels):
        _draw(fig.add_subplot(nrows, ncols, i + 1), rows, keys, panel.title)
    fig.suptitle(f"{run_dir.name}  (last step {int(rows[-1]['step'])})", fontsize=13)
    written.append(out / "overview.png")
    fig.savefig(written[-1])
    return written


# What a comparison of runs shows unless told otherwise: held-out and training success, length.
COMPARE_METRICS = ("val/*acc*", "val/*mean@*", "reward/mean", "response_length/mean")


def plot_runs(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path,
    metrics: Sequence[str] | None = None,
) -> list[Path]:
    """Compare runs: one PNG per metric matching ``metrics`` (glob patterns, default
    :data:`COMPARE_METRICS`) in any run, each run a curve labelled by its directory name, plus
    ``overview.png``. Returns the written paths."""
    dirs = [Path(d) for d in run_dirs]
    if len(dirs) < 2:
        raise ValueError("plot_runs compares two or more runs; plot_run draws one")
    names = [d.name for d in dirs]
    if len(set(names)) != len(names):
        names = [str(d) for d in dirs]  # same names under different parents: full paths
    runs = [_read_run(d) for d in dirs]
    available = sorted({k for rows in runs for row in rows for k in row} - {"step", "wall_time"})
    patterns = [metrics] if isinstance(metrics, str) else list(metrics or COMPARE_METRICS)
    keys = _drop_repeated_breakdowns(Panel("compare", "", tuple(patterns)).keys(available), runs)
    if not keys:
        raise ValueError(
            f"no metric of the runs matches the patterns {patterns}; logged metrics: {available}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key in keys:
        fig = _new_figure(6.4, 4.0)
        _draw_runs(fig.add_subplot(), runs, names, key)
        written.append(out / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', key)}.png")
        fig.savefig(written[-1])
    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig = _new_figure(5.2 * ncols, 3.6 * nrows)
    for i, key in enumerate(keys):
        _draw_runs(fig.add_subplot(nrows, ncols, i + 1), runs, names, key)
    fig.suptitle(", ".join(names), fontsize=11)
    written.append(out / "overview.png")
    fig.savefig(written[-1])
    return written


def _drop_repeated_breakdowns(keys: list[str], runs: list[list[dict[str, float]]]) -> list[str]:
    """Leave out ``X/<part>`` where every run logged exactly ``X``'s curve under it: with one data
    source the per-source breakdown repeats the total, and a panel that repeats another hides
    nothing but takes a sixth of the overview."""

    def repeats(key: str, parent: str) -> bool:
        return all(_series(rows, key) == _series(rows, parent) for rows in runs)

    return [
        k for k in keys if not any(k.startswith(p + "/") and repeats(k, p) for p in keys if p != k)
    ]


def _draw_runs(ax, runs: list[list[dict[str, float]]], names: list[str], key: str) -> None:
    for i, (rows, name) in enumerate(zip(runs, names)):
        steps, values = _series(rows, key)
        if steps:  # else this run did not log the metric
            _curve(ax, steps, values, color=f"C{i % 10}", label=name)
    ax.set_title(key, fontsize=11)
    ax.set_xlabel("step")
    ax.legend(fontsize=8, loc="best")
    ax.grid(True, alpha=0.3)


def plot_command(args: argparse.Namespace) -> int:
    """``groupflow plot RUN_DIR...``: one run's panels, or several runs compared (``--out``)."""
    if len(args.run_dirs) == 1:
        paths = plot_run(args.run_dirs[0], out_dir=args.out, metrics=args.metrics)
    elif args.out is None:
        raise ValueError("groupflow plot with several runs compares them: give --out DIR")
    else:
        paths = plot_runs(args.run_dirs, out_dir=args.out, metrics=args.metrics)
    for p in paths:
        print(p)
    return 0
