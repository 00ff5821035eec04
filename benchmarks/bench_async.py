"""Asynchronous rollout: steps per second of ``rollout.max_staleness: 1`` against the synchronous
loop, measured side by side in one run; optionally the learning curves of both.

Methodology: trainers on the same config and seed (the CPU demo, ``examples/reverse_demo.yaml``,
without its warm start for the speed part): ``sync`` (k = 0, rollout and training alternate in
this process) and k = 1 (the rollout side — workflow, rewards, prompt loader and a frozen model
copy — in a child process with one torch thread, collecting the next step's batch while this
process trains with one thread), once with no off-policy correction (``k=1``) and once with
decoupled PPO (``k=1 dec``; with one optimizer step per batch its proximal log-probs come from the
update's own forward, no extra pass). All are built and warmed up first (the child's start is not
timed), then timed in alternating blocks of ``--block`` steps (sync, k=1, k=1 dec, sync, ...) so
that all see the same machine load; the first block of each is discarded, and so is the first
step of every block (the k=1 runs' next batch is finished before another block starts, so that
step found its batch ready).

Printed, per run: the median seconds per step, steps/s and the ratio to sync (wall clock: what
the machine gave, low when it is shared); CPU seconds per step of the trainer process and of the
rollout side's process (Linux /proc), cores used ((trainer + rollout CPU) / wall) and the overlap
(the share of the smaller side's CPU time that ran while the other ran too); the fraction of
samples the update skipped (zero advantage — runs on different trajectories do different work per
step; ``--all-samples`` trains every sample so the work is equal). Then the load-independent
estimate — sync's CPU per step over the busier side's, what two idle cores would give — and the
bound from the sync run's own stage times (step / max(rollout, rest)). The load average is
printed before and after.

``--in-flight``: two more trainers in the same blocks, k = 1 with decoupled PPO in
``rollout.async_mode: eager`` (a batch takes the newest version when it starts) and ``in_flight``
(a version published while a batch decodes reaches it between two decode steps), both with
``rollout.max_new_tokens`` raised to ``--in-flight-tokens`` (48): without the warm start most
samples then stop early and a few run to the limit (skewed lengths, a long tail), and
generation, not the update, is the slower side — only then can a version arrive while a batch decodes. Printed: the
steps/s of both and their ratio, and the staleness each trains at: per sample (its oldest token)
and per token, and the share of samples whose tokens span two versions. In-flight updates make
tokens fresher, not steps faster: the ratio shows what loading a version mid-batch costs.
``--multi-turn``: the pair runs the calculator-tool demo instead (``examples/calc_tools_demo.yaml``,
its own model, 2-turn episodes of up to 48 response tokens) after an untimed warm start of
``--warm-start`` SFT steps (150), meant to give episodes of one turn and of two (measured: 150
steps give one turn, 300 and 600 two, to every episode; benchmarks/README.md). Printed as well:
the mean turns per episode and the mean and longest response of each batch. ``--results PATH``:
the rows as a results file (``groupflow.utils.results``) that the docs render.

``--curves``: then runs the whole demo (warm start included, ``run.total_steps``) once
synchronously and once with k = 1 (decoupled PPO) and prints held-out greedy accuracy at every
validation side by side — does the stale run learn as well in the same number of steps?
``--plot PNG`` draws them (held-out accuracy and the training reward, both runs on each panel;
``--val-every`` validates more often than the demo's 40 steps); ``--no-speed`` skips the timing.

    .venv/bin/python benchmarks/bench_async.py [--blocks 4] [--block 6] [--prompts 32]
        [--model demo|medium] [--all-samples]
        [--in-flight [--in-flight-tokens 48] [--multi-turn [--warm-start 150]]]
        [--curves [--plot docs/async_curves.png] [--val-every 20]] [--no-speed]
        [--results benchmarks/results/NAME.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def overrides(
    name: str, out_dir: str, k: int, extra: list[str], correction="decoupled"
) -> list[str]:
    return [
        f"run.output_dir={out_dir}", f"run.name={name}", "run.loggers=[]", "run.num_threads=1",
        "run.resume=never", "run.save_every=0", "run.save_final=false",
        f"rollout.max_staleness={k}", *([f"actor.off_policy={correction}"] if k else []), *extra,
    ]  # fmt: skip


def build(name: str, out_dir: str, k: int, extra: list[str], correction: str = "decoupled",
          config: str = "examples/reverse_demo.yaml"):  # fmt: skip
    from groupflow.config import load_config
    from groupflow.trainer import Trainer

    cfg = load_config(config, overrides(name, out_dir, k, extra, correction))
    trainer = Trainer(cfg)
    # what fit() does first: the warm start (if any) and an asynchronous child starting
    trainer.policy.sync()
    trainer.before_training()
    trainer.source.start(trainer.step)
    return trainer


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f}"


# Llama-style shapes as in bench_trl.py: the demo's ~0.2M and a ~2.7M-parameter model.
MODELS = {
    "demo": "{hidden_size: 64, num_layers: 4, num_heads: 4, max_positions: 64}",
    "medium": "{hidden_size: 192, num_layers: 6, num_heads: 4, max_positions: 64}",
}


def cpu_seconds(pid: int | None = None) -> float | None:
    """CPU time (user + system) of this process, or of process ``pid`` (Linux /proc; else None)."""
    if pid is None:
        return time.process_time()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the rollout side, once stopped)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


@dataclass
class Block:
    """One timed block of a trainer: wall and CPU seconds over its steps."""

    steps: int
    wall: float
    trainer_cpu: float  # this process (the trainer; for sync also its collect)
    rollout_cpu: float | None  # the rollout side's child process (None: sync, or no /proc)
    skipped: float  # mean fraction of samples the update left out (zero advantage): work per step
    staleness: float = 0.0  # mean per-sample staleness (async/staleness)
    token_staleness: float | None = None  # mean per-token staleness (in-flight updates only)
    switched: float | None = None  # mean share of samples whose tokens span two versions
    turns: float | None = None  # mean turns per episode (multi-turn workflows)
    length: float | None = None  # mean response length
    longest: float | None = None  # mean over steps of the batch's longest response

    @property
    def cores(self) -> float | None:
        return (
            None if self.rollout_cpu is None else (self.trainer_cpu + self.rollout_cpu) / self.wall
        )

    @property
    def overlap(self) -> float | None:
        """The share of the smaller side's CPU time that ran while the other side ran too."""
        if self.rollout_cpu is None:
            return None
        both = self.trainer_cpu + self.rollout_cpu - self.wall
        return min(1.0, max(0.0, both / max(1e-9, min(self.trainer_cpu, self.rollout_cpu))))


