"""Rollout and training-forward speed paths on one device: static vs dynamic KV cache, the
sampler, the decode's attention and LM-head kernels, and the shared-prompt forward — each timed
against its alternative in one run.

Methodology: every comparison runs both variants on the same model and inputs, alternating, and
reports medians of 3 (5 for the sampler) after one warm-up; tokens and log-probs of the two
decode variants are compared too (identical on CPU; on a GPU different attention kernels differ
by ~1e-6 in fp32, which can flip a sampled token of a near-flat random-init distribution, after
which the samples diverge). Models are randomly initialised from configs (no downloads): the
2.7M-parameter "medium" Llama of bench_trl.py, a SmolLM2-135M-shaped Llama (30 layers, GQA 9/3,
49k vocabulary) and a tiny Qwen3. Meant for a GPU (``--device cuda``); on a CPU use ``--small``.

    python benchmarks/decode_paths.py --device cuda
    python benchmarks/decode_paths.py --device cpu --small

``--results PATH`` also writes the rows (one per comparison: path, old, new, ratio, check) as a
results file (``groupflow.utils.results``) that the docs render.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import shlex
import sys
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, reps: int = 3):
    fn()
    _sync(device)
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], out


def decode_case(name, model, prompts, n, new_tokens, device, dtype=torch.float32) -> dict:
    from groupflow.rollout.engines.hf import SamplingParams, generate

    model = model.to(device, dtype).eval()
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, n=n)
    seeds = list(range(len(prompts) * n))
    runs = {}
    for static in (False, True):
        p = dataclasses.replace(params, static_kv_cache=static)
        runs[static] = timed(
            lambda p=p: generate(model, prompts, p, seeds=seeds, pad_id=0, eos_ids=[]), device
        )
    (t_dyn, dyn), (t_sta, sta) = runs[False], runs[True]
    same = (dyn.responses == sta.responses).float().mean().item()
    print(
        f"[decode {name} {str(dtype).removeprefix('torch.')}] dynamic {t_dyn:.3f} s, static "
        f"{t_sta:.3f} s: {t_dyn / t_sta:.2f}x; tokens equal {same:.4f}",
        flush=True,
    )
    return {
        "path": f"static vs dynamic KV cache, {name} {str(dtype).removeprefix('torch.')}",
        "old": f"{t_dyn:.2f} s", "new": f"{t_sta:.2f} s", "ratio": f"{t_dyn / t_sta:.2f}×",
        "check": "tokens identical" if same == 1.0 else f"tokens equal {same:.4f}",
    }  # fmt: skip


def sampler_case(vocab: int, rows: int, device: torch.device) -> dict:
    from groupflow.rollout.engines.hf import SamplingParams, _sample

    logits = torch.randn(rows, vocab, device=device)
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    t, _ = timed(lambda: _sample(logits, SamplingParams(temperature=1.0), gens), device, reps=5)
    print(f"[sampler] {rows} rows x {vocab} vocabulary: {1e3 * t:.2f} ms per decode step")
    return {"path": f"sampler, {rows} rows, {vocab // 1000}k vocabulary (per decode step)",
            "old": "", "new": f"{1e3 * t:.2f} ms", "ratio": "", "check": ""}  # fmt: skip


def head_case(vocab: int, hidden: int, rows: int) -> dict:
    """The LM head of a decode step: F.linear (MKL on CPU) vs the kernel the decode picks."""
    import torch.nn.functional as F

    from groupflow.rollout.engines.kernels import head_kernel

    head = torch.nn.Linear(hidden, vocab, bias=False)
    kernel = head_kernel(head)
    x = torch.randn(rows, hidden)
    with torch.inference_mode():
        t_mkl, ref = timed(lambda: F.linear(x, head.weight), torch.device("cpu"), reps=5)
        t_new, out = timed(lambda: kernel(x), torch.device("cpu"), reps=5)
    name = "module (no faster kernel here)" if kernel is head else "oneDNN"
    print(
        f"[LM head {vocab}x{hidden}, {rows} rows] F.linear {1e3 * t_mkl:.1f} ms, {name} "
        f"{1e3 * t_new:.1f} ms: {t_mkl / t_new:.2f}x; max |d| {(out - ref).abs().max().item():.1e}"
    )
    return {"path": f"LM head {vocab:,} × {hidden}, {rows} rows: F.linear (MKL) vs {name}",
            "old": f"{1e3 * t_mkl:.1f} ms", "new": f"{1e3 * t_new:.1f} ms",
            "ratio": f"{t_mkl / t_new:.2f}×", "check": f"max |d| {(out - ref).abs().max().item():.1e}"}  # fmt: skip


def attention_case(rows: int, q_heads: int, kv_heads: int, length: int, layers: int = 30) -> dict:
    """One decode step's attention over ``layers`` caches (more bytes than the CPU's caches
    hold, as in a real model): SDPA (what the static decode used) vs grouped_attention."""
    import torch.nn.functional as F

    from groupflow.rollout.engines.static_cache import grouped_attention

    dim, cpu = 64, torch.device("cpu")
    keys = [torch.randn(rows, kv_heads, length, dim) for _ in range(layers)]
    values = [torch.randn(rows, kv_heads, length, dim) for _ in range(layers)]
    q = torch.randn(rows, q_heads, 1, dim)
    gqa = q_heads != kv_heads
    with torch.inference_mode():
        t_sdpa, _ = timed(
            lambda: [
                F.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, enable_gqa=gqa)
                for k, v in zip(keys, values)
            ],
            cpu,
            reps=5,
        )
        t_grp, _ = timed(
            lambda: [grouped_attention(q, k, v, None, dim**-0.5) for k, v in zip(keys, values)],
            cpu,
            reps=5,
        )
    print(
        f"[attention {rows} rows, {q_heads}/{kv_heads} heads, {length} keys, {layers} layers] "
        f"SDPA {1e3 * t_sdpa:.1f} ms, grouped {1e3 * t_grp:.1f} ms: {t_sdpa / t_grp:.2f}x"
    )
    return {"path": f"attention, {rows} rows, {q_heads}/{kv_heads} heads, {layers} layers, {length} "
            "cached positions: SDPA vs grouped_attention", "old": f"{1e3 * t_sdpa:.1f} ms",
            "new": f"{1e3 * t_grp:.1f} ms", "ratio": f"{t_sdpa / t_grp:.2f}×", "check": ""}  # fmt: skip


def shared_prompt_case(model, device, prompt_len, response_len, prompts, samples) -> dict:
    from groupflow.models.logprobs import response_logprobs

    model = model.to(device, torch.float32).train()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    rows = torch.arange(prompts).repeat_interleave(samples)
    prompt_ids = torch.randint(5, vocab, (prompts, prompt_len), generator=g)[rows].to(device)
    responses = torch.randint(5, vocab, (len(rows), response_len), generator=g).to(device)
    ones_p, ones_r = torch.ones_like(prompt_ids), torch.ones_like(responses)

    def fwd_bwd(share: bool):
        model.zero_grad(set_to_none=True)
        lp, _ = response_logprobs(model, prompt_ids, ones_p, responses, ones_r, share_prompt=share)
        lp.sum().backward()
        return lp.detach()

    t_sh, lp_sh = timed(lambda: fwd_bwd(True), device)
    t_one, lp_one = timed(lambda: fwd_bwd(False), device)
    bound = (prompts * prompt_len + len(rows) * response_len) / (
        len(rows) * (prompt_len + response_len)
    )
    print(
        f"[shared prompt P={prompt_len} T={response_len} {prompts}x{samples}] forward+backward "
        f"shared {t_sh:.3f} s, one pass {t_one:.3f} s: ratio {t_sh / t_one:.2f} (token bound "
        f"{bound:.2f}); max |dlogp| {(lp_sh - lp_one).abs().max().item():.1e}"
    )
    return {"path": f"shared-prompt update (forward + backward), prompts {prompt_len}, "
            f"{prompts} × {samples} × {response_len}", "old": f"{t_one:.2f} s",
            "new": f"{t_sh:.2f} s", "ratio": f"{t_sh / t_one:.2f} (token bound {bound:.2f})",
            "check": f"max |dlogp| {(lp_sh - lp_one).abs().max().item():.1e}"}  # fmt: skip


def write_rows(path: str, rows: list[dict], device: torch.device, threads: int) -> None:
    """The measured rows as a results file (``groupflow.utils.results``) the docs render."""
    import transformers

    from groupflow.utils.results import write_results

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    write_results(
        path, name=path.rsplit("/", 1)[-1].removesuffix(".json"), rows=rows,
        command="python benchmarks/decode_paths.py " + shlex.join(sys.argv[1:]),
        summary={
            "recipe": f"benchmarks/decode_paths.py --device {device.type}",
            "what": f"decode and update speed paths, one by one ({device.type})",
            "before": f"dynamic cache {rows[0]['old']} ({rows[0]['path'].split(', ')[1]})",
            "after": f"static cache {rows[0]['new']} ({rows[0]['ratio']})",
            "guide": "docs/benchmarks/trl.md",
        },
        notes=f"{where or device.type}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {threads} torch thread(s); medians of 3 (5 for the sampler, "
        "the LM head and attention) after a warm-up; randomly initialised models.",
    )  # fmt: skip
    print(f"results: {path}")


def main() -> None:
    import transformers

    from groupflow.models.causal_lm import build_tiny_llama

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="CPU-sized cases only")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--results", help="also write the rows as a results file here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)

    medium = build_tiny_llama(34, hidden_size=192, num_layers=6, num_heads=4, seed=0)
    prompts = [[5 + (i + j) % 20 for j in range(16)] for i in range(8)]
    rows = [decode_case("medium 2.7M, 8x8x64", medium, prompts, 8, 64, device)]
    for vocab in (49152, 151936):
        rows.append(sampler_case(vocab, 128, device))
    if device.type == "cpu":
        for vocab, hidden in ((49152, 576), (151936, 896)):
            for n_rows in (1, 16, 128):
                rows.append(head_case(vocab, hidden, n_rows))
        for length in (40, 100, 166):
            rows.append(attention_case(16, 9, 3, length))
    qwen3 = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3Config(
            vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, head_dim=32,
        )
    )  # fmt: skip
    qwen_prompts = [[3 + (i * 5 + j) % 900 for j in range(10 + i)] for i in range(8)]
    rows.append(decode_case("qwen3 tiny, 8x4x64", qwen3, qwen_prompts, 4, 64, device))
    if a.small:
        rows.append(shared_prompt_case(medium, device, 256, 64, 8, 8))
        if a.results:
            write_rows(a.results, rows, device, a.threads)
        return
    smol_cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    smol = transformers.LlamaForCausalLM(smol_cfg)
    smol_prompts = [[100 + (7 * i + j) % 1000 for j in range(64 + 8 * i)] for i in range(16)]
    rows.append(decode_case("SmolLM2-135M-shaped, 16x8x128", smol, smol_prompts, 8, 128, device))
    rows.append(
        decode_case(
            "SmolLM2-135M-shaped, 16x8x128", smol, smol_prompts, 8, 128, device, torch.bfloat16
        )
    )
    rows.append(shared_prompt_case(smol, device, 256, 256, 8, 8))
    if a.results:
        write_rows(a.results, rows, device, a.threads)


if __name__ == "__main__":
    main()
