"""The update's LM-head stage alone: fused log-probs vs the checkpointed autograd path, side by side.

What it times: forward + backward of the per-token log-probs (and the ``actor/entropy`` metric)
from the last hidden states of B·G responses, the part of the GRPO update that touches the
full-vocabulary logits. Three variants on identical inputs, interleaved (A, B, C, A, B, C, ...)
so a shared machine's drift hits all alike; medians reported:

- ``before``: the autograd path as it was — all positions in one checkpointed chunk
  (``logprob_chunk_tokens=4096`` ≥ 2,048 positions), logits divided by the temperature even at 1,
  and the entropy computed with gradients although ``entropy_coef`` is 0;
- ``autograd``: the same path with the entropy as a no-grad metric and no division at T=1;
- ``fused``: ``models/head_logprob`` (chunks of 1,024 positions, no logits kept for backward).

Shapes default to SmolLM2-135M's head (hidden 576, vocabulary 49,152) and the issue's work
(4 prompts × 4 samples × 128 new tokens = 2,048 positions); a real model directory may be given
with ``--model`` (its head weight is used). fp32, ``--threads`` torch threads. ``--results
PATH``: the rows as a results file (``groupflow.utils.results``) that the docs render.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_head_logprob.py --threads 2
        [--results benchmarks/results/head_logprob.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from groupflow.algorithms import entropy_from_logits
from groupflow.models.head_logprob import fused_head_logprobs


def before_path(head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    """The pre-fix computation: one checkpointed chunk, divide always, entropy with gradients."""

    def chunk(h, y):
        logits = head(h).float() / temperature
        logz = logits.logsumexp(-1)
        logp = logits.gather(-1, y.unsqueeze(-1)).squeeze(-1) - logz
        return logp, entropy_from_logits(logits)

    return checkpoint(chunk, hidden, targets, use_reentrant=False)


def autograd_path(head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Today's autograd path (used where the head cannot be fused): entropy without gradient."""

    def chunk(h, y):
        logits = head(h).float()
        if temperature != 1.0:
            logits = logits / temperature
        logz = logits.logsumexp(-1)
        logp = logits.gather(-1, y.unsqueeze(-1)).squeeze(-1) - logz
        with torch.no_grad():
            ent = entropy_from_logits(logits)
        return logp, ent

    return checkpoint(chunk, hidden, targets, use_reentrant=False)


def fused_path(head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    return fused_head_logprobs(hidden, head, targets, temperature=temperature, with_entropy=True)


VARIANTS = {"before": before_path, "autograd": autograd_path, "fused": fused_path}


def one(fn, head, hidden, targets, temperature) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one variant."""
    head.zero_grad(set_to_none=True)
    h = hidden.detach().requires_grad_(True)
    t0 = time.perf_counter()
    logp, ent = fn(head, h, targets, temperature)
    t1 = time.perf_counter()
    logp.sum().backward()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


LABELS = {"before": "before", "autograd": "autograd (entropy no-grad, no ÷1)", "fused": "fused"}


def write_head_results(a, head: nn.Linear, out: dict[str, dict[str, float]]) -> None:
    """The measured rows as a results file (``groupflow.utils.results``) the docs render."""
    from pathlib import Path

    from groupflow.utils.results import write_results

    base = out["before"]["total_s"]
    rows = [{"variant": LABELS[name], "forward s": round(v["forward_s"], 2),
             "backward s": round(v["backward_s"], 2), "total s": round(v["total_s"], 2),
             "speed vs before": f"{base / v['total_s']:.2f}×"} for name, v in out.items()]  # fmt: skip
    flags = [*([f"--model {a.model}"] if a.model else [f"--hidden {a.hidden}", f"--vocab {a.vocab}"]),
             f"--positions {a.positions}", f"--repeats {a.repeats}", f"--threads {a.threads}",
             *([f"--temperature {a.temperature}"] if a.temperature != 1.0 else [])]  # fmt: skip
    fused = out["fused"]["total_s"]
    write_results(
        a.results, name=Path(a.results).stem, rows=rows,
        command=f"OMP_NUM_THREADS={a.threads} python benchmarks/bench_head_logprob.py "
                f"{' '.join(flags)} --results {a.results}",
        summary={
            "recipe": f"benchmarks/bench_head_logprob.py: a {head.out_features} × "
                      f"{head.in_features} LM head, {a.positions} response positions",
            "what": "forward + backward seconds of the log-probs and entropy metric from the last "
                    "hidden states",
            "before": f"{base:.2f} s (the path before the fix)",
            "after": f"{fused:.2f} s fused ({base / fused:.2f}×)",
            "guide": "docs/benchmarks/update-speed.md",
        },
        notes=f"LM head {head.out_features} × {head.in_features}"
              f"{' from ' + a.model if a.model else ' (random weights)'}, fp32, temperature "
              f"{a.temperature:g}; {a.threads} threads; medians of {a.repeats}, the three variants "
              "interleaved in one process after a warm-up round.",
    )  # fmt: skip
    print(f"results: {a.results}")


def main(argv=None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a HF model directory: use its LM head's weight")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--positions", type=int, default=2048, help="B·G·new tokens")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--results", help="also write the rows as a results file (benchmarks/results/)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.model:
        from groupflow.models.causal_lm import load_causal_lm

        src = load_causal_lm(a.model, dtype="float32").get_output_embeddings()
        head = nn.Linear(src.in_features, src.out_features, bias=False)
        head.weight.data.copy_(src.weight.data)
    else:
        head = nn.Linear(a.hidden, a.vocab, bias=False)
    hidden = torch.randn(a.positions, head.in_features)
    targets = torch.randint(0, head.out_features, (a.positions,))
    # equal values first (the tests check gradients too)
    lp_b, _ = before_path(head, hidden, targets, a.temperature)
    lp_f, _ = fused_path(head, hidden, targets, a.temperature)
    assert torch.allclose(lp_b, lp_f, atol=1e-4), "fused log-probs differ from the plain path"
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in VARIANTS}
    for r in range(a.repeats + 1):  # the first round is a warm-up
        for name, fn in VARIANTS.items():
            t = one(fn, head, hidden, targets, a.temperature)
            if r:
                times[name].append(t)
    out = {}
    print(
        f"LM head {head.out_features}×{head.in_features}, {a.positions} positions, fp32, "
        f"{a.threads} threads, T={a.temperature}, medians of {a.repeats}"
    )
    for name, ts in times.items():
        fwd = statistics.median(t[0] for t in ts)
        bwd = statistics.median(t[1] for t in ts)
        out[name] = {"forward_s": fwd, "backward_s": bwd, "total_s": fwd + bwd}
        print(f"  {name:<9} forward {fwd:6.3f} s  backward {bwd:6.3f} s  total {fwd + bwd:6.3f} s")
    base = out["before"]["total_s"]
    for name in ("autograd", "fused"):
        print(f"  {name} is {base / out[name]['total_s']:.2f}x the 'before' path's speed")
    if a.results:
        write_head_results(a, head, out)
    return out


if __name__ == "__main__":
    main()
