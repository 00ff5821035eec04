"""The actor's update, packed (``actor.packing``) vs padded, side by side on one length-skewed batch.

What it times: ``ActorRolloutWorker.update`` — every micro-batch's forward, the LM head, the
GRPO loss, backward, the optimizer step — on the same weights and the same batch, once padded
(each micro-batch [B, P + T], ``micro_batch_tokens`` charged B × width) and once packed (each
micro-batch one row of its real tokens, the budget charged the tokens; ``models.packing``).
The variants are interleaved (padded, packed, padded, packed, ...) after a warm-up round, so a
shared machine's drift hits both alike; medians are reported, with

- the padding fraction: the share of the padded forward's token slots that hold padding (its
  micro-batches as the worker forms them, trimmed to their longest prompt + response);
- tokens/s: real tokens (prompt + response, the same for both) per second of update;
- peak memory: on CUDA ``max_memory_allocated`` during the update; on the CPU the peak resident
  set size above the one before the update, sampled every 2 ms (allocator caching blurs it:
  compare the two columns, not absolute values).

Before timing, the first update's loss and gradient norm are checked equal (the tests check
every ``loss_agg`` to 1e-5; tests/workers/test_actor_packing.py).

Models: ``tiny`` — the demo's architecture (hidden 64, 4 layers, 4 heads) with room for the
lengths; ``smollm2`` — SmolLM2-135M-Instruct from ``models/smollm2-135m-instruct`` (make it with
``groupflow convert-gguf --out models/smollm2-135m-instruct``), with the instruction-following
recipe's LoRA (rank 16 on every linear layer); skipped when the directory is missing. Lengths
as in instruction following: prompts of 10-60 tokens, responses of 10-440 skewed short
(20-500 tokens a sample), so that the padded batch is about half padding. ``--results PATH``:
the rows as a results file (``groupflow.utils.results``) that the docs render.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_packing.py --threads 2
        [--results benchmarks/results/packing.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import torch

from groupflow.batch import Batch
from groupflow.config import ActorConfig, LoraConfig
from groupflow.models.causal_lm import build_tiny_llama, load_causal_lm
from groupflow.workers.actor import ActorRolloutWorker
from groupflow.workers.update import forward_groups, sample_tokens, trim

SMOLLM2 = Path("models/smollm2-135m-instruct")
TINY_VOCAB = 64
BUDGETS = {"tiny": 8192, "smollm2": 2048}  # micro_batch_tokens, both variants


def skewed_batch(n: int, vocab: int, seed: int = 0) -> Batch:
    """``n`` samples in groups of 4 sharing a prompt of 10-60 tokens (left-padded), responses of
    10-440 tokens skewed short (10 + 430·u², u uniform), GRPO-like advantages."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(10, 61, (n,), generator=g).tolist()
    r_len = [10 + int(430 * float(torch.rand((), generator=g)) ** 2) for _ in range(n)]
    p, t = max(p_len), max(r_len)
    prompt_ids = torch.zeros(n, p, dtype=torch.long)
    prompt_mask = torch.zeros(n, p, dtype=torch.long)
    responses = torch.zeros(n, t, dtype=torch.long)
    response_mask = torch.zeros(n, t, dtype=torch.long)
    for i in range(n):
        if i % 4 == 0:  # a group's samples answer one prompt (the padded path shares it)
            prompt = torch.randint(3, vocab, (p_len[i],), generator=g)
        p_len[i] = len(prompt)
        prompt_ids[i, p - p_len[i] :] = prompt
        prompt_mask[i, p - p_len[i] :] = 1
        responses[i, : r_len[i]] = torch.randint(3, vocab, (r_len[i],), generator=g)
        response_mask[i, : r_len[i]] = 1
    return Batch(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "responses": responses,
            "response_mask": response_mask,
            "advantages": torch.randn(n, generator=g),
            "group_ids": torch.arange(n) // 4,
        }
    )


