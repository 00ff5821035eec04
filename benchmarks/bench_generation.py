"""Generation speed of this tree against a baseline commit, on a real model, side by side.

Methodology (made for a shared 2-core machine):

- The baseline is a git ref (``--baseline``, e.g. the commit before a change); its ``groupflow``
  package is exported with ``git archive`` into a temporary directory, so both versions run their
  own code on the same model, prompts, seeds and settings.
- Each variant runs in its own subprocess (two versions of one package cannot share a process),
  in alternating blocks — baseline, current, baseline, current, … — so slow drift of the machine's
  load hits both alike. A block loads the model, runs one untimed warm-up ``generate`` and then
  ``--reps`` timed ones; the load average is printed before every block. Reported: the median
  seconds per ``generate`` call of each variant over all its blocks, and the ratio, in wall time
  and in the process's CPU time (with one thread, CPU time hardly moves when other jobs take
  the cores; with two, OpenMP's spinning while it waits for a descheduled thread counts in it).
- The work is the issue's: ``--prompts`` chat prompts × ``--samples`` samples × exactly
  ``--new-tokens`` new tokens (no EOS id), temperature 1, fp32, ``--threads`` torch threads.
- ``--step N``: afterwards, N whole GRPO steps of each variant on the same work (bench_trl.py's
  groupflow side: generation, old log-probs, advantages, update), after a warm-up step, with the
  generation phase timed, against the matrix-multiply floor of that work (``bench_trl.gemm_floor``,
  measured in the current variant's process; with one thread all of it in CPU time). TRL is
  compared by ``bench_trl.py --model`` where it is installed.
- Exactness: every block also decodes greedily (16 rows, ``--check-tokens`` new tokens) and the
  sampled run's tokens and log-probs are kept; the variants' tokens are compared (greedy must be
  identical; sampled tokens may part where float rounding moves a draw across a boundary — the
  step where each row first differs is printed) and the log-probs' largest difference is shown.

    python benchmarks/bench_generation.py --model models/smollm2-135m-instruct --baseline 476f736

``--results PATH`` also writes the comparison as a results file (``groupflow.utils.results``) the
docs render: one row per measured quantity (``generate`` in CPU and wall time; with ``--step``
the whole step, its generation, and both over the floor), baseline and this tree side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = (
    "Write one sentence about the sea, in lowercase letters only.",
    "What is 47 + 38? Answer with the number.",
    "Name three colours, each on its own line.",
    "Describe a small blue bird in two sentences, and end with the word 'done'.",
)


def _prompts(tokenizer, count: int) -> list[list[int]]:
    rows = []
    for i in range(count):
        message = [{"role": "user", "content": MESSAGES[i % len(MESSAGES)]}]
        ids = tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=True)
        rows.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return rows


def worker(a: argparse.Namespace) -> dict:
    """One block, in a subprocess whose ``groupflow`` is the variant under test."""
    import time

    from transformers import AutoTokenizer

    from groupflow.models.causal_lm import load_causal_lm
    from groupflow.rollout.engines.hf import SamplingParams, generate

    torch.set_num_threads(a.threads)
    model = load_causal_lm(a.model).eval()
    prompts = _prompts(AutoTokenizer.from_pretrained(a.model), a.prompts)
    rows = len(prompts) * a.samples
    kw = dict(seeds=list(range(rows)), pad_id=0, eos_ids=[])
    sampled = SamplingParams(temperature=1.0, max_new_tokens=a.new_tokens, n=a.samples)
    out = generate(model, prompts, sampled, **kw)  # warm-up, and the sampled tokens kept
    times, cpu = [], []
    for _ in range(a.reps):
        t0, c0 = time.perf_counter(), time.process_time()
        generate(model, prompts, sampled, **kw)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=a.check_tokens, n=a.samples)
    g = generate(model, prompts, greedy, **kw)
    return {
        "times": times,
        "cpu": cpu,
        "sampled": out.responses.tolist(),
        "logprobs": out.logprobs.tolist(),
        "greedy": g.responses.tolist(),
        "greedy_logprobs": g.logprobs.tolist(),
    }


def step_worker(a: argparse.Namespace) -> dict:
    """Whole steps of this tree and the floor, in a subprocess whose ``groupflow`` is this tree."""
    import time

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_trl

    s = bench_trl.Settings(
        prompts_per_step=a.prompts, samples_per_prompt=a.samples, new_tokens=a.new_tokens,
        steps=a.step, threads=a.threads, model_dir=a.model, sizes=(bench_trl.MODEL_DIR_SIZE,),
    )  # fmt: skip
    torch.set_num_threads(a.threads)
    if a.threads == 1:  # see bench_trl.FLOOR_CLOCK
        bench_trl.FLOOR_CLOCK = time.process_time
    generate_s: list[float] = []
    generate_cpu_s: list[float] = []
    step_cpu_s = []
    seen: dict[str, list] = {"skipped": [], "prompt_len": [], "update_s": []}
    step_s = []
    with tempfile.TemporaryDirectory(prefix="bench-gen-step-") as tmp:
        trainer = bench_trl.build_groupflow(bench_trl.MODEL_DIR_SIZE, s, Path(tmp))
        worker_ = bench_trl.actor_worker(trainer)
        bench_trl._timed_method(worker_, "generate", generate_s)
        bench_trl._timed_method(worker_, "generate", generate_cpu_s, clock=time.process_time)
        for _ in range(a.step + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            bench_trl.groupflow_step(trainer, seen)
            step_s.append(time.perf_counter() - t0)
            step_cpu_s.append(time.process_time() - c0)
        floor = (
            bench_trl.gemm_floor(worker_.model, s, prompt_len=max(seen["prompt_len"]))
            if a.floor
            else None
        )
    # the first step is a warm-up
    return {
        "step_s": step_s[1:],
        "step_cpu_s": step_cpu_s[1:],
        "generate_s": generate_s[1:],
        "generate_cpu_s": generate_cpu_s[1:],
        "floor": floor,
        "floor_clock": "cpu" if a.threads == 1 else "wall",
    }


def _export(ref: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "groupflow"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _block(a: argparse.Namespace, pythonpath: Path, mode: str = "--worker", extra=()) -> dict:
    args = [sys.executable, __file__, mode, "--model", a.model, "--threads", str(a.threads)]
    args += list(extra)
    for key in ("prompts", "samples", "new_tokens", "reps", "check_tokens", "step"):
        args += [f"--{key.replace('_', '-')}", str(getattr(a, key))]
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    done = subprocess.run(args, env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"the {pythonpath} block failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _first_difference(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per row, the first step where the tokens differ (-1: identical)."""
    return [next((t for t, (x, y) in enumerate(zip(r, s)) if x != y), -1) for r, s in zip(a, b)]


