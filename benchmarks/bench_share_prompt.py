"""Shared-prompt training forward: one actor update (and one log-prob pass) with
``actor.share_prompt_prefix`` on vs off, on CPU.

Methodology: one Llama-style model (default hidden 192, 6 layers, 4 heads: 2.66M parameters, the
``medium`` size of bench_trl.py) is deep-copied into two actor workers that differ only in the
switch. The batch is B prompts × G samples in shuffled row order, every prompt exactly
``--prompt-tokens`` long and every response exactly ``--response-tokens`` long (no padding, so
both sides do the same token work), PPO-clip, one mini-batch and one micro-batch (the whole batch
in one forward/backward: the sharing applies within a micro-batch). Timed calls alternate shared,
single, shared, single, ... so load from other processes hits both alike; the first of each is a
discarded warm-up and the median (and the minimum: steadier on a shared machine) of the rest is
reported, with the ratio shared / single. ``torch.set_num_threads`` is fixed (default 1).
``--results PATH``: the rows as a results file (``groupflow.utils.results``) that the docs render.

    .venv/bin/python benchmarks/bench_share_prompt.py [--prompt-tokens 16 256] [--repeats 5]
        [--results benchmarks/results/share_prompt.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch


def make_batch(prompts: int, samples: int, p_len: int, r_len: int, vocab: int, seed: int = 0):
    from groupflow.batch import Batch

    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(2, vocab, (prompts, p_len), generator=g)
    rows = torch.arange(prompts).repeat_interleave(samples)
    rows = rows[torch.randperm(len(rows), generator=g)]
    n = len(rows)
    return Batch(
        {
            "prompt_ids": prompt_ids[rows],
            "prompt_mask": torch.ones(n, p_len, dtype=torch.long),
            "responses": torch.randint(2, vocab, (n, r_len), generator=g),
            "response_mask": torch.ones(n, r_len, dtype=torch.long),
            "old_logprobs": torch.full((n, r_len), -4.0),
            "advantages": torch.randn(n, generator=g),
            "group_ids": rows,
        },
        {},
    )


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(args, p_len: int) -> dict:
    from groupflow.config import ActorConfig
    from groupflow.models.causal_lm import build_tiny_llama
    from groupflow.workers.actor import ActorRolloutWorker

    model = build_tiny_llama(
        args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
        max_positions=p_len + args.response_tokens, pad_token_id=0, eos_token_id=1, seed=0,
    )  # fmt: skip
    params = sum(p.numel() for p in model.parameters())
    workers = {
        share: ActorRolloutWorker(
            copy.deepcopy(model),
            None,
            ActorConfig(lr=1e-5, share_prompt_prefix=share),
            total_steps=100,
            pad_id=0,
            eos_ids=[1],
        )  # fmt: skip
        for share in (True, False)
    }
    batch = make_batch(args.prompts, args.samples, p_len, args.response_tokens, args.vocab)
    times: dict[str, dict[bool, list[float]]] = {"update": {True: [], False: []},
                                                 "logprobs": {True: [], False: []}}  # fmt: skip
    for _ in range(args.repeats + 1):  # the first round is a warm-up
        for share, w in workers.items():
            times["update"][share].append(timed(lambda w=w: w.update(batch, temperature=1.0)))
            times["logprobs"][share].append(
                timed(lambda w=w: w.compute_logprobs(batch, temperature=1.0))
            )
    out = {"prompt_tokens": p_len, "params": params}
    for kind, by_share in times.items():
        shared, single = (statistics.median(by_share[s][1:]) for s in (True, False))
        fastest = {s: min(by_share[s][1:]) for s in (True, False)}
        out[kind] = {"shared_s": shared, "single_s": single, "ratio": shared / single,
                     "ratio_min": fastest[True] / fastest[False]}  # fmt: skip
    return out


def write_share_results(args, results: list[dict]) -> None:
    """The measured rows as a results file (``groupflow.utils.results``) the docs render."""
    from pathlib import Path

    from groupflow.utils.results import write_results

    b, g, r = args.prompts, args.samples, args.response_tokens
    rows = [{"prompt tokens": x["prompt_tokens"],
             "update shared s": round(x["update"]["shared_s"], 3),
             "update single s": round(x["update"]["single_s"], 3),
             "update ratio": round(x["update"]["ratio"], 2),
             "log-probs shared s": round(x["logprobs"]["shared_s"], 3),
             "log-probs single s": round(x["logprobs"]["single_s"], 3),
             "log-probs ratio": round(x["logprobs"]["ratio"], 2),
             # the share of the tokens the shared pass still encodes (computed, not measured)
             "token-count bound": round((b * x["prompt_tokens"] + b * g * r)
                                        / (b * g * (x["prompt_tokens"] + r)), 2)}
            for x in results]  # fmt: skip
    longest = max(results, key=lambda x: x["prompt_tokens"])
    flags = [f"--prompt-tokens {' '.join(map(str, args.prompt_tokens))}",
             f"--response-tokens {r}", f"--prompts {b}", f"--samples {g}",
             f"--hidden {args.hidden}", f"--layers {args.layers}", f"--heads {args.heads}",
             f"--vocab {args.vocab}", f"--repeats {args.repeats}", f"--threads {args.threads}"]  # fmt: skip
    write_results(
        args.results, name=Path(args.results).stem, rows=rows,
        command=f"python benchmarks/bench_share_prompt.py {' '.join(flags)} --results {args.results}",
        summary={
            "recipe": f"benchmarks/bench_share_prompt.py: {b} prompts × {g} samples, "
                      f"{r}-token responses",
            "what": "seconds of one update and one log-prob pass, actor.share_prompt_prefix on vs off",
            "before": f"update {longest['update']['single_s']:.2f} s with the prompt encoded per "
                      f"sample ({longest['prompt_tokens']}-token prompts)",
            "after": f"{longest['update']['shared_s']:.2f} s with it encoded once per group "
                     f"(ratio {longest['update']['ratio']:.2f})",
            "guide": "docs/benchmarks/update-speed.md",
        },
        notes=f"Llama-style model, hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
              f"({results[0]['params'] / 1e6:.2f}M parameters), fp32; {args.threads} thread(s); "
              f"medians of {args.repeats} after one discarded warm-up, calls alternating shared, "
              "single. ratio = shared / single (lower is faster). The token-count bound is "
              "computed, not measured: (B·P + B·G·R) / (B·G·(P + R)), the share of the tokens the "
              "shared pass still encodes.",
    )  # fmt: skip
    print(f"results: {args.results}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--response-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--results", default=None,
                    help="also write the rows as a results file (benchmarks/results/)")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for p_len in args.prompt_tokens:
        r = run(args, p_len)
        results.append(r)
        print(
            f"prompt {p_len:4d} + response {args.response_tokens} tokens, "
            f"{args.prompts}x{args.samples} samples, {r['params'] / 1e6:.2f}M params:"
        )
        for kind in ("update", "logprobs"):
            k = r[kind]
            print(f"  {kind:8s} shared {k['shared_s']:.3f}s  single {k['single_s']:.3f}s  "
                  f"ratio {k['ratio']:.3f} (of minima {k['ratio_min']:.3f})")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.results:
        write_share_results(args, results)


if __name__ == "__main__":
    main()