def padding_fraction(batch: Batch, cfg: ActorConfig) -> float:
    """Share of the padded forward's token slots that are padding, over its micro-batches."""
    real = sum(sample_tokens(batch))
    slots = 0
    for idx in forward_groups(batch, cfg):
        mb = trim(batch.index(idx))
        slots += len(idx) * (mb["prompt_ids"].shape[1] + mb["responses"].shape[1])
    return 1 - real / slots


class PeakMemory:
    """Peak memory of a block: CUDA's allocator peak, or on the CPU the resident set size sampled
    every 2 ms by a thread, above its value at entry (bytes)."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            return self
        self.start = self._rss()
        self.top, self.stop = self.start, threading.Event()

        def sample():
            while not self.stop.wait(0.002):
                self.top = max(self.top, self._rss())

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.start
            return
        self.stop.set()
        self.thread.join()
        self.peak = max(self.top, self._rss()) - self.start


def bench_model(name: str, build, batch: Batch, cfg: dict, repeats: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    workers, first = {}, {}
    for variant in ("padded", "packed"):
        model = build().to(device)
        workers[variant] = ActorRolloutWorker(
            model, None, ActorConfig(**cfg, packing=variant == "packed"), total_steps=100,
            pad_id=0, eos_ids=[1],
        )  # fmt: skip
    tokens = sum(sample_tokens(batch))
    pad = padding_fraction(batch, workers["padded"].cfg)
    times: dict[str, list[float]] = {"padded": [], "packed": []}
    peaks: dict[str, list[int]] = {"padded": [], "packed": []}
    for r in range(repeats + 1):  # round 0: warm-up, and the equality check
        for variant, worker in workers.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            with PeakMemory(device) as mem:
                t0 = time.perf_counter()
                metrics = worker.update(batch, temperature=1.0, shuffle_seed=r)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
            if r == 0:
                first[variant] = metrics
            else:
                times[variant].append(elapsed)
                peaks[variant].append(mem.peak)
        if r == 0:
            for key in ("actor/pg_loss", "actor/grad_norm"):
                a, b = first["padded"][key], first["packed"][key]
                assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), f"{name}: {key} {a} vs {b}"
    out = {"padding_fraction": pad, "tokens": tokens, "samples": len(batch)}
    for variant in times:
        s = statistics.median(times[variant])
        out[variant] = {"update_s": s, "tokens_per_s": tokens / s,
                        "peak_mib": max(peaks[variant]) / 2**20}  # fmt: skip
    out["speedup"] = out["padded"]["update_s"] / out["packed"]["update_s"]
    print(
        f"{name}: {len(batch)} samples, {tokens} real tokens, padding {pad:.0%} of the padded "
        f"forward's slots, micro_batch_tokens={cfg.get('micro_batch_tokens')}, "
        f"medians of {repeats} ({device.type}, {torch.get_num_threads()} threads)"
    )
    for variant in ("padded", "packed"):
        v = out[variant]
        print(f"  {variant:<7} update {v['update_s']:7.2f} s  {v['tokens_per_s']:8.0f} tokens/s  "
              f"peak {v['peak_mib']:7.0f} MiB")  # fmt: skip
    print(f"  packed is {out['speedup']:.2f}x the padded update's speed "
          f"(padding removed: {1 / (1 - pad):.2f}x the tokens)")  # fmt: skip
    return out


MODEL_LABELS = {
    "tiny": "tiny (the demo's architecture: hidden 64, 4 layers), full fine-tuning",
    "smollm2": "SmolLM2-135M-Instruct, LoRA r16 all-linear (the recipe's)",
}


def write_packing_results(a, results: dict) -> None:
    """The measured rows as a results file (``groupflow.utils.results``) the docs render."""
    from groupflow.utils.results import write_results

    rows = []
    for name, r in results.items():
        pad, pa, pk = r["padding_fraction"], r["padded"], r["packed"]
        rows.append({
            "model": MODEL_LABELS[name],
            "batch": f"{r['samples']} samples, {r['tokens']:,} tokens, micro_batch_tokens "
                     f"{BUDGETS[name]}",
            "padding": f"{pad:.0%}".replace("%", " %"),
            "padded update s": round(pa["update_s"], 2), "packed update s": round(pk["update_s"], 2),
            "speed-up": f"{r['speedup']:.2f}×", "padding-free bound": f"{1 / (1 - pad):.2f}×",
            "tokens/s padded": round(pa["tokens_per_s"]), "tokens/s packed": round(pk["tokens_per_s"]),
            "peak MiB padded": round(pa["peak_mib"]), "peak MiB packed": round(pk["peak_mib"]),
        })  # fmt: skip
    flags = [f"--models {','.join(results)}", f"--repeats {a.repeats}", f"--threads {a.threads}"]
    if "tiny" in results and a.tiny_samples != 64:
        flags.append(f"--tiny-samples {a.tiny_samples}")
    if "smollm2" in results and a.smollm2_samples != 8:
        flags.append(f"--smollm2-samples {a.smollm2_samples}")
    if "smollm2" in results and a.smollm2 != str(SMOLLM2):
        flags.append(f"--smollm2 {a.smollm2}")
    write_results(
        a.results, name=Path(a.results).stem, rows=rows,
        command=f"OMP_NUM_THREADS={a.threads} python benchmarks/bench_packing.py {' '.join(flags)} "
                f"--results {a.results}",
        summary={
            "recipe": "benchmarks/bench_packing.py: one update on a length-skewed batch "
                      "(20–500 tokens a sample)",
            "what": "seconds of one actor update, actor.packing vs padded",
            "before": "padded: " + ", ".join(f"{r['padded']['update_s']:.1f} s ({n})"
                                             for n, r in results.items()),
            "after": "packed: " + ", ".join(f"{r['packed']['update_s']:.1f} s "
                                            f"({r['speedup']:.2f}×)" for r in results.values()),
            "guide": "docs/benchmarks/update-speed.md",
        },
        notes=f"{a.threads} threads; medians of {a.repeats}, padded and packed interleaved after "
              "a warm-up round whose loss and gradient norm are checked equal. Padding-free "
              "bound: 1/(1 − padding), what removing the padding alone would give. Peak MiB: "
              + ("CUDA's max_memory_allocated during the update." if torch.cuda.is_available()
                 else "resident set above its value before the update, sampled every 2 ms "
                      "(allocator caching blurs it: compare the pair, not absolute values)."),
    )  # fmt: skip
    print(f"results: {a.results}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    p.add_argument("--smollm2", default=str(SMOLLM2), help="SmolLM2 HF directory")
    p.add_argument("--tiny-samples", type=int, default=64)
    p.add_argument("--smollm2-samples", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results", help="also write the rows as a results file (benchmarks/results/)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    base = {"lr": 1e-5, "loss_agg": "token_mean", "skip_zero_advantage": False}
    results = {}
    for name in a.models.split(","):
        if name == "tiny":
            results["tiny"] = bench_model(
                "tiny (demo architecture)",
                lambda: build_tiny_llama(
                    TINY_VOCAB, hidden_size=64, num_layers=4, num_heads=4, max_positions=512
                ),  # fmt: skip
                skewed_batch(a.tiny_samples, TINY_VOCAB),
                {**base, "micro_batch_tokens": BUDGETS["tiny"]},
                a.repeats,
            )
        elif name == "smollm2":
            if not (Path(a.smollm2) / "config.json").is_file():
                print(f"smollm2: skipped ({a.smollm2} missing; see groupflow convert-gguf)")
                continue
            lora = LoraConfig(rank=16, alpha=32, target_modules="all-linear")
            results["smollm2"] = bench_model(
                "SmolLM2-135M-Instruct + LoRA r16",
                lambda: load_causal_lm(a.smollm2, dtype="float32"),
                skewed_batch(a.smollm2_samples, 49152, seed=0),
                {**base, "micro_batch_tokens": BUDGETS["smollm2"], "lora": lora},
                a.repeats,
            )
        else:
            raise SystemExit(f"--models: unknown model {name!r} (tiny, smollm2)")
    if a.results and results:
        write_packing_results(a, results)
    return results


if __name__ == "__main__":
    main()