def _max_logprob_gap(a: dict, b: dict, tokens: str, logprobs: str) -> float:
    """Largest |Δ log-prob| over the positions before each row's first differing token (after
    it the rows continue from different tokens, so their log-probs are not comparable)."""
    gap = 0.0
    first = _first_difference(a[tokens], b[tokens])
    for row, stop in enumerate(first):
        end = len(a[tokens][row]) if stop < 0 else stop
        for x, y in zip(a[logprobs][row][:end], b[logprobs][row][:end]):
            gap = max(gap, abs(x - y))
    return gap


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF model directory")
    ap.add_argument("--baseline", default="main", help="git ref to compare against")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--blocks", type=int, default=3, help="generate blocks per variant (0: --step only)"
    )
    ap.add_argument("--reps", type=int, default=2, help="timed generate calls per block")
    ap.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared")
    ap.add_argument("--step", type=int, default=0, help="whole steps of each variant vs the floor")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--results", help="also write the rows as a results file here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--step-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker or a.step_worker:
        print(json.dumps(worker(a) if a.worker else step_worker(a)))
        return {}
    with tempfile.TemporaryDirectory(prefix="bench-gen-") as tmp:
        paths = {"baseline": _export(a.baseline, Path(tmp)), "current": ROOT}
        summary = _compare(a, paths) if a.blocks else {}
        if a.step:
            summary["step"] = _step_summary(a, paths["baseline"])
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), **summary}, indent=2))
    if a.results:
        write_rows(a, summary, sys.argv[1:] if argv is None else argv)
    return summary


def _x(ratio: float) -> str:
    return f"{ratio:.2f}×"


def _loads(loads: list[float]) -> str:
    return f"load {min(loads):.1f}–{max(loads):.1f}"


