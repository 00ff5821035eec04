"""Benchmark generation speed: the engine ``groupflow eval --benchmark`` uses against the plain
Hugging Face ``generate`` floor (and vLLM on CPU where ``.venv-vllm`` exists), side by side.

Methodology (made for a shared 2-core machine): one process, one model (fp32, ``--threads`` torch
threads), the first ``--prompts`` IFEval prompts through the model's chat template, greedy, exactly
``--new-tokens`` new tokens per prompt (no EOS stop: the same work for every engine). The engines
run in alternating blocks (groupflow, HF, groupflow, HF, ...) so a change of the machine's load
hits both; each block is one untimed warm-up and ``--reps`` timed calls. Reported: the median
seconds per call, tokens/s, the process CPU seconds, and the ratio groupflow / HF (> 1: groupflow
faster); the greedy tokens of the two are compared (they must agree up to float rounding).
vLLM: its CPU build needs its own environment (``scripts/setup_vllm.sh``), where the same eval
runs with ``rollout.engine=vllm``; this script does not drive it.

    python benchmarks/bench_eval.py --model models/smollm2-135m-instruct --prompts 8 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _prompts(tokenizer, count: int) -> list[list[int]]:
    from groupflow.evals import get_benchmark

    rows = get_benchmark("ifeval").load().rows[:count]
    out = []
    for r in rows:
        ids = tokenizer.apply_chat_template(r.prompt, add_generation_prompt=True, tokenize=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def _groupflow(model, prompts, new_tokens):
    from groupflow.rollout.engines.hf import SamplingParams, generate

    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    out = generate(model, prompts, params, seeds=list(range(len(prompts))), pad_id=0, eos_ids=[])
    return out.responses.tolist()


def _hf(model, prompts, new_tokens):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, pad_token_id=0,
        )  # fmt: skip
    return out[:, width:].tolist()


def _time(fn, reps: int) -> tuple[list[float], list[float], list]:
    result = fn()  # warm-up
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu, result


def _write_results(a, s: dict, prompts: int) -> None:
    """The table of docs/benchmarks/eval.md, one row per engine and the ratio."""
    from groupflow.utils.results import write_results

    g, h = s["groupflow"], s["hf_generate"]
    rows = [
        {"engine": "groupflow (`rollout.hf.generate`, static KV cache)", "s per call": round(g["s"], 1),
         "tokens/s": round(g["tokens_per_s"], 1), "CPU s per call": round(g["cpu_s"], 2)},
        {"engine": "HF `model.generate`", "s per call": round(h["s"], 1),
         "tokens/s": round(h["tokens_per_s"], 1), "CPU s per call": round(h["cpu_s"], 2)},
        {"engine": "groupflow / HF", "s per call": f"{s['ratio_wall']:.2f}× wall", "tokens/s": "",
         "CPU s per call": f"{s['ratio_cpu']:.2f}× CPU"},
    ]  # fmt: skip
    write_results(
        a.results, name=Path(a.results).stem, rows=rows,
        command=f"python benchmarks/bench_eval.py --model {a.model} --prompts {a.prompts} "
                f"--new-tokens {a.new_tokens} --results {a.results}",
        summary={"recipe": f"benchmarks/bench_eval.py ({Path(a.model).name} fp32)",
                 "what": f"CPU s per call, {a.prompts} IFEval prompts × {a.new_tokens} tokens",
                 "before": f"HF generate {h['cpu_s']:.2f} CPU s",
                 "after": f"groupflow {g['cpu_s']:.2f} CPU s ({s['ratio_cpu']:.2f}×)",
                 "guide": "docs/benchmarks/eval.md"},
        notes=f"{a.prompts} IFEval prompts × {a.new_tokens} new tokens, greedy, torch "
              f"{torch.__version__}, {a.threads} thread(s), median of {a.blocks} alternating "
              f"blocks × {a.reps} call(s). Greedy tokens agreed on "
              f"{s['greedy_rows_identical']} of {prompts} rows.",
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF model directory")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=2, help="alternating blocks per engine")
    ap.add_argument("--reps", type=int, default=1, help="timed calls per block")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--results", help="write a results file (groupflow.utils.results)")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from groupflow.models.causal_lm import load_causal_lm

    torch.set_num_threads(a.threads)
    model = load_causal_lm(a.model).eval()
    prompts = _prompts(AutoTokenizer.from_pretrained(a.model), a.prompts)
    engines = {
        "groupflow": lambda: _groupflow(model, prompts, a.new_tokens),
        "hf_generate": lambda: _hf(model, prompts, a.new_tokens),
    }
    runs = {name: {"wall": [], "cpu": []} for name in engines}
    tokens = {}
    for block in range(a.blocks):
        for name, fn in engines.items():
            load = Path("/proc/loadavg").read_text().split()[0]
            wall, cpu, tokens[name] = _time(fn, a.reps)
            runs[name]["wall"] += wall
            runs[name]["cpu"] += cpu
            print(
                f"block {block} {name:<12} {statistics.median(wall):7.2f} s (load {load})",
                flush=True,
            )
    work = a.prompts * a.new_tokens
    summary = {"prompts": a.prompts, "new_tokens": a.new_tokens, "threads": a.threads}
    print(
        f"\n{a.prompts} IFEval prompts x {a.new_tokens} new tokens, greedy, {a.threads} thread(s)"
    )
    print(f"{'engine':<14}{'s/call':>9}{'tokens/s':>10}{'cpu s':>8}")
    for name, r in runs.items():
        wall, cpu = statistics.median(r["wall"]), statistics.median(r["cpu"])
        summary[name] = {"s": wall, "tokens_per_s": work / wall, "cpu_s": cpu}
        print(f"{name:<14}{wall:9.2f}{work / wall:10.1f}{cpu:8.2f}")
    ratio = summary["hf_generate"]["s"] / summary["groupflow"]["s"]
    cpu_ratio = summary["hf_generate"]["cpu_s"] / summary["groupflow"]["cpu_s"]
    summary["ratio_wall"], summary["ratio_cpu"] = ratio, cpu_ratio
    same = sum(x == y for x, y in zip(tokens["groupflow"], tokens["hf_generate"]))
    summary["greedy_rows_identical"] = same
    print(
        f"groupflow / HF generate: {ratio:.2f}x wall, {cpu_ratio:.2f}x CPU time (> 1: groupflow faster)"
    )
    print(f"greedy rows identical: {same}/{len(prompts)}")
    # vLLM's CPU build lives in its own environment; this script does not drive it
    present = (REPO / ".venv-vllm" / "bin" / "python").exists()
    summary["vllm"] = "not measured"
    print("vLLM on CPU: not measured here" + ("" if present else " (.venv-vllm absent)") +
          "; time `groupflow eval CONFIG --benchmark ifeval rollout.engine=vllm` in .venv-vllm")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2))
    if a.results:
        _write_results(a, summary, len(prompts))
    return summary


if __name__ == "__main__":
    main()