def timed_block(trainer, n: int, stages: list | None) -> Block:
    """``n`` steps; the first is not counted (its batch was generated ahead while idle)."""
    trainer.train_step()
    rollouts = getattr(trainer.source, "rollouts", None)  # the asynchronous source's side
    child = rollouts.process.pid if rollouts and rollouts.process else None
    wall, cpu, rollout = time.perf_counter(), cpu_seconds(), cpu_seconds(child) if child else None
    skipped, seen = [], []
    for _ in range(n - 1):
        _, metrics = trainer.train_step()
        skipped.append(metrics.get("actor/zero_adv_skipped", 0.0))
        seen.append(metrics)
        if stages is not None:
            stages.append((metrics["time/rollout_and_reward"], metrics["time/step"]))
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    if rollout is not None:
        rollout = cpu_seconds(child) - rollout
    if rollouts is not None:
        rollouts.drain()  # the batch generated ahead must not run during another's block

    def mean(key: str) -> float | None:
        values = [m[key] for m in seen if key in m]
        return statistics.mean(values) if values else None

    return Block(n - 1, wall, cpu, rollout, statistics.mean(skipped),
                 mean("async/staleness") or 0.0, mean("async/token_staleness_mean"),
                 mean("async/samples_switched_frac"), mean("rollout/turns/mean"),
                 mean("response_length/mean"), mean("response_length/max"))  # fmt: skip


