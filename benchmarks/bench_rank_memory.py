"""Per-rank memory of a sharded actor: the old layout (FSDP2 policy + a full reference + a full
generation copy on every rank) against the new one (policy and reference sharded, generation on
the sharded policy, each layer gathered at its use), side by side.

Methodology: for each model, each layout runs in its own pair of processes (2 gloo ranks,
torch.multiprocessing, one torch thread each, ``actor.kl_coef`` > 0 so there is a reference), in
the order old, new. A rank builds the model, then the ``ActorRolloutWorker``, and runs one rollout
step's worker calls: ``generate`` (its share of the prompts), reference and old-policy log-probs of
the samples, one ``update``. Reported per rank (the larger of the two):

- weights held: bytes of parameter storage the worker keeps between calls — policy shards,
  reference (shards or full), generation copy (exact, from the tensors);
- resident: RSS after the worker is built, above the RSS before the model was built;
- peak: the kernel's high-water mark (VmHWM, reset through ``/proc/self/clear_refs`` after the
  heap is trimmed, before each call) during generate, log-probs and update, above the same
  baseline — what the step needs at its worst (AdamW state, gradients, activations included);
- the seconds of each call, and whether both layouts sampled the same tokens (they must).

The old layout is today's code with ``actor.generation_weights: copy`` and a full reference beside
it, whose log-probs (and the old policy's) come from ``batch_logprobs`` on the unsharded copies —
the path the actor took before the reference was sharded. ``--results PATH``: the rows (one per
measure, old / new / new/old per model) as a results file (``groupflow.utils.results``) that the
docs render.

    .venv/bin/python benchmarks/bench_rank_memory.py [--models medium smollm2] [--new-tokens 32]
        [--results benchmarks/results/rank_memory.json]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PAD, EOS = 0, 1
SHAPES = {
    # bench_weights' ~2.7M-parameter Llama body, a 64-token vocabulary
    "medium": {"vocab_size": 64, "hidden_size": 192, "num_hidden_layers": 6,
               "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 512,
               "tie_word_embeddings": False},
    # SmolLM2-135M: 49152 tokens, 30 layers, hidden 576, 9 query / 3 K/V heads, MLP 1536, tied
    "smollm2": {"vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
                "tie_word_embeddings": True},
}  # fmt: skip
PROMPTS_PER_RANK, SAMPLES, PROMPT_LEN = 4, 4, 16


def _model(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=256, pad_token_id=PAD,
                         eos_token_id=EOS, bos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _trim() -> None:
    """Return freed heap to the OS (glibc keeps freed pages), so RSS is what is in use."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _storage_bytes(*modules) -> int:
    """Bytes of the distinct storages behind the modules' parameters (an FSDP2 parameter: its
    local shard; a tied weight counted once)."""
    seen, total = set(), 0
    for module in modules:
        if module is None:
            continue
        for p in module.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _rank(rank: int, world: int, store: str, out: str, shape: str, layout: str, new_tokens: int):
    from groupflow.batch import Batch
    from groupflow.config import ActorConfig
    from groupflow.rollout.engines.hf import SamplingParams
    from groupflow.workers.actor import ActorRolloutWorker
    from groupflow.workers.update import batch_logprobs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        _trim()
        base = _kb("VmRSS")
        model = _model(shape)
        old = layout == "old"
        cfg = ActorConfig(kl_coef=0.1, lr=1e-5, generation_weights="copy" if old else "gather")
        # old: the reference as the actor kept it before, a full unsharded copy on every rank
        ref = copy.deepcopy(model).eval().requires_grad_(False) if old else None
        worker = ActorRolloutWorker(
            model, None, cfg, total_steps=10, pad_id=PAD, eos_ids=[EOS], rank=rank,
            world_size=world, reference=not old,
        )  # fmt: skip
        ref_root = worker.reference.root if worker.reference is not None else None
        held = _storage_bytes(worker.policy, ref_root or ref, worker.rollout_model)
        _trim()
        resident = _kb("VmRSS") - base
        g = torch.Generator().manual_seed(rank)
        vocab = SHAPES[shape]["vocab_size"]
        prompts = Batch(
            {"group_ids": torch.arange(PROMPTS_PER_RANK)},
            {
                "prompt_token_ids": torch.randint(3, vocab, (PROMPTS_PER_RANK, PROMPT_LEN),
                                                  generator=g).tolist(),
                "seeds": [[100 * rank + 10 * i + j for j in range(SAMPLES)]
                          for i in range(PROMPTS_PER_RANK)],
            },
        )  # fmt: skip
        params = SamplingParams(n=SAMPLES, max_new_tokens=new_tokens)
        seconds, peaks = {}, {}

        def begin():
            _trim()
            with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark
                f.write("5")
            return time.perf_counter()

        def end(call, start):
            seconds[call] = time.perf_counter() - start
            peaks[call] = (_kb("VmHWM") - base) * 1024

        start = begin()
        batch = worker.generate(prompts, params)
        end("generate", start)
        start = begin()
        if old:  # the unsharded copies, as compute_logprobs used them
            ref_lp = batch_logprobs(ref, batch, 1.0, cfg, worker.device)["logprobs"]
            old_lp = batch_logprobs(worker.rollout_model, batch, 1.0, cfg, worker.device)
        else:
            ref_lp = worker.compute_logprobs(batch, temperature=1.0, reference=True)["logprobs"]
            old_lp = worker.compute_logprobs(batch, temperature=1.0)
        end("logprobs", start)
        batch["ref_logprobs"] = ref_lp
        batch["old_logprobs"] = old_lp["logprobs"]
        batch["advantages"] = torch.randn(len(batch), generator=g)
        start = begin()
        worker.update(batch, temperature=1.0)
        end("update", start)
        mine = {"held": held, "resident": resident * 1024, "peak": max(peaks.values()),
                "peaks": peaks, "seconds": seconds, "tokens": batch["responses"]}  # fmt: skip
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            torch.save(gathered, out)
        dist.barrier()  # neither rank tears gloo down while its peer still talks
    finally:
        dist.destroy_process_group()


