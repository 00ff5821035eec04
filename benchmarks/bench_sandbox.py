"""What bounding the sandbox as a whole costs per run: bubblewrap runs with a cgroup of their own
(memory and pids) and the seccomp filter — the shipped path — against the same runs without
either, side by side in one process.

Methodology: the same two programs — ``pass`` (the floor: sandbox set-up and interpreter start)
and a code reward's usual work (a solution plus 3 assert cases through the code reward's harness)
— run ``--reps`` times per variant, the variants alternating run by run so that the machine's
load hits both alike; printed are the median wall seconds per run, the CPU seconds per run (this
process and its finished children: bubblewrap, the interpreter inside, the kernel's work on the
cgroups — much less sensitive to a shared machine's load than wall time), the ratios bounded /
unbounded, and the load average. Where this process may make no cgroup, the bounded variant has
only the seccomp filter (the script says which).

    .venv/bin/python benchmarks/bench_sandbox.py [--reps 30]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import sys
import time
from pathlib import Path

from groupflow.rewards.code import make_code_tests_reward
from groupflow.tools import run_python
from groupflow.tools.sandbox.bwrap import BwrapSandbox, bwrap_path, machine_setup

SOLUTION = "```python\ndef add(a, b):\n    return a + b\n```"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f}"


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--results", default=None, metavar="PATH",
                   help="also write the measured rows as a results file (groupflow.utils.results)")  # fmt: skip
    args = p.parse_args()
    path = bwrap_path()
    if path is None:
        raise SystemExit("needs bubblewrap")
    setup = machine_setup(path)
    variants = {
        "bounded": BwrapSandbox(path, setup),
        "unbounded": BwrapSandbox(path, dataclasses.replace(setup, cgroup=None, seccomp=False)),
    }
    print(load())
    print(f"bounded: cgroup {setup.cgroup.describe() if setup.cgroup else 'none here'}, seccomp")
    work = {
        "pass": lambda sb: run_python("pass", sandbox=sb),
        "code reward (3 asserts)": lambda sb, fns={}: fns.setdefault(
            id(sb), make_code_tests_reward(sandbox=sb, max_workers=1)
        )([SOLUTION], tests=[TESTS]),
    }
    rows: list[dict] = []
    for name, fn in work.items():
        seconds: dict[str, list[float]] = {k: [] for k in variants}
        cpu: dict[str, float] = {k: 0.0 for k in variants}
        for sb in variants.values():
            fn(sb)  # warm-up
        for rep in range(args.reps):
            order = list(variants.items())
            for key, sb in order if rep % 2 == 0 else order[::-1]:
                start, used = time.perf_counter(), cpu_seconds()
                fn(sb)
                seconds[key].append(time.perf_counter() - start)
                cpu[key] += cpu_seconds() - used
        b, u = (statistics.median(seconds[k]) for k in ("bounded", "unbounded"))
        cb, cu = (cpu[k] / args.reps for k in ("bounded", "unbounded"))
        print(f"{name}: wall bounded {b * 1000:.1f} ms, unbounded {u * 1000:.1f} ms (ratio "
              f"{b / u:.3f}, median of {args.reps}); CPU bounded {cb * 1000:.1f} ms, unbounded "
              f"{cu * 1000:.1f} ms per run (ratio {cb / cu:.3f})")  # fmt: skip
        rows.append({"program": name, "CPU ms bounded": round(cb * 1000, 1),
                     "CPU ms unbounded": round(cu * 1000, 1), "CPU ratio": round(cb / cu, 3),
                     "wall ms bounded": round(b * 1000), "wall ms unbounded": round(u * 1000)})  # fmt: skip
    print(load())
    if args.results:
        from groupflow.utils.results import write_results

        cgroup = setup.cgroup.describe() if setup.cgroup else "no cgroup here (seccomp only)"
        write_results(
            args.results,
            name=Path(args.results).stem,
            command="python benchmarks/bench_sandbox.py " + " ".join(sys.argv[1:]),
            rows=rows,
            summary={"recipe": "benchmarks/bench_sandbox.py",
                     "what": "CPU per bubblewrap run, bounded as a whole (cgroup + seccomp) vs per process",
                     "before": f"unbounded {rows[0]['CPU ms unbounded']} ms CPU per run (pass)",
                     "after": f"bounded {rows[0]['CPU ms bounded']} ms (×{rows[0]['CPU ratio']})",
                     "guide": "docs/benchmarks/sandbox.md"},
            notes=f"Bounded: {cgroup}; {args.reps} runs per variant, alternating run by run; CPU = "
                  "this process and its finished children, mean per run; wall = median per run.",
        )  # fmt: skip


if __name__ == "__main__":
    main()