def results_rows(a: argparse.Namespace, summary: dict) -> list[dict]:
    """The comparison in the docs' shape: a row per quantity, baseline beside this tree."""
    key = (f"{a.threads} thread{'s' if a.threads > 1 else ''}, {a.prompts} × {a.samples} × "
           f"{a.new_tokens} tokens")  # fmt: skip
    rows = []
    if "median_s" in summary:
        n, loads = a.blocks * a.reps, summary["block_loads"]
        cpu, wall = summary["median_cpu_s"], summary["median_s"]
        rows += [
            {key: f"`generate`, CPU s (median of {n}, alternating blocks; {_loads(loads)})",
             "baseline": round(cpu["baseline"], 2), "this change": round(cpu["current"], 2),
             "ratio": _x(summary["cpu_speedup"])},
            {key: "`generate`, wall s (same runs)", "baseline": round(wall["baseline"], 2),
             "this change": round(wall["current"], 2), "ratio": _x(summary["speedup"])},
        ]  # fmt: skip
    if "step" in summary:
        st, floor = summary["step"], summary["step"]["floor"]
        base, cur = st["baseline"], st["current"]
        clock = "CPU" if cur["clock"] == "cpu" else "wall"
        loads = [v[i][0] for v in (base, cur) for i in ("load_before", "load_after")]
        rows += [
            {key: f"whole GRPO step, {clock} s (median of {a.step} after a warm-up; "
                  f"{_loads(loads)})", "baseline": round(base["step_s"], 2),
             "this change": round(cur["step_s"], 2), "ratio": _x(base["step_s"] / cur["step_s"])},
            {key: f"generation inside that step, {clock} s",
             "baseline": round(base["generate_s"], 2), "this change": round(cur["generate_s"], 2),
             "ratio": _x(base["generate_s"] / cur["generate_s"])},
            {key: f"step / matrix-multiply floor ({floor['step_s']:.2f} s {clock})",
             "baseline": _x(base["step_over_floor"]), "this change": _x(cur["step_over_floor"]),
             "ratio": ""},
            {key: f"generation / its floor ({floor['generate_s']:.2f} s {clock})",
             "baseline": _x(base["generate_over_floor"]),
             "this change": _x(cur["generate_over_floor"]), "ratio": ""},
        ]  # fmt: skip
    return rows


def write_rows(a: argparse.Namespace, summary: dict, argv: list[str]) -> None:
    """``--results``: the comparison as a results file (``groupflow.utils.results``)."""
    import transformers

    from groupflow.utils.results import write_results

    rows = results_rows(a, summary)
    first = rows[0]
    notes = (f"Baseline {a.baseline}; torch {torch.__version__}, transformers "
             f"{transformers.__version__}, fp32, {a.threads} torch thread(s).")  # fmt: skip
    if "greedy_identical" in summary:
        sampled = summary["sampled_first_difference"]
        same = sum(1 for d in sampled if d < 0)
        notes += (
            f" Greedy tokens ({a.prompts * a.samples} rows × {a.check_tokens}) "
            f"{'identical to' if summary['greedy_identical'] else 'differ from'} the baseline's, "
            f"log-probs within {summary['greedy_max_logprob_gap']:.1e}; of the "
            f"{len(sampled)} sampled rows {same} are identical over all {a.new_tokens} tokens"
            + ("" if same == len(sampled) else
               f", the others part at steps {sorted(d for d in sampled if d >= 0)}") + "."
        )  # fmt: skip
    write_results(
        a.results, name=Path(a.results).stem, rows=rows,
        command="python benchmarks/bench_generation.py " + shlex.join(argv),
        summary={
            "recipe": f"benchmarks/bench_generation.py, {Path(a.model).name}",
            "what": f"{str(next(iter(first.values()))).split(' (')[0]}, {next(iter(first))}",
            "before": f"baseline {a.baseline} {first['baseline']} s",
            "after": f"{first['this change']} s ({first['ratio']})",
            "guide": "docs/benchmarks/generation.md",
        },
        notes=notes,
    )  # fmt: skip
    print(f"results: {a.results}")