def measure(shape: str, layout: str, new_tokens: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pt")
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), out, shape, layout, new_tokens),
                 nprocs=2)  # fmt: skip
        return torch.load(out, weights_only=False)


def columns(shape: str, old: list[dict], new: list[dict]) -> tuple[dict[str, dict], bool]:
    """One model's old / new / new-over-old per measure (the larger rank's, as ``report`` prints),
    and whether both layouts sampled the same tokens."""
    out: dict[str, dict] = {}
    measures = [(key, label, lambda r, k=key: r[k], 2**20) for key, label in
                (("held", "weights held MiB"), ("resident", "resident after build MiB"),
                 ("peak", "peak in a step MiB"))]  # fmt: skip
    measures += [(c, f"peak in {c} MiB", lambda r, c=c: r["peaks"][c], 2**20)
                 for c in ("generate", "logprobs", "update")]  # fmt: skip
    measures += [(c, f"{c} s", lambda r, c=c: r["seconds"][c], 1)
                 for c in ("generate", "logprobs", "update")]  # fmt: skip
    for _, label, get, scale in measures:
        label = label.replace("logprobs", "log-probs")
        o, n = max(get(r) for r in old) / scale, max(get(r) for r in new) / scale
        out[label] = {f"{shape} old": round(o, 2 if scale == 1 else 1),
                      f"{shape} new": round(n, 2 if scale == 1 else 1),
                      f"{shape} new/old": round(n / o, 2)}  # fmt: skip
    same = all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(old, new))
    return out, same


def write_rank_results(args, measured: dict[str, tuple[dict[str, dict], bool]]) -> None:
    """The measured rows as a results file (``groupflow.utils.results``) the docs render."""
    from pathlib import Path

    from groupflow.utils.results import write_results

    labels = list(next(iter(measured.values()))[0])
    rows = [{"per rank (max of the 2)": label,
             **{k: v for cols, _ in measured.values() for k, v in cols[label].items()}}
            for label in labels]  # fmt: skip
    shape = "smollm2" if "smollm2" in measured else next(iter(measured))
    held = measured[shape][0]["weights held MiB"]
    same = all(s for _, s in measured.values())
    write_results(
        args.results, name=Path(args.results).stem, rows=rows,
        command=f"python benchmarks/bench_rank_memory.py --models {' '.join(measured)} "
                f"--new-tokens {args.new_tokens} --results {args.results}",
        summary={
            "recipe": "benchmarks/bench_rank_memory.py: 2 gloo ranks, one rollout step's worker "
                      "calls",
            "what": "per-rank memory of a sharded actor, old layout (full reference + generation "
                    "copy) vs sharded",
            "before": f"old: {held[f'{shape} old']} MiB of weights held per rank ({shape})",
            "after": f"sharded: {held[f'{shape} new']} MiB ({held[f'{shape} new/old']})",
            "guide": "docs/benchmarks/memory.md",
        },
        notes="smollm2: the SmolLM2-135M shape (random weights); medium: the 2.7M-parameter "
              f"Llama. actor.kl_coef 0.1, {PROMPTS_PER_RANK} prompts × {SAMPLES} samples per "
              f"rank, {PROMPT_LEN}-token prompts, {args.new_tokens} new tokens; one thread per "
              "rank. Memory above the RSS before the model was built; peaks are VmHWM, reset "
              "before each call. Both layouts sampled the same tokens: "
              f"{'yes' if same else 'NO'}.",
    )  # fmt: skip
    print(f"results: {args.results}")


def report(shape: str, old: list[dict], new: list[dict]) -> None:
    params = sum(p.numel() for p in _model(shape).parameters())
    print(f"\n{shape}: {params / 1e6:.1f}M parameters (fp32 {params * 4 / 2**20:.0f} MiB), 2 ranks")
    print(f"  {'per rank (max of 2)':<26}{'old':>12}{'new':>12}{'new/old':>10}")
    for key, label in (("held", "weights held MiB"), ("resident", "resident MiB"),
                       ("peak", "peak in a step MiB")):  # fmt: skip
        o, n = max(r[key] for r in old) / 2**20, max(r[key] for r in new) / 2**20
        print(f"  {label:<26}{o:>12.1f}{n:>12.1f}{n / o:>10.2f}")
    for call in ("generate", "logprobs", "update"):
        o = max(r["peaks"][call] for r in old) / 2**20
        n = max(r["peaks"][call] for r in new) / 2**20
        print(f"  {'  peak in ' + call + ' MiB':<26}{o:>12.1f}{n:>12.1f}{n / o:>10.2f}")
    for call in ("generate", "logprobs", "update"):
        o = max(r["seconds"][call] for r in old)
        n = max(r["seconds"][call] for r in new)
        print(f"  {call + ' s':<26}{o:>12.2f}{n:>12.2f}{n / o:>10.2f}")
    same = all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(old, new))
    print(f"  same sampled tokens: {'yes' if same else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["medium", "smollm2"], choices=SHAPES)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--results", help="also write the rows as a results file")
    args = parser.parse_args()
    measured = {}
    for shape in args.models:
        old = measure(shape, "old", args.new_tokens)
        new = measure(shape, "new", args.new_tokens)
        report(shape, old, new)
        measured[shape] = columns(shape, old, new)
    if args.results:
        write_rank_results(args, measured)


if __name__ == "__main__":
    main()