def speed(args) -> None:
    steps = args.blocks * args.block + args.block
    extra = [
        f"run.total_steps={steps + 2}", f"data.prompts_per_step={args.prompts}",
        "validation.before_training=false", "sft.steps=0", f"model.tiny={MODELS[args.model]}",
        *(["actor.skip_zero_advantage=false"] if args.all_samples else []),
    ]  # fmt: skip
    print(f"model: {args.model} {MODELS[args.model]}"
          + ("; every sample trained (actor.skip_zero_advantage=false)" if args.all_samples else ""))  # fmt: skip
    print(f"before: {load()}; {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as out:
        trainers = {
            "sync": build("sync", out, 0, extra),
            "k=1": build("k1", out, 1, extra, "none"),
            "k=1 dec": build("k1d", out, 1, extra, "decoupled"),
        }
        if args.in_flight:
            config, pair = "examples/reverse_demo.yaml", [
                *extra, f"rollout.max_new_tokens={args.in_flight_tokens}"]  # fmt: skip
            if args.multi_turn:  # its own model; a warm start so that some episodes call the tool
                config, pair = "examples/calc_tools_demo.yaml", [
                    f"run.total_steps={steps + 2}", f"data.prompts_per_step={args.prompts}",
                    "validation.before_training=false", f"sft.steps={args.warm_start}",
                    "sft.stop_at_accuracy=null",
                ]  # fmt: skip
                print(f"in-flight pair: {config}, {args.warm_start} SFT steps first (untimed)")
            for name, mode in (("eager", "eager"), ("in-flight", "in_flight")):
                trainers[name] = build(name, out, 1, [*pair, f"rollout.async_mode={mode}"],
                                       config=config)  # fmt: skip
        blocks: dict[str, list[Block]] = {n: [] for n in trainers}
        stages: list[tuple[float, float]] = []  # the sync run's (rollout+reward, step) seconds
        try:
            for block in range(args.blocks + 1):  # the first block of each warms up
                for name, trainer in trainers.items():
                    timed = timed_block(
                        trainer, args.block, stages if block and name == "sync" else None
                    )
                    if block:
                        blocks[name].append(timed)
        finally:
            for trainer in trainers.values():
                trainer.source.close()
                trainer.shutdown()
    print(f"after:  {load()}")
    report(blocks, stages)
    if args.results:
        write_speed_results(args, blocks)


def report(blocks: dict[str, list[Block]], stages: list[tuple[float, float]]) -> None:
    """Wall-clock steps/s and their ratio (what the machine gave), and the CPU view: seconds of
    CPU per step of each side, cores used, overlap — independent of other load on the machine."""

    def per_step(name: str, attr: str) -> float | None:
        values = [getattr(b, attr) for b in blocks[name]]
        if any(v is None for v in values):
            return None
        return sum(values) / sum(b.steps for b in blocks[name])

    def fmt(x: float | None, spec: str = ".3f") -> str:
        return "-" if x is None else format(x, spec)

    med = {n: statistics.median(b.wall / b.steps for b in bl) for n, bl in blocks.items()}
    print(f"{'':8} {'s/step':>7} {'steps/s':>8} {'ratio':>6} | {'CPU s/step: trainer':>20} "
          f"{'rollout':>8} | {'cores':>5} {'overlap':>7} | {'skipped':>7}  s/step per block")  # fmt: skip
    for n, bl in blocks.items():
        cores = [b.cores for b in bl]
        over = [b.overlap for b in bl]
        print(
            f"{n:8} {med[n]:7.3f} {1 / med[n]:8.2f} {med['sync'] / med[n]:6.2f} | "
            f"{fmt(per_step(n, 'trainer_cpu')):>20} {fmt(per_step(n, 'rollout_cpu')):>8} | "
            f"{fmt(None if None in cores else statistics.mean(cores), '.2f'):>5} "
            f"{fmt(None if None in over else statistics.mean(over), '.2f'):>7} | "
            f"{statistics.mean(b.skipped for b in bl):7.2f}  "
            + " ".join(f"{b.wall / b.steps:.3f}" for b in bl)
        )
    for n in ("k=1", "k=1 dec"):
        print(f"speed-up {n} over sync: {med['sync'] / med[n]:.2f}x (steps/s ratio, wall clock)")
    # The load-independent view: with a core each, a step takes as long as the busier side.
    sync_cpu = per_step("sync", "trainer_cpu")
    for n in ("k=1", "k=1 dec"):
        trainer, rollout = per_step(n, "trainer_cpu"), per_step(n, "rollout_cpu")
        if rollout is not None:
            print(f"CPU view {n}: sync uses {sync_cpu:.3f} CPU-s per step; the trainer "
                  f"{trainer:.3f} and the rollout side {rollout:.3f} -> with two idle cores "
                  f"{sync_cpu / max(trainer, rollout):.2f}x")  # fmt: skip
    if "in-flight" in blocks:  # k = 1, decoupled PPO, longer responses: what in-flight changes
        print(f"{'':10} {'steps/s':>8} {'ratio':>6} | {'staleness: sample':>17} {'token':>6} | "
              f"{'samples switched':>16} | {'turns':>5} {'length':>6} {'longest':>7}")  # fmt: skip
        for n in ("eager", "in-flight"):
            bl = blocks[n]
            token = [b.token_staleness for b in bl if b.token_staleness is not None]
            switched = [b.switched for b in bl if b.switched is not None]
            print(f"{n:10} {1 / med[n]:8.2f} {med['eager'] / med[n]:6.2f} | "
                  f"{statistics.mean(b.staleness for b in bl):17.3f} "
                  f"{fmt(statistics.mean(token) if token else None):>6} | "
                  f"{fmt(statistics.mean(switched) if switched else None, '.2f'):>16} | "
                  f"{fmt(_mean(bl, 'turns'), '.2f'):>5} {fmt(_mean(bl, 'length'), '.1f'):>6} "
                  f"{fmt(_mean(bl, 'longest'), '.1f'):>7}")  # fmt: skip
    # What overlap could give with two idle cores: the sync step's rollout and the rest of it
    # run side by side, so the step takes the longer of the two (a bound, not a measurement).
    rollout = statistics.median(r for r, _ in stages)
    step = statistics.median(s for _, s in stages)
    print(f"sync step {step:.3f} s, of which rollout+reward {rollout:.3f} s: with two idle cores "
          f"overlap could reach {step / max(rollout, step - rollout):.2f}x (bound)")  # fmt: skip


def speed_rows(blocks: dict[str, list[Block]]) -> list[dict]:
    """One row per trainer: the median steps/s and its ratio to sync; for the eager/in-flight pair
    (a config of its own) the ratio to eager instead, the staleness each trained at and the
    episodes' shape."""
    med = {n: statistics.median(b.wall / b.steps for b in bl) for n, bl in blocks.items()}
    rows = []
    for n, bl in blocks.items():
        row: dict = {"run": n, "steps/s": round(1 / med[n], 2)}
        if n not in ("eager", "in-flight"):
            row["ratio to sync"] = round(med["sync"] / med[n], 2)
        else:  # longer responses or the multi-turn task: not sync's config
            token, switched = _mean(bl, "token_staleness"), _mean(bl, "switched")
            row |= {
                "ratio to eager": round(med["eager"] / med[n], 2),
                "staleness per sample": round(statistics.mean(b.staleness for b in bl), 3),
                "per token": "—" if token is None else round(token, 3),
                "samples switched": "—" if switched is None else f"{switched:.0%}",
                "turns": _round(_mean(bl, "turns"), 2),
                "mean length": _round(_mean(bl, "length"), 1),
                "longest": _round(_mean(bl, "longest"), 1),
            }
        rows.append(row)
    return rows


def _round(x: float | None, digits: int):
    return "—" if x is None else round(x, digits)


def write_speed_results(args, blocks: dict[str, list[Block]]) -> None:
    """The measured rows as a results file (``groupflow.utils.results``) the docs render."""
    from groupflow.utils.results import write_results

    rows = speed_rows(blocks)
    by = {r["run"]: r for r in rows}
    flags = [f"--blocks {args.blocks}", f"--block {args.block}", f"--prompts {args.prompts}",
             *([f"--model {args.model}"] if args.model != "demo" else []),
             *(["--all-samples"] if args.all_samples else []),
             *(["--in-flight"] if args.in_flight else []),
             *([f"--multi-turn --warm-start {args.warm_start}"] if args.multi_turn else [])]  # fmt: skip
    task = ("the calculator-tool demo after its warm start" if args.multi_turn
            else f"the reverse demo, {args.prompts} prompts per step, responses up to "
                 f"{args.in_flight_tokens} tokens")  # fmt: skip
    pair = "in-flight" in by
    write_results(
        args.results, name=Path(args.results).stem, rows=rows,
        command=f"python benchmarks/bench_async.py {' '.join(flags)} --results {args.results}",
        summary={
            "recipe": f"benchmarks/bench_async.py: {task}" if pair else "the reverse demo",
            "what": "steps/s (eager vs in-flight, and per-token staleness)" if pair
                    else "steps/s, k = 1 vs sync",
            "before": f"{by['eager']['steps/s']} steps/s eager" if pair
                      else f"{by['sync']['steps/s']} steps/s sync",
            "after": (f"{by['in-flight']['steps/s']} steps/s in-flight, per-token staleness "
                      f"{by['in-flight']['per token']}") if pair
                     else f"{by['k=1']['steps/s']} steps/s with k = 1",
            "guide": "docs/guides/async.md",
        },
    )  # fmt: skip
    print(f"results: {args.results}")


def _mean(blocks: list[Block], attr: str) -> float | None:
    values = [getattr(b, attr) for b in blocks if getattr(b, attr) is not None]
    return statistics.mean(values) if values else None


def curves(args) -> None:
    from groupflow.config import load_config
    from groupflow.run.tracking import read_metrics
    from groupflow.trainer import Trainer

    rows, runs = {}, {}
    extra = [f"validation.every_steps={args.val_every}"] if args.val_every else []
    with tempfile.TemporaryDirectory() as out:
        for name, k in (("sync", 0), ("k=1", 1)):
            cfg = load_config("examples/reverse_demo.yaml", overrides(f"c{k}", out, k, extra))
            trainer = Trainer(cfg)
            start, cpu = time.perf_counter(), run_cpu_seconds()
            trainer.fit()
            trainer.shutdown()
            seconds, cpu = time.perf_counter() - start, run_cpu_seconds() - cpu
            runs[name] = read_metrics(trainer.run_dir / "metrics.jsonl")
            rows[name] = {int(r["step"]): r.get("val/greedy/acc") for r in runs[name]}
            print(f"{name}: {seconds:.0f} s for the whole run, {cpu:.0f} CPU-s with its rollout "
                  f"process ({load()})")  # fmt: skip
    if args.plot:
        plot_curves(runs, args.plot)
        print(f"wrote {args.plot}")
    print(f"{'step':>5} {'sync val/greedy/acc':>20} {'k=1 val/greedy/acc':>20}")
    for step in sorted(rows["sync"]):
        a, b = rows["sync"][step], rows["k=1"].get(step)
        if a is not None or b is not None:
            print(f"{step:5d} {a if a is not None else float('nan'):20.3f} "
                  f"{b if b is not None else float('nan'):20.3f}")  # fmt: skip
    if args.results and not args.speed:  # with the speed part, --results holds its rows
        write_curve_results(args, rows)


def write_curve_results(args, rows: dict[str, dict[int, float | None]]) -> None:
    """The held-out accuracy per validation step of both runs (``async_curves.json``'s shape)."""
    from groupflow.utils.results import write_results

    fmt = lambda v: round(v, 3) if v is not None else "—"  # noqa: E731
    table = [{"step": str(step), "sync": fmt(rows["sync"][step]), "k=1 (decoupled)":
              fmt(rows["k=1"].get(step))} for step in sorted(rows["sync"])]  # fmt: skip
    flags = ["--no-speed --curves", *([f"--val-every {args.val_every}"] if args.val_every else []),
             *([f"--plot {args.plot}"] if args.plot else [])]  # fmt: skip
    at = next((r for r in table if r["step"] == "60"), table[-1])
    write_results(
        args.results, name=Path(args.results).stem, rows=table,
        command=f"python benchmarks/bench_async.py {' '.join(flags)} --results {args.results}",
        summary={
            "recipe": "benchmarks/bench_async.py --curves: the whole reverse demo",
            "what": "held-out greedy accuracy, sync vs k = 1 decoupled",
            "before": f"sync {at['sync']} at step {at['step']}",
            "after": f"k=1 {at['k=1 (decoupled)']} at step {at['step']}",
            "guide": "docs/benchmarks/async.md",
        },
        notes="With the warm start; k = 1 with decoupled PPO; greedy accuracy on the held-out set.",
    )  # fmt: skip
    print(f"results: {args.results}")


def plot_curves(runs: dict[str, list[dict]], path: str) -> None:
    """Held-out greedy accuracy and the training reward (10-step trailing mean) of both runs."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    val, reward = fig.subplots(1, 2)
    labels = {"sync": "sync (k = 0)", "k=1": "k = 1, decoupled PPO"}
    for name, metrics in runs.items():
        points = [(r["step"], r["val/greedy/acc"]) for r in metrics if "val/greedy/acc" in r]
        val.plot(*zip(*points), marker="o", markersize=3, label=labels[name])
        steps = [r["step"] for r in metrics if "reward/mean" in r]
        values = [r["reward/mean"] for r in metrics if "reward/mean" in r]
        smooth = [statistics.fmean(values[max(0, i - 9) : i + 1]) for i in range(len(values))]
        reward.plot(steps, smooth, label=labels[name])
    val.set(title="held-out greedy accuracy", xlabel="step", ylim=(0, 1.02))
    reward.set(title="training reward (10-step mean)", xlabel="step")
    for ax in (val, reward):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=4, help="timed blocks per trainer")
    p.add_argument("--block", type=int, default=6, help="steps per block")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--model", choices=sorted(MODELS), default="demo", help="speed part only")
    p.add_argument("--all-samples", action="store_true",
                   help="speed part: train every sample (no zero-advantage skipping), so every "
                        "run does the same work per step")  # fmt: skip
    p.add_argument("--in-flight", action="store_true",
                   help="speed part: also k=1 with async_mode eager and in_flight (staleness)")  # fmt: skip
    p.add_argument("--in-flight-tokens", type=int, default=48,
                   help="with --in-flight: rollout.max_new_tokens of the eager/in-flight pair")  # fmt: skip
    p.add_argument(
        "--multi-turn",
        action="store_true",
        help="with --in-flight: the pair on the calculator-tool demo (skewed episodes)",
    )
    p.add_argument(
        "--warm-start",
        type=int,
        default=150,
        help="with --multi-turn: untimed SFT steps before the pair's timing",
    )
    p.add_argument(
        "--results",
        default=None,
        help="speed part: also write the rows as a results file (benchmarks/results/)",
    )
    p.add_argument("--curves", action="store_true", help="also the demo's learning curves")
    p.add_argument("--plot", default=None, help="with --curves: write them to this PNG")
    p.add_argument("--val-every", type=int, default=None, help="with --curves: validation steps")
    p.add_argument("--no-speed", dest="speed", action="store_false", help="skip the timing")
    args = p.parse_args()
    if (args.plot or args.val_every) and not args.curves:
        p.error("--plot and --val-every need --curves")
    if args.multi_turn and not args.in_flight:
        p.error("--multi-turn chooses the --in-flight pair's task: it needs --in-flight")

    import torch

    torch.set_num_threads(1)
    if args.speed:
        speed(args)
    if args.curves:
        curves(args)


if __name__ == "__main__":
    main()
