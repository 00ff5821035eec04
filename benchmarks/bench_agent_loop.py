"""What watching the agents' event loop costs: the agent workflow's collect with the watch (the
shipped path) against the same collect without it, side by side in one run.

Methodology: one trainer on the calc agent demo (``examples/calc_agent_demo.yaml``: the tiny
model, 16 prompts × 8 episodes, every episode in flight at once, each a tool call and an answer
through the run's server), no warm start. The watch is what ``AgentWorkflow._run_episodes`` adds
to a collect so that sync code in an agent cannot defeat ``rollout.agent_timeout_s``: a task
factory that keeps each task's context (to name a blocking episode), a heartbeat callback on the
loop every 0.25 s, and a driver thread that polls the episodes' future at that beat. **unwatched**
is the path before it: a loop with neither, the episodes awaited with one blocking ``result()``.
Both variants run the same rows with the same seeds (collect is deterministic in them), alternate
in ``--reps`` rounds so the machine's load hits both alike, and the median seconds per collect is
kept; printed with the load average and the ratio watched / unwatched (1.00 = no cost).

    .venv/bin/python benchmarks/bench_agent_loop.py [--reps 7] [--prompts 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f}"


def build(out_dir: str, prompts: int):
    from groupflow.config import load_config
    from groupflow.trainer import Trainer

    cfg = load_config(
        "examples/calc_agent_demo.yaml",
        [f"run.output_dir={out_dir}", "run.loggers=[]", "run.resume=never", "sft.steps=0",
         f"data.prompts_per_step={prompts}", "run.save_every=0", "run.save_final=false"],
    )  # fmt: skip
    return Trainer(cfg)


def unwatched(workflow):
    """``workflow`` running its episodes as before the watch: a plain loop, one blocking wait."""
    from groupflow.workflows.agent_runtime import AgentLoop

    class PlainLoop(AgentLoop):
        def __init__(self):
            super().__init__()
            self._loop.set_task_factory(None)  # nothing has run on it yet but the first beat

        def _beat(self) -> None:
            return None

    def run_episodes(episodes, params, scripts=None):
        loop = workflow.loop
        return loop.run(
            workflow._run_all(loop, episodes, params, scripts or [None] * len(episodes))
        )

    workflow.close()
    workflow._loop = PlainLoop()
    workflow._run_episodes = run_episodes


def timed(workflow, rows, step: int) -> tuple[float, float]:
    start = time.perf_counter()
    _, metrics = workflow.collect(rows, step, 0, 0)
    return time.perf_counter() - start, metrics["rollout/agent/calls/mean"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--results", default=None, metavar="PATH",
                   help="also write the measured rows as a results file (groupflow.utils.results)")  # fmt: skip
    args = p.parse_args()
    print(load())
    with tempfile.TemporaryDirectory() as out:
        trainer = build(out, args.prompts)
        import torch

        torch.set_num_threads(1)
        watched_wf = trainer.workflow
        plain_wf = type(watched_wf)(
            trainer.cfg, trainer.policy, watched_wf.train_rows, watched_wf.val_rows
        )
        unwatched(plain_wf)
        rows = watched_wf.train_rows[: args.prompts]
        for wf in (watched_wf, plain_wf):  # warm-up: server start, first HTTP connections
            timed(wf, rows, 0)
        seconds: dict[str, list[float]] = {"watched": [], "unwatched": []}
        calls = {}
        for rep in range(args.reps):
            order = [("watched", watched_wf), ("unwatched", plain_wf)]
            for name, wf in order if rep % 2 == 0 else order[::-1]:
                s, c = timed(wf, rows, rep + 1)
                seconds[name].append(s)
                calls[name] = c
        plain_wf.close()
        trainer.workflow.close()
        trainer.shutdown()
    w, u = (statistics.median(seconds[k]) for k in ("watched", "unwatched"))
    print(f"{args.prompts * 8} episodes per collect, {args.reps} rounds, median s per collect:")
    for name, value in (("watched", w), ("unwatched", u)):
        spread = ", ".join(f"{x:.3f}" for x in seconds[name])
        print(f"  {name:9s} {value:.3f} s  (calls/episode {calls[name]:.2f}; all: {spread})")
    print(f"  ratio watched / unwatched: {w / u:.3f}")
    print(load())
    if args.results:
        from groupflow.utils.results import write_results

        write_results(
            args.results,
            name=Path(args.results).stem,
            command="python benchmarks/bench_agent_loop.py " + " ".join(sys.argv[1:]),
            rows=[{"variant": "watched", "s per collect": round(w, 3)},
                  {"variant": "unwatched", "s per collect": round(u, 3)},
                  {"variant": "ratio watched / unwatched", "s per collect": round(w / u, 3)}],
            summary={"recipe": "benchmarks/bench_agent_loop.py",
                     "what": "seconds per agent-workflow collect with the blocked-loop watch vs without",
                     "before": f"unwatched {u:.3f} s per collect",
                     "after": f"watched {w:.3f} s per collect (ratio {w / u:.3f})",
                     "guide": "docs/benchmarks/serve.md"},
            notes=f"Calc agent demo (tiny model), {args.prompts} prompts × 8 episodes in flight, "
                  "no warm start, one torch thread; the two variants alternate, median of "
                  f"{args.reps} rounds.",
        )  # fmt: skip


if __name__ == "__main__":
    main()
