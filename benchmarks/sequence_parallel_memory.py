"""Activation memory per rank with Ulysses sequence parallelism (SP = 1 vs 2), the actor's FSDP2
CPU offload, and — on paper from these — the longest sequence an 80 GB GPU trains.

LLM: one row of ``--tokens`` tokens (a quarter prompt, the rest response) through a Llama-style
model with grouped-query attention; forward and backward of the response log-probs (the actor's
training forward): SP = 1 in one process (``response_logprobs``), SP = 2 in two gloo processes
(``sequence_parallel_logprobs``), one torch thread each. Per rank: the bytes autograd keeps for
backward (``saved_tensors_hooks``, each storage once, parameters excluded) — the activation
memory — and the peak resident memory the step adds (VmHWM after the step minus VmRSS before it,
the high-water mark reset first). Printed side by side with their ratios.

Offload: the actor's policy, FSDP2-sharded over 2 gloo ranks with and without
``actor.cpu_offload``: per rank, the bytes of parameter shards, gradients and AdamW state and the
device they are on after one update. On this CPU machine host and compute device are the same
memory, so the measured effect is where FSDP2 placed them and the time; the device memory it
frees on a GPU is these bytes (printed), minus the unsharded layer FSDP2 copies in to compute.

Diffusion: a tiny WanTransformer3DModel on a latent video (9 × 48 × 48, 5184 tokens), forward and
backward, SP = 1 vs 2 (``groupflow.diffusion.sequence_parallel``): saved bytes and peak RSS per
rank, as for the LLM, and its saved bytes per token and layer to scale to Wan2.2-5B on paper.

On paper: saved bytes per token, layer and hidden unit measured here, scaled to a 7B Llama
(H 4096, 32 layers) and to Wan2.2-5B (H 3072, 30 layers) in bf16, with and without activation
checkpointing, beside their model state (16 B per parameter: fp32 weights, gradients, AdamW
moments) sharded by FSDP2 over 8 GPUs or offloaded; the longest sequence is what fits 80 GB.

``--results PATH``: the measured rows as a results file (``groupflow.utils.results``) that the
docs render, and beside it ``<stem>_offload.json`` (unless ``--skip-offload``) and
``<stem>_on_paper.json`` (the on-paper table, computed from this run's bytes per token).

    .venv/bin/python benchmarks/sequence_parallel_memory.py               # 4096 tokens
    .venv/bin/python benchmarks/sequence_parallel_memory.py --tokens 8192 --hidden 512
    .venv/bin/python benchmarks/sequence_parallel_memory.py \
        --results benchmarks/results/sequence_parallel.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

GIB = 2**30


def _status(key: str) -> int:
    """A /proc/self/status entry in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    try:  # "5" resets the resident high-water mark (Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def saved_bytes(fn, params) -> tuple[object, int]:
    """``fn()``'s result and the bytes autograd saved for its backward (parameters excluded)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def llm(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2, max_position_embeddings=args.tokens,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def llm_row(args):
    g = torch.Generator().manual_seed(1)
    p = args.tokens // 4
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=g)
    return ids[:, :p], torch.ones(1, p, dtype=torch.long), ids[:, p:], torch.ones_like(ids[:, p:])


def llm_step(args, sp=None) -> dict:
    from groupflow.models.logprobs import response_logprobs
    from groupflow.models.sequence_parallel import sequence_parallel_logprobs

    model = llm(args).train()
    rows = llm_row(args)

    def forward():
        if sp is None:
            return response_logprobs(model, *rows, share_prompt=False)[0]
        return sequence_parallel_logprobs(model, *rows, sp)[0]

    before = _status("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    logp, saved = saved_bytes(forward, list(model.parameters()))
    logp.sum().backward()
    return {"saved": saved, "rss": _status("VmHWM") - before, "s": time.perf_counter() - start}


def offload_step(cpu_offload: bool, rank: int, world: int) -> dict:
    from groupflow.batch import Batch
    from groupflow.config import ActorConfig
    from groupflow.models.causal_lm import build_tiny_llama
    from groupflow.workers.actor import ActorRolloutWorker

    model = build_tiny_llama(512, hidden_size=256, num_layers=4, num_heads=8, max_positions=256)
    worker = ActorRolloutWorker(
        model, None, ActorConfig(lr=1e-4, cpu_offload=cpu_offload), total_steps=1, pad_id=0,
        eos_ids=[1], rank=rank, world_size=world,
    )  # fmt: skip
    g = torch.Generator().manual_seed(rank)
    n, p, t = 4, 32, 96
    batch = Batch({
        "prompt_ids": torch.randint(2, 512, (n, p), generator=g),
        "prompt_mask": torch.ones(n, p, dtype=torch.long),
        "responses": torch.randint(2, 512, (n, t), generator=g),
        "response_mask": torch.ones(n, t, dtype=torch.long),
        "old_logprobs": torch.full((n, t), -6.0), "advantages": torch.randn(n, generator=g),
    })  # fmt: skip
    start = time.perf_counter()
    worker.update(batch, temperature=1.0)
    seconds = time.perf_counter() - start
    params = [p for p in worker.policy.parameters()]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
    state = [v for s in worker.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    state = [v.to_local() if hasattr(v, "to_local") else v for v in state]
    layer = max(sum(p.numel() for p in m.parameters()) for m in worker.model.model.layers)
    return {
        "param_bytes": sum(x.numel() * x.element_size() for x in local),
        "grad_bytes": sum(x.numel() * x.element_size() for x in grads),
        "adam_bytes": sum(x.numel() * x.element_size() for x in state if x.dim() > 0),
        "devices": sorted({str(x.device) for x in local + grads + state}),
        "layer_unsharded_bytes": layer * 4,
        "s": seconds,
    }


def _rank(rank: int, world: int, store: str, out: str, args, job: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        if job in ("llm", "wan"):  # one rank: SP = 1, in a fresh process like the SP = 2 ranks
            from groupflow.distributed.ulysses import sequence_groups

            sp = sequence_groups(rank, world, world) if world > 1 else None
            result = llm_step(args, sp) if job == "llm" else wan_step(sp)
        else:
            result = offload_step(job == "offload", rank, world)
        Path(f"{out}.{rank}").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def spawn(args, job: str, world: int = 2) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/out"
        mp.spawn(_rank, args=(world, f"{tmp}/store", out, args, job), nprocs=world)
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


def wan_step(sp=None, layers: int = 2, width: int = 256) -> dict:
    """A tiny Wan transformer's forward and backward on one latent video (9 × 24 × 24 tokens)."""
    from diffusers import WanTransformer3DModel

    from groupflow.diffusion.sequence_parallel import enable_ulysses

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=width // 64, attention_head_dim=64,
        in_channels=16, out_channels=16, text_dim=64, freq_dim=64, ffn_dim=int(width * 4.67),
        num_layers=layers, rope_max_seq_len=64,
    ).train()  # fmt: skip
    if sp is not None:
        enable_ulysses(model, sp)
    frames, h, w = 9, 48, 48
    x = torch.randn(1, 16, frames, h, w)
    text = torch.randn(1, 16, 64)

    def forward():
        return model(x, timestep=torch.tensor([500.0]), encoder_hidden_states=text).sample

    before = _status("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    out, saved = saved_bytes(forward, list(model.parameters()))
    out.sum().backward()
    tokens = frames * (h // 2) * (w // 2)
    return {"saved": saved, "rss": _status("VmHWM") - before, "s": time.perf_counter() - start,
            "unit": saved / (tokens * layers * width), "tokens": tokens}  # fmt: skip


def _tokens(n: float) -> str:
    """A sequence length as the table writes it: 11k, 559k, 1.1M."""
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1000:.0f}k"


def on_paper(per_unit_llm: float, per_unit_wan: float) -> list[dict]:
    """Longest sequence on an 80 GB GPU: (80 GB - state - reserve) · SP / activation bytes per
    token; printed, and returned as the results file's rows."""
    models = {  # name: (parameters, hidden, layers, saved bytes per token·layer·hidden in fp32)
        "7B LM (Llama-2-7B shape)": (6.74e9, 4096, 32, per_unit_llm),
        "Wan2.2-5B transformer": (5.0e9, 3072, 30, per_unit_wan),
    }
    gpus, reserve = 8, 6 * GIB  # FSDP2 over 8 GPUs; CUDA context, allocator slack, logits chunks
    print("\nOn paper (bf16 activations, FSDP2 over 8 GPUs, 6 GiB reserve; tokens per sequence):")
    print(
        f"{'model':<26} {'state':<9} {'ckpt':<5} "
        + " ".join(f"{'SP=' + str(n):>9}" for n in (1, 2, 4, 8))
    )
    rows = []
    for name, (params, hidden, layers, unit) in models.items():
        full = unit / 2 * hidden * layers  # bytes per token, bf16, all layers kept
        checkpointed = 2 * hidden * layers + unit / 2 * hidden  # layer inputs + one layer live
        layer_bytes = 4 * params / layers
        for state_name, state in (("sharded", 16 * params / gpus), ("offload", 2 * layer_bytes)):
            for ckpt, per_token in (("no", full), ("yes", checkpointed)):
                free = 80e9 - state - reserve
                cells = [f"{max(0, free) * n / per_token / 1000:>8.0f}k" for n in (1, 2, 4, 8)]
                print(f"{name:<26} {state_name:<9} {ckpt:<5} " + " ".join(cells))
                rows.append({"model": name, "model state": {"offload": "offloaded"}.get(state_name, state_name),
                             "activation checkpointing": ckpt,
                             **{f"SP = {n}": _tokens(max(0, free) * n / per_token) for n in (1, 2, 4, 8)}})  # fmt: skip
    print(
        "  state: sharded = 16 B/param / 8 GPUs on the device; offload = in host memory, the device"
        "\n  holding one unsharded fp32 layer and its gradient. A Wan2.2-5B 720p clip (1280x704,"
        "\n  121 frames) is 31 x 22 x 40 = 27.3k latent tokens; attention is assumed flash (O(S)), as"
        "\n  the CPU kernel measured here is. Memory only: at 1M tokens attention's compute, not"
        "\n  memory, is the limit; the LLM actor's colocated full rollout copy (generation) and the"
        "\n  diffusion reference copy are not counted (a rollout pool or LoRA removes them)."
    )
    return rows


def table(one: dict, two: list[dict]) -> None:
    """SP = 1 against each SP = 2 rank; ratio: the larger rank over SP = 1 (time: two processes
    sharing this machine's cores, so only a rough figure)."""
    print(f"{'':<30}{'SP=1':>12}{'SP=2 rank0':>12}{'SP=2 rank1':>12}{'ratio':>8}")
    for key, label, scale in (("saved", "activations saved (MiB)", 2**20),
                              ("rss", "peak RSS added (MiB)", 2**20), ("s", "time (s)", 1)):  # fmt: skip
        worst = max(r[key] for r in two)
        print(f"{label:<30}{one[key] / scale:>12.1f}{two[0][key] / scale:>12.1f}"
              f"{two[1][key] / scale:>12.1f}{worst / max(one[key], 1e-9):>8.2f}")  # fmt: skip


def sp_rows(name: str, one: dict, two: list[dict]) -> list[dict]:
    """The measured rows (as ``table`` prints them) of one model: SP = 1 against SP = 2 per rank."""
    rows = []
    for key, label in (("saved", "activations saved MiB"), ("rss", "peak RSS added MiB")):
        lo, hi = (f(r[key] for r in two) / 2**20 for f in (min, max))
        per_rank = round(hi, 1) if round(lo, 1) == round(hi, 1) else f"{lo:.1f}–{hi:.1f}"
        rows.append({"model": name, "measure": label, "SP = 1": round(one[key] / 2**20, 1),
                     "SP = 2 per rank": per_rank, "ratio": round(hi * 2**20 / max(one[key], 1e-9), 2)})  # fmt: skip
    return rows


def write_sp_results(args, rows: list[dict], offload: tuple[dict, dict] | None,
                     paper: list[dict]) -> None:  # fmt: skip
    """The measured rows, the offload rows and the on-paper table as results files
    (``groupflow.utils.results``) the docs render: ``--results`` and two files beside it."""
    from groupflow.utils.results import write_results

    path = Path(args.results)
    flags = [f"--tokens {args.tokens}", f"--hidden {args.hidden}", f"--layers {args.layers}",
             f"--heads {args.heads}", f"--vocab {args.vocab}",
             *(["--skip-offload"] if args.skip_offload else [])]  # fmt: skip
    command = f"python benchmarks/sequence_parallel_memory.py {' '.join(flags)} --results {path}"
    guide = "docs/benchmarks/memory.md"
    llm = rows[0]
    write_results(
        path, name=path.stem, command=command, rows=rows,
        summary={"recipe": "benchmarks/sequence_parallel_memory.py: one long row / latent video, "
                           "forward + backward",
                 "what": "activation memory per rank, Ulysses SP = 1 vs SP = 2",
                 "before": f"SP = 1: {llm['SP = 1']} MiB of activations ({args.tokens}-token LLM row)",
                 "after": f"SP = 2: {llm['SP = 2 per rank']} MiB per rank ({llm['ratio']})",
                 "guide": guide},
        notes="One torch thread per rank; SP = 1 in one process, SP = 2 in two gloo processes. "
              "Activations saved: the bytes autograd keeps for backward (each storage once, "
              "parameters excluded); peak RSS added: VmHWM after the step minus VmRSS before it. "
              "ratio: the larger SP = 2 rank over SP = 1.",
    )  # fmt: skip
    print(f"results: {path}")
    if offload is not None:
        plain, _ = offload
        state = plain["param_bytes"] + plain["grad_bytes"] + plain["adam_bytes"]
        kept = 2 * plain["layer_unsharded_bytes"]
        side = path.with_name(f"{path.stem}_offload.json")
        write_results(
            side, name=side.stem, command=command,
            rows=[{"measure": "parameter shard + gradient + AdamW state, per rank (moved to host "
                              "by offload)", "MiB": round(state / 2**20, 1)},
                  {"measure": "left on the device with offload: one unsharded layer and its "
                              "gradient", "MiB": round(kept / 2**20, 1)}],
            summary={"recipe": "benchmarks/sequence_parallel_memory.py: the actor's update on 2 "
                               "FSDP2 ranks",
                     "what": "per-rank model state that actor.cpu_offload moves to host memory",
                     "before": f"{state / 2**20:.0f} MiB of model state per rank on the device",
                     "after": f"{kept / 2**20:.0f} MiB (one unsharded layer and its gradient)",
                     "guide": guide},
            notes="A Llama-style actor (hidden 256, 4 layers) FSDP2-sharded over 2 gloo ranks, "
                  "with and without actor.cpu_offload, after one update. On this CPU host and "
                  "device are the same memory, so what is measured is where FSDP2 placed the "
                  "bytes; on a GPU these bytes are the device memory offload frees.",
        )  # fmt: skip
        print(f"results: {side}")
    side = path.with_name(f"{path.stem}_on_paper.json")
    first = paper[0]
    write_results(
        side, name=side.stem, command=command, rows=paper,
        summary={"recipe": "benchmarks/sequence_parallel_memory.py: on paper from the measured "
                           "bytes per token",
                 "what": "the longest sequence an 80 GB GPU trains (tokens), 7B LM and Wan2.2-5B",
                 "before": f"7B LM, sharded, no checkpointing: {first['SP = 1']} tokens at SP = 1",
                 "after": f"{first['SP = 8']} at SP = 8; {paper[1]['SP = 8']} with activation "
                          "checkpointing",
                 "guide": guide},
        notes="Computed, not measured on a GPU: the activation bytes per token, layer and hidden "
              "unit measured on the CPU (SP = 1, fp32) halved for bf16 and scaled to a 7B Llama "
              "(hidden 4096, 32 layers) and Wan2.2-5B (hidden 3072, 30 layers); with "
              "checkpointing, the layer inputs plus one layer live. Model state 16 B per "
              "parameter (fp32 weights, gradients, AdamW moments), sharded by FSDP2 over 8 GPUs "
              "or offloaded (the device holding one unsharded fp32 layer and its gradient); 6 GiB "
              "reserve. Memory only: attention's compute at long lengths and the LLM actor's "
              "colocated full-weight rollout copy are not counted.",
    )  # fmt: skip
    print(f"results: {side}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--skip-offload", action="store_true")
    ap.add_argument("--results", help="also write the rows as results files (benchmarks/results/)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    print(f"LLM: {args.tokens} tokens, hidden {args.hidden}, {args.layers} layers, "
          f"{args.heads} heads / {args.heads // 2} K/V, vocab {args.vocab}; forward + backward")  # fmt: skip
    one, two = spawn(args, "llm", world=1)[0], spawn(args, "llm")
    table(one, two)
    per_unit = one["saved"] / (args.tokens * args.layers * args.hidden)
    print(f"saved bytes per token·layer·hidden unit (fp32, SP=1): {per_unit:.1f}")
    rows = sp_rows(f"Llama, {args.layers} layers, {args.hidden} wide (GQA), one "
                   f"{args.tokens}-token row", one, two)  # fmt: skip
    measured_offload = None

    if not args.skip_offload:
        print("\nActor update on 2 FSDP2 ranks (hidden 256, 4 layers): per-rank model state")
        plain, offload = spawn(args, "plain")[0], spawn(args, "offload")[0]
        for key in ("param_bytes", "grad_bytes", "adam_bytes", "layer_unsharded_bytes"):
            print(f"  {key:<24}{plain[key] / 2**20:>9.2f} MiB {offload[key] / 2**20:>9.2f} MiB")
        print(f"  devices: without {plain['devices']}, with offload {offload['devices']}; "
              f"update {plain['s']:.2f} s vs {offload['s']:.2f} s (x{offload['s'] / plain['s']:.2f})")  # fmt: skip
        measured_offload = (plain, offload)
        state = plain["param_bytes"] + plain["grad_bytes"] + plain["adam_bytes"]
        print(f"  on a GPU, offload moves {state / 2**20:.2f} MiB per rank to host memory; the device "
              f"keeps ~{2 * plain['layer_unsharded_bytes'] / 2**20:.2f} MiB (one layer + gradient)")  # fmt: skip

    wan_one, wan_two = spawn(args, "wan", world=1)[0], spawn(args, "wan")
    print(
        f"\nTiny Wan (hidden 256, 2 layers, {wan_one['tokens']} latent tokens); forward + backward"
    )
    table(wan_one, wan_two)
    print(f"saved bytes per token·layer·hidden unit (fp32, SP=1): {wan_one['unit']:.1f}")
    rows += sp_rows(f"tiny Wan, 2 layers, 256 wide, a 9 × 48 × 48 latent video "
                    f"({wan_one['tokens']} tokens)", wan_one, wan_two)  # fmt: skip
    paper = on_paper(per_unit, wan_one["unit"])
    if args.results:
        write_sp_results(args, rows, measured_offload, paper)


if __name__ == "__main__":
    main()