def _compare(a: argparse.Namespace, paths: dict[str, Path]) -> dict:
    results: dict[str, list[dict]] = {"baseline": [], "current": []}
    loads: list[float] = []
    for block in range(a.blocks):
        for variant in ("baseline", "current"):
            load = os.getloadavg()
            loads.append(load[0])
            results[variant].append(_block(a, paths[variant]))
            r = results[variant][-1]
            times = ", ".join(f"{t:.2f}" for t in r["times"])
            cpu = ", ".join(f"{t:.2f}" for t in r["cpu"])
            print(
                f"block {block} {variant:8s} load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}: "
                f"wall {times} s, CPU {cpu} s per generate",
                flush=True,
            )
    med = {v: statistics.median(t for r in rs for t in r["times"]) for v, rs in results.items()}
    med_cpu = {v: statistics.median(t for r in rs for t in r["cpu"]) for v, rs in results.items()}
    base, cur = results["baseline"][0], results["current"][0]
    summary = {
        "median_s": med,
        "median_cpu_s": med_cpu,
        "speedup": med["baseline"] / med["current"],
        "cpu_speedup": med_cpu["baseline"] / med_cpu["current"],
        "load_after": os.getloadavg(),
        "block_loads": loads,
        "greedy_identical": base["greedy"] == cur["greedy"],
        "greedy_first_difference": _first_difference(base["greedy"], cur["greedy"]),
        "greedy_max_logprob_gap": _max_logprob_gap(base, cur, "greedy", "greedy_logprobs"),
        "sampled_first_difference": _first_difference(base["sampled"], cur["sampled"]),
        "sampled_max_logprob_gap": _max_logprob_gap(base, cur, "sampled", "logprobs"),
    }
    rows = a.prompts * a.samples
    print(
        f"\n{a.prompts} prompts x {a.samples} samples x {a.new_tokens} tokens, {a.threads} "
        f"thread(s): baseline {a.baseline} {med['baseline']:.2f} s, current {med['current']:.2f} s "
        f"per generate: {summary['speedup']:.2f}x; CPU time {med_cpu['baseline']:.2f} vs "
        f"{med_cpu['current']:.2f} s: {summary['cpu_speedup']:.2f}x (load after "
        f"{summary['load_after'][0]:.2f})\n"
        f"greedy tokens ({rows} rows x {a.check_tokens}) identical: {summary['greedy_identical']}; "
        f"max |d logprob| {summary['greedy_max_logprob_gap']:.1e}\n"
        f"sampled tokens: first differing step per row {summary['sampled_first_difference']} "
        f"(-1 = identical); max |d logprob| up to there {summary['sampled_max_logprob_gap']:.1e}"
    )
    return summary


def _step_summary(a: argparse.Namespace, baseline: Path | None) -> dict:
    """Whole steps of the baseline (if given) and of this tree, one subprocess each; the floor is
    measured in the second."""
    out: dict = {}
    variants = ([("baseline", baseline)] if baseline is not None else []) + [("current", ROOT)]
    for variant, path in variants:
        load = os.getloadavg()
        extra = ["--floor"] if variant == "current" else []
        r = _block(a, path, "--step-worker", extra)
        cpu = r["floor_clock"] == "cpu"  # with one thread everything is compared in CPU time
        step = statistics.median(r["step_cpu_s" if cpu else "step_s"])
        gen = statistics.median(r["generate_cpu_s" if cpu else "generate_s"])
        out[variant] = {"load_before": load, "load_after": os.getloadavg(), "step_s": step,
                        "generate_s": gen, "clock": r["floor_clock"], "raw": r}  # fmt: skip
        print(
            f"whole step, {variant} ({a.step} steps after a warm-up, load {load[0]:.2f} before, "
            f"{out[variant]['load_after'][0]:.2f} after): {step:.2f} s, generation {gen:.2f} s "
            f"({r['floor_clock']} time)",
            flush=True,
        )
    floor, cur = out["current"]["raw"]["floor"], out["current"]
    out["floor"] = floor
    print(
        f"matrix-multiply floor ({cur['clock']} time): {floor['step_s']:.2f} s (generation "
        f"{floor['generate_s']:.2f} s, update {floor['update_s']:.2f} s)"
    )
    for variant in (v for v, _ in variants):
        r = out[variant]
        r["step_over_floor"] = r["step_s"] / floor["step_s"]
        r["generate_over_floor"] = r["generate_s"] / floor["generate_s"]
        print(
            f"  {variant}: step {r['step_over_floor']:.2f}x the floor, generation "
            f"{r['generate_over_floor']:.2f}x"
        )
    return out


if __name__ == "__main__":
    main()
