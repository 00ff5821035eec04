"""Peak memory per worker of the diffusion policy: replicated vs FSDP2-sharded, side by side.

One run of each layout through the real path (Trainer, Ray workers, a random WanTransformer3DModel
built here), 2 workers each, one torch thread per worker; each trains ``--steps`` steps and then
reports, per worker, its model-state bytes (parameters, gradients, AdamW state: the local shards
when sharded), its process's peak resident memory once the model was built and loaded
(``load_peak_rss``: a sharded worker builds on the meta device and reads only its rows) and at the
end (``peak_rss``). Printed: both layouts and their ratios.

    .venv/bin/python benchmarks/diffusion_fsdp_memory.py              # 8 blocks of width 512
    .venv/bin/python benchmarks/diffusion_fsdp_memory.py --layers 4 --checkpointing
    .venv/bin/python benchmarks/diffusion_fsdp_memory.py --width 1024 --load-only [--lora]

``--load-only``: just the load, in 2 gloo processes each: build the full model and shard it (the
replicated path's load, then FSDP2) vs build on the meta device, shard and read only the rank's
rows — each process's peak resident memory (VmHWM) after loading. ``--lora``: with LoRA adapters
(rank 64 on the attention projections, as the MMDanceGRPO recipe) injected before sharding.

``--results PATH``: the rows (or with ``--load-only`` the load's rows) as a results file
(``groupflow.utils.results``) that the docs render.

Resident memory includes each process's fixed cost (Python, torch, Ray: several hundred MB), so
its ratio understates the model-state one; on GPUs the model state is what FSDP divides.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_model(path: Path, layers: int, width: int) -> Path:
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    heads = width // 64
    WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=64, in_channels=16,
        out_channels=16, text_dim=64, freq_dim=64, ffn_dim=4 * width, num_layers=layers,
        rope_max_seq_len=64,
    ).save_pretrained(path)  # fmt: skip
    return path


def run(root: Path, model: Path, prompts: Path, fsdp: bool, steps: int, checkpointing: bool):
    from groupflow.config import config_from_dict
    from groupflow.trainer import Trainer

    cfg = config_from_dict({
        "run": {"name": f"fsdp_{fsdp}", "output_dir": str(root), "seed": 0, "total_steps": steps,
                "loggers": [], "num_threads": 1, "backend": "ray", "num_workers": 2,
                "save_final": False},
        "diffusion": {"model": {"kind": "wan", "path": str(model), "latent_shape": [16, 3, 16, 16]},
                      "num_steps": 4, "timestep_fraction": 0.5, "eval_samples_per_prompt": 1,
                      "fsdp": fsdp, "activation_checkpointing": checkpointing, "save_images": False},
        "data": {"train_files": [str(prompts)], "prompts_per_step": 2},
        "rollout": {"samples_per_prompt": 2},
        "actor": {"lr": 1e-5},
        "reward": {"functions": [{"name": "brightness"}]},
    })  # fmt: skip
    trainer = Trainer(cfg)
    try:
        trainer.fit()
        return trainer.policy.actor.memory_stats()
    finally:
        trainer.shutdown()


LORA = {"rank": 64, "alpha": 128, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}


def _load_rank(
    rank: int, world: int, store: str, model: str, meta: bool, out: str, lora: bool
) -> None:
    import torch
    import torch.distributed as dist

    from groupflow.diffusion.sharding import flow_layers, materialise_shards, peak_rss_bytes
    from groupflow.distributed.parallel import shard
    from groupflow.policies.diffusion import FlowModelSpec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    before = peak_rss_bytes()
    flow = FlowModelSpec("wan", model, [16, 3, 16, 16]).build(empty=meta)
    if lora:
        from groupflow.diffusion.build import lora_adapters

        lora_adapters(flow, LORA)
    shard(flow, flow_layers(flow))
    if meta:
        materialise_shards(flow, model, torch.device("cpu"))
    else:  # what every worker did before: touch the full weights, then keep its shard
        for p in flow.parameters():
            p.to_local().sum()
    Path(out.format(rank)).write_text(json.dumps({"before": before, "after": peak_rss_bytes()}))
    dist.destroy_process_group()


def load_only(root: Path, model: Path, lora: bool) -> dict[str, list[dict]]:
    import torch.multiprocessing as mp

    rows = {}
    for name, meta in (("full build, then shard", False), ("meta build, read rows", True)):
        out = str(root / f"{meta}_{{}}.json")  # one file per rank
        args = (2, str(root / f"store_{meta}"), str(model), meta, out, lora)
        mp.spawn(_load_rank, args=args, nprocs=2)
        rows[name] = [json.loads(Path(out.format(r)).read_text()) for r in range(2)]
    return rows


STATE_COLUMNS = {"param_bytes": "parameters MiB", "grad_bytes": "gradients MiB",
                 "optimizer_bytes": "AdamW state MiB", "load_peak_rss_bytes": "load peak RSS MiB",
                 "peak_rss_bytes": "peak RSS MiB"}  # fmt: skip


def _flags(args) -> str:
    flags = [f"--layers {args.layers}", f"--width {args.width}"]
    if args.load_only:
        flags += ["--load-only", *(["--lora"] if args.lora else [])]
    else:
        flags += [f"--steps {args.steps}", *(["--checkpointing"] if args.checkpointing else [])]
    return " ".join(flags)


def write_memory_results(args, peak: dict[str, dict[str, int]]) -> None:
    """The training rows (max over the workers) as a results file the docs render."""
    from groupflow.utils.results import write_results

    mib, params = 2**20, peak["replicated"]["param_bytes"] / 4  # fp32, every worker holds all

    def row(layout, values):
        return {"layout": layout, **{STATE_COLUMNS[k]: v for k, v in values.items()}}

    rows = [
        row(f"replicated (width {args.width}, {params / 1e6:.3g}M params)",
            {k: round(v / mib, 1) for k, v in peak["replicated"].items()}),
        row("FSDP2 (diffusion.fsdp: true)", {k: round(v / mib, 1) for k, v in peak["fsdp"].items()}),
        row("FSDP2 / replicated", {k: round(peak["fsdp"][k] / max(peak["replicated"][k], 1), 2)
                                   for k in STATE_COLUMNS}),
    ]  # fmt: skip
    state = {n: sum(p[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")) / mib
             for n, p in peak.items()}  # fmt: skip
    write_results(
        args.results, name=Path(args.results).stem, rows=rows,
        command=f"python benchmarks/diffusion_fsdp_memory.py {_flags(args)} --results {args.results}",
        summary={
            "recipe": f"benchmarks/diffusion_fsdp_memory.py: {args.layers} Wan blocks, width "
                      f"{args.width}, 2 workers",
            "what": "model state and peak resident memory per worker, replicated vs FSDP2",
            "before": f"replicated: {state['replicated']:.1f} MiB of model state, peak RSS "
                      f"{peak['replicated']['peak_rss_bytes'] / mib:.0f} MiB",
            "after": f"FSDP2: {state['fsdp']:.1f} MiB of model state, peak RSS "
                     f"{peak['fsdp']['peak_rss_bytes'] / mib:.0f} MiB",
            "guide": "docs/benchmarks/memory.md",
        },
        notes=f"Per worker, the larger of the 2. Trainer on Ray, 2 workers, one torch thread each; "
              f"a random WanTransformer3DModel with {args.layers} blocks, latents 16×3×16×16, "
              f"{args.steps} training step(s){', activation checkpointing' * args.checkpointing}. "
              "Model state: the local shards when sharded. load peak RSS: the process's peak "
              "resident memory once the model was built and loaded; peak RSS: at the end (Linux "
              "VmHWM).",
    )  # fmt: skip
    print(f"results: {args.results}")


def write_load_results(args, loads: dict[str, list[dict]]) -> None:
    """The ``--load-only`` rows (peak RSS per rank after loading) as a results file."""
    from groupflow.utils.results import write_results

    mib, lora = 2**20, " (LoRA r64)" if args.lora else ""
    rows = [{"load": name + lora, **{f"rank {i} MiB": round(r["after"] / mib)
                                     for i, r in enumerate(ranks)}}
            for name, ranks in loads.items()]  # fmt: skip
    full, meta = (rows[0], rows[1])
    write_results(
        args.results, name=Path(args.results).stem, rows=rows,
        command=f"python benchmarks/diffusion_fsdp_memory.py {_flags(args)} --results {args.results}",
        summary={
            "recipe": f"benchmarks/diffusion_fsdp_memory.py --width {args.width} --load-only"
                      + " --lora" * args.lora,
            "what": "peak resident memory per rank after loading a sharded Wan transformer"
                    + " with LoRA" * args.lora,
            "before": f"full build, then shard: {full['rank 0 MiB']} / {full['rank 1 MiB']} MiB "
                      "(ranks 0 / 1)",
            "after": f"meta build + the rank's rows: {meta['rank 0 MiB']} / {meta['rank 1 MiB']} MiB",
            "guide": "docs/benchmarks/memory.md",
        },
        notes=f"2 gloo processes, {args.layers} blocks × width {args.width}, one torch thread "
              "each; each process's peak resident memory (VmHWM) after loading, from "
              + " / ".join(f"{r['before'] / mib:.0f}" for r in loads["meta build, read rows"])
              + " MiB after the imports"
              + (". LoRA rank 64 on to_q/to_k/to_v/to_out.0 (the MMDanceGRPO recipe's adapters)."
                 if args.lora else "."),
    )  # fmt: skip
    print(f"results: {args.results}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--load-only", action="store_true")
    ap.add_argument("--lora", action="store_true", help="--load-only with LoRA adapters")
    ap.add_argument("--results", help="also write the rows as a results file (benchmarks/results/)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_model(root / "wan", args.layers, args.width)
        if args.load_only:
            lora = " with LoRA r64" if args.lora else ""
            print(
                f"{args.layers} blocks x width {args.width}{lora}: peak RSS per rank after "
                "loading, MiB"
            )
            loads = load_only(root, model, args.lora)
            for name, ranks in loads.items():
                print(f"{name:26s}" + "".join(
                    f"  rank {i}: {r['before'] / mib:6.0f} -> {r['after'] / mib:6.0f}"
                    for i, r in enumerate(ranks)
                ))  # fmt: skip
            if args.results:
                write_load_results(args, loads)
            return 0
        prompts = root / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a", "b")))
        rows = {
            "replicated": run(root, model, prompts, False, args.steps, args.checkpointing),
            "fsdp": run(root, model, prompts, True, args.steps, args.checkpointing),
        }
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes", "load_peak_rss_bytes", "peak_rss_bytes")
    print(f"{args.layers} blocks x width {args.width}, 2 workers, {os.cpu_count()} CPUs")
    print(f"{'per worker (max over ranks), MiB':34s}" + "".join(f"{k[:-6]:>15s}" for k in keys))
    peak = {name: {k: max(r[k] for r in rs) for k in keys} for name, rs in rows.items()}
    for name, p in peak.items():
        print(f"{name:34s}" + "".join(f"{p[k] / mib:15.1f}" for k in keys))
    print(
        f"{'fsdp / replicated':34s}"
        + "".join(f"{peak['fsdp'][k] / max(peak['replicated'][k], 1):15.2f}" for k in keys)
    )
    state = ("param_bytes", "grad_bytes", "optimizer_bytes")
    total = {n: sum(p[k] for k in state) for n, p in peak.items()}
    print(f"model state: {total['replicated'] / mib:.1f} -> {total['fsdp'] / mib:.1f} MiB per "
          f"worker ({total['fsdp'] / total['replicated']:.2f}x)")  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": None}, "rows": rows}, indent=2)
        )
    if args.results:
        write_memory_results(args, peak)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
