"""Rollout throughput: the HF engine (groupflow's decode loop) vs the vLLM engine, same model and prompts.

Methodology: one process builds one model (a random Llama-style model of a chosen size with a
character tokenizer, or a local HF directory with ``--model``) and hands the same weights to both
engines. Each timed round generates ``prompts × samples`` responses of exactly ``--new-tokens``
tokens (no EOS id is given to either engine, so neither stops early) with temperature 1 and one
seed per sample; rounds alternate HF, vLLM, HF, vLLM, ... so that load from other processes hits
both alike. The first round of each engine is a discarded warm-up. Reported: median wall seconds
per round and generated tokens per second (prompt tokens not counted), plus the vLLM engine's
start-up and weight-push time. Run it in .venv-vllm (``bash scripts/setup_vllm.sh``):

    .venv-vllm/bin/python benchmarks/rollout.py [--size small] [--prompts 8] [--samples 8]
        [--new-tokens 64] [--rounds 3] [--threads 2] [--dtype float32] [--model DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

# A model with a given shape: hidden, layers, heads (head dim 64, as vLLM's CPU attention needs).
SIZES = {"tiny": (128, 2, 2), "small": (256, 4, 4), "medium": (512, 8, 8)}


def build_model(args):

    from groupflow.data import train_char_tokenizer
    from groupflow.models.causal_lm import build_tiny_llama, load_causal_lm, resolve_dtype

    if args.model:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        model = load_causal_lm(args.model, dtype=args.dtype)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return model.eval(), tok
    hidden, layers, heads = SIZES[args.size]
    tok = train_char_tokenizer("0123456789=+")
    model = build_tiny_llama(
        len(tok), hidden_size=hidden, num_layers=layers, num_heads=heads,
        max_positions=256, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=0,
    )  # fmt: skip
    return model.to(resolve_dtype(args.dtype)).eval(), tok


def prompts_for(tok, n: int, is_char_tokenizer: bool) -> list[list[int]]:
    from groupflow.data.synthetic import make_task_rows

    rows, _ = make_task_rows("reverse", n, 1, seed=0, digits=12)
    texts = [str(r["prompt"]) for r in rows]
    if not is_char_tokenizer:
        texts = [f"Reverse the digits: {t}" for t in texts]
    return [tok(t)["input_ids"] for t in texts]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=list(SIZES), default="small")
    p.add_argument("--model", help="a local HF model directory instead of a random model")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--rounds", type=int, default=3, help="timed rounds per engine (after 1 warm-up)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument(
        "--results", help="also write the row measured as a results file (JSON) the docs render"
    )
    args = p.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    from groupflow.rollout.engines.hf import SamplingParams, generate
    from groupflow.rollout.engines.vllm_engine import VLLMEngine, VLLMOptions, require_vllm

    require_vllm()
    torch.set_num_threads(args.threads)
    model, tok = build_model(args)
    prompts = prompts_for(tok, args.prompts, is_char_tokenizer=not args.model)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=args.samples)
    n_out = args.prompts * args.samples

    start = time.perf_counter()
    engine = VLLMEngine(
        model, tok, VLLMOptions(dtype=args.dtype, seed=0), eos_ids=[], pad_id=tok.pad_token_id
    )
    startup_s = time.perf_counter() - start
    torch.set_num_threads(args.threads)  # vLLM's start-up may have changed it
    push_s = engine.load_weights(model.state_dict().items())

    def run_hf(seeds):
        return generate(model, prompts, params, seeds=seeds, pad_id=tok.pad_token_id, eos_ids=[])

    def run_vllm(seeds):
        return engine.generate(prompts, params, seeds=seeds)

    engines = {"hf": run_hf, "vllm": run_vllm}
    seconds: dict[str, list[float]] = {k: [] for k in engines}
    tokens: dict[str, int] = {}
    for r in range(args.rounds + 1):
        seeds = [r * n_out + i for i in range(n_out)]
        for name, fn in engines.items():
            t0 = time.perf_counter()
            out = fn(seeds)
            dt = time.perf_counter() - t0
            tokens[name] = int(out.response_mask.sum())
            print(f"round {r}{' (warm-up)' if r == 0 else ''} {name}: {dt:.2f} s", flush=True)
            if r:  # round 0 warms up
                seconds[name].append(dt)

    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {args.model or args.size} ({n_params / 1e6:.2f}M params, {args.dtype}), "
        f"{args.prompts} prompts × {args.samples} samples × {args.new_tokens} new tokens, "
        f"{args.threads} threads, {args.rounds} timed rounds"
    )
    print(f"vLLM start-up {startup_s:.1f} s, weight push {push_s * 1000:.1f} ms")
    print(f"{'engine':8} {'median s/round':>15} {'tokens/s':>10}")
    result = {
        "model": args.model or args.size, "params": n_params, "dtype": args.dtype,
        "prompts": args.prompts, "samples": args.samples, "new_tokens": args.new_tokens,
        "threads": args.threads, "vllm_startup_s": startup_s, "vllm_weight_push_s": push_s,
    }  # fmt: skip
    for name in engines:
        med = statistics.median(seconds[name])
        rate = tokens[name] / med
        result[name] = {"median_s": med, "tokens": tokens[name], "tokens_per_s": rate}
        print(f"{name:8} {med:15.3f} {rate:10.0f}")
    print(
        f"vLLM / HF throughput: {result['vllm']['tokens_per_s'] / result['hf']['tokens_per_s']:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.results:
        write_rollout_results(args, result)


def write_rollout_results(args, result: dict) -> None:
    """One row (this model and setting) in the shape of ``benchmarks/results/rollout_vllm.json``."""
    import sys

    from groupflow.utils.results import write_results

    hf, vllm = result["hf"]["tokens_per_s"], result["vllm"]["tokens_per_s"]
    row = {
        "model": f"{result['model']} ({result['params'] / 1e6:.1f}M params), {args.dtype}",
        "work per round": f"{args.prompts} prompts × {args.samples} samples × "
        f"{args.new_tokens} tokens, {args.rounds} timed rounds",
        "HF tokens/s": round(hf),
        "vLLM tokens/s": round(vllm),
        "vLLM / HF": round(vllm / hf, 2),
        "vLLM start-up s": round(result["vllm_startup_s"], 1),
        "weight push s": round(result["vllm_weight_push_s"], 2),
    }
    write_results(
        args.results,
        name=os.path.splitext(os.path.basename(args.results))[0],
        command="python benchmarks/rollout.py " + " ".join(sys.argv[1:]),
        rows=[row],
        summary={
            "recipe": "benchmarks/rollout.py: HF engine vs vLLM engine on CPU",
            "what": "generated tokens/s, same weights, same work",
            "before": f"HF {hf:.0f} tokens/s",
            "after": f"vLLM {vllm:.0f} tokens/s ({vllm / hf:.2f}×)",
            "guide": "docs/benchmarks/rollout-vllm.md",
        },
        notes=f"{args.threads} torch threads, median of {args.rounds} rounds after one warm-up; "
        "responses of exactly the requested length (no EOS id), prompt tokens not counted.",
    )


if __name__ == "__main__":
    main()
