"""groupflow vs TRL: wall time and peak memory of one GRPO step on CPU, same work on both sides.

Methodology (design decisions, each made so that the two numbers are comparable):

- Same work. Both frameworks get the same Llama-style model (built once by groupflow's assembly
  from one seed, then deep-copied, so the initial weights are identical), the same character
  tokenizer, the same synthetic "reverse" prompt set (every prompt is 16 tokens, so the two
  samplers drawing different prompts in a given step does not change the work), the same reward
  function (``groupflow.data.synthetic.answer_match_reward``), B prompts × G samples per step and
  exactly ``new_tokens`` (64) new tokens per sample: TRL gets ``min_new_tokens`` so EOS is never
  sampled early, groupflow's worker gets no EOS id so it never stops early. Same loss family
  (token-mean PPO-clip: groupflow ``loss_agg=token_mean``, TRL ``loss_type="dapo"``), β = 0 (no
  reference model on either side), one optimizer step per generation batch (μ = 1; TRL:
  ``per_device_train_batch_size = B·G``, ``steps_per_generation = 1``, ``num_iterations = 1``, so
  neither side recomputes old log-probs), the same optimizer (``torch.optim.AdamW``, same lr and
  betas, weight decay 0, constant LR, grad clip 1.0), temperature 1, no top-k/top-p.
- One step means everything each framework does per step: TRL's interval is measured from the end
  of one ``on_step_end`` callback to the next (data loading, generation, reward, advantages, loss,
  backward, optimizer, its metric bookkeeping); groupflow's step is ``Trainer.train_step`` (the
  body of ``fit``: collect → old log-probs → advantages → update, with contract validation and
  step metrics) — ``fit`` adds only the tracker's file I/O, validation and checkpoints, which
  TRL also has switched off here (``logging_strategy="no"``, ``save_strategy="no"``,
  ``report_to="none"``). TRL's default activation checkpointing is off too (groupflow's is).
- Timing alternates in one process: TRL runs its normal ``train()`` loop, and a callback runs one
  groupflow step after every TRL step, so the order is TRL, groupflow, TRL, groupflow, … and slow
  drift of the (shared) machine hits both alike. The first step of each is a discarded warm-up;
  the median of the rest is reported, as wall time and as the process's CPU time (steadier when
  other jobs share the cores). ``torch.set_num_threads`` is fixed and re-checked before every step.
- Memory is measured in a fresh subprocess per (framework, model size), because RSS freed by one
  framework is reused by the other inside one process. The process's RSS high-water mark
  (``VmHWM``) is reset through ``/proc/self/clear_refs`` right before the first step and read after
  the last: "peak" is the largest RSS while training (imports and model included), "+steps" is
  peak minus the RSS just before the first step (what the training steps themselves added). Where
  the reset is not allowed, ``ru_maxrss`` (whole-process high-water) is reported and marked.

Run ``python benchmarks/bench_trl.py --quick`` (a few minutes on 2 cores) or without ``--quick``
for more steps and a larger batch. TRL is a benchmark-only dependency (see benchmarks/README.md).

``--model DIR`` runs the same comparison on a real Hugging Face model directory instead of the tiny
built models (e.g. SmolLM2-135M-Instruct from ``groupflow convert-gguf``; the issue's work is
``--model DIR --prompts-per-step 4 --samples-per-prompt 4 --new-tokens 128 --threads 2``). Every
run prints groupflow's per-phase breakdown (generation, loss forward, backward, optimizer; the
backward column is the update's time less the other two) and both ratios: the speed-up over TRL
and groupflow's step over the matrix-multiply floor of the same work.

``--results PATH`` also writes the rows as a results file (``groupflow.utils.results``) the docs
render: per model, TRL, groupflow and the floor — with the per-phase columns for a ``--model``
run, with the memory columns otherwise.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# Llama-style shapes: ~0.2M and ~2.7M parameters with the ~40-symbol character vocabulary.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "num_layers": 4, "num_heads": 4},
    "medium": {"hidden_size": 192, "num_layers": 6, "num_heads": 4},
}
MODEL_DIR_SIZE = "model"  # the size label of a --model DIR run
FRAMEWORKS = ("trl", "groupflow")
TARGET_SPEEDUP = 3.0  # on the medium model (the target)


@dataclass(frozen=True)
class Settings:
    prompts_per_step: int = 8  # B
    samples_per_prompt: int = 8  # G
    new_tokens: int = 64
    steps: int = 8  # timed steps per framework, after one warm-up step
    memory_steps: int = 2  # steps per memory subprocess, after one warm-up step
    lr: float = 1e-5
    threads: int = 1
    seed: int = 0
    sizes: tuple[str, ...] = tuple(MODEL_SIZES)
    # TRL's own default is on; off by default here because groupflow does not recompute activations.
    trl_gradient_checkpointing: bool = False
    model_dir: str | None = None  # a real HF model directory instead of the tiny sizes

    def __post_init__(self):
        for key in ("prompts_per_step", "new_tokens", "steps", "memory_steps", "threads"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.samples_per_prompt < 2:
            raise ValueError(
                f"samples_per_prompt must be >= 2 (GRPO needs a group), got {self.samples_per_prompt}"
            )
        unknown = [
            s
            for s in self.sizes
            if s not in MODEL_SIZES and not (s == MODEL_DIR_SIZE and self.model_dir)
        ]
        if unknown:
            raise ValueError(f"unknown model size(s) {unknown}; valid: {', '.join(MODEL_SIZES)}")


QUICK = Settings(prompts_per_step=4, samples_per_prompt=8, steps=4, memory_steps=1)


# ----- groupflow side ----------------------------------------------------------------------------


def groupflow_config(size: str, s: Settings, out_dir: Path):
    from groupflow.config import config_from_dict

    return config_from_dict(
        {
            "run": {
                "name": f"bench-{size}",
                "output_dir": str(out_dir),
                "seed": s.seed,
                "total_steps": 10**6,  # stepped by hand; only bounds the (constant) LR schedule
                "resume": "never",
                "loggers": [],
                "samples_every": 0,
                "num_threads": s.threads,
            },
            "model": (
                {"path": s.model_dir}
                if size == MODEL_DIR_SIZE
                else {"tiny": {**MODEL_SIZES[size], "seed": s.seed}}
            ),
            "data": {
                "task": {"name": "reverse", "digits": 6, "num_train": 2000, "num_val": 1},
                "prompts_per_step": s.prompts_per_step,
            },
            "rollout": {
                "samples_per_prompt": s.samples_per_prompt,
                "max_new_tokens": s.new_tokens,
                "temperature": 1.0,
            },
            "validation": {"before_training": False},
            "actor": {"lr": s.lr, "loss_agg": "token_mean", "grad_clip": 1.0},
        }
    )


def build_groupflow(size: str, s: Settings, out_dir: Path):
    from groupflow.trainer import Trainer

    trainer = Trainer(groupflow_config(size, s, out_dir))
    # No EOS id: every sample runs the full new_tokens, like TRL's min_new_tokens below.
    actor_worker(trainer).eos_ids = []
    return trainer


def actor_worker(trainer):
    """The in-process ActorRolloutWorker behind the trainer's (local-backend) worker group."""
    return trainer.policy.actor.local_worker()


def groupflow_step(trainer, seen: dict[str, list] | None = None) -> None:
    """One step of ``Trainer.fit``: everything but the tracker, validation and checkpoints."""
    batch, metrics = trainer.train_step()
    if seen is not None:
        seen["skipped"].append(metrics.get("actor/zero_adv_skipped", 0.0))
        seen["prompt_len"].append(int(batch["prompt_mask"].sum(1).max()))
        seen["update_s"].append(metrics["time/update"])


def instrument_update(worker, sinks: dict[str, list[float]]) -> None:
    """Time the actor's loss forwards (its FSDP root's forward) and optimizer steps per call."""
    _timed_method(worker.policy, "forward", sinks["forward"])
    _timed_method(worker.optimizer, "step", sinks["optimizer"])


# ----- TRL side ----------------------------------------------------------------------------------


def build_trl(
    model,
    tokenizer,
    rows,
    s: Settings,
    out_dir: Path,
    max_steps: int,
    callbacks,
    *,
    reward_funcs: list[Callable[..., list[float]]] | None = None,
    use_cpu: bool = True,
    bf16: bool = False,
):
    """A TRL GRPOTrainer doing exactly one generation of B×G samples + one optimizer step per step.

    ``reward_funcs``: default the synthetic task's answer check (groupflow's, on both sides);
    ``use_cpu=False, bf16=True``: on the GPU in bf16 (``gpu_check.py``)."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from groupflow.data.synthetic import answer_match_reward

    samples = s.prompts_per_step * s.samples_per_prompt
    args = GRPOConfig(
        output_dir=str(out_dir / "trl"),
        use_cpu=use_cpu,
        bf16=bf16,
        fp16=False,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        seed=s.seed,
        max_steps=max_steps,
        dataloader_num_workers=0,
        per_device_train_batch_size=samples,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=s.samples_per_prompt,
        num_iterations=1,
        max_completion_length=s.new_tokens,
        generation_kwargs={"min_new_tokens": s.new_tokens},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="dapo",
        epsilon=0.2,
        scale_rewards="group",
        learning_rate=s.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",  # torch.optim.AdamW, as groupflow (TRL's default is the fused one)
        max_grad_norm=1.0,
        # TRL turns activation checkpointing on by default; groupflow's default is off, and the
        # recompute would make TRL do more work than groupflow.
        gradient_checkpointing=s.trl_gradient_checkpointing,
    )
    dataset = Dataset.from_list([{"prompt": r.prompt, "answer": r.fields["answer"]} for r in rows])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs or [answer_match_reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    # The end-of-training summary would be printed into the benchmark's table output.
    trainer.remove_callback(PrinterCallback)
    return trainer


def _step_callback(on_step_end: Callable[[], None]):
    from transformers import TrainerCallback

    class StepHook(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            on_step_end()

    return StepHook()


# ----- measurement helpers -----------------------------------------------------------------------


def _check_threads(threads: int) -> None:
    if torch.get_num_threads() != threads:
        # A library changed it behind our back; put it back so both sides get the same cores.
        torch.set_num_threads(threads)


def _timed_method(
    obj: Any, name: str, sink: list[float], clock: Callable[[], float] = time.perf_counter
) -> None:
    """Wrap ``obj.name`` so every call appends its duration on ``clock`` to ``sink`` (wall time by
    default, ``time.process_time`` for CPU time); wrapping twice times one call on both clocks."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            sink.append(clock() - t0)

    setattr(obj, name, wrapper)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ----- the alternating timing run ----------------------------------------------------------------


def _now() -> tuple[float, float]:
    # Wall time, and CPU time of this process: the machine is shared, and CPU time is far less
    # sensitive to other processes competing for the cores than wall time is.
    return time.perf_counter(), time.process_time()


def time_alternating(size: str, s: Settings) -> dict[str, Any]:
    """Per-step wall and CPU times of both frameworks, interleaved TRL, groupflow, TRL, … in-process."""
    torch.set_num_threads(s.threads)
    wall: dict[str, list[float]] = {"trl": [], "groupflow": []}
    cpu: dict[str, list[float]] = {"trl": [], "groupflow": []}
    gen: dict[str, list[float]] = {"trl": [], "groupflow": []}
    # groupflow's share of zero-advantage samples left out of the update, prompt widths, and the
    # update's time per step (its forward and optimizer parts are timed per call)
    seen: dict[str, list] = {"skipped": [], "prompt_len": [], "update_s": []}
    calls: dict[str, list[float]] = {"forward": [], "optimizer": []}
    phases: dict[str, list[float]] = {"forward": [], "optimizer": []}
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        gf = build_groupflow(size, s, Path(tmp))
        trl_model = copy.deepcopy(actor_worker(gf).model)
        n_params = param_count(trl_model)
        _timed_method(actor_worker(gf), "generate", gen["groupflow"])
        instrument_update(actor_worker(gf), calls)
        since = {"t": _now()}

        def record(fw: str, start: tuple[float, float]) -> None:
            end = _now()
            wall[fw].append(end[0] - start[0])
            cpu[fw].append(end[1] - start[1])

        def after_trl_step():
            record("trl", since["t"])
            _check_threads(s.threads)
            start = _now()
            marks = {k: len(v) for k, v in calls.items()}
            groupflow_step(gf, seen)
            record("groupflow", start)
            for k, v in calls.items():
                phases[k].append(sum(v[marks[k] :]))
            _check_threads(s.threads)
            since["t"] = _now()

        trl = build_trl(
            trl_model,
            gf.policy.tokenizer,
            gf.workflow.train_rows,
            s,
            Path(tmp),
            max_steps=s.steps + 1,
            callbacks=[_step_callback(after_trl_step)],
        )
        _timed_method(trl, "_generate_single_turn", gen["trl"])
        _check_threads(s.threads)
        since["t"] = _now()
        trl.train()
        floor = gemm_floor(actor_worker(gf).model, s, prompt_len=max(seen["prompt_len"]))
    if any(len(wall[fw]) != s.steps + 1 for fw in FRAMEWORKS):
        raise RuntimeError(f"expected {s.steps + 1} steps of each framework, got {wall}")
    # The first step of each framework is a warm-up and is discarded.
    return {
        "params": n_params,
        "step_s": {fw: wall[fw][1:] for fw in FRAMEWORKS},
        "step_cpu_s": {fw: cpu[fw][1:] for fw in FRAMEWORKS},
        "generate_s": {fw: gen[fw][1:] for fw in FRAMEWORKS},
        "zero_adv_skipped": statistics.mean(seen["skipped"][1:]),
        "floor": floor,
        "groupflow_phases_s": {
            "generate": gen["groupflow"][1:],
            "loss_forward": phases["forward"][1:],
            "backward": [
                u - f - o
                for u, f, o in zip(seen["update_s"], phases["forward"], phases["optimizer"])
            ][1:],
            "optimizer": phases["optimizer"][1:],
        },
    }


# ----- the matrix-multiply floor ------------------------------------------------------------------


# The floor's clock. Wall time by default; with one thread on a machine shared with other jobs,
# time.process_time (this process's CPU time) is steadier — bench_generation.py switches to it
# then, and compares it with the steps' CPU time.
FLOOR_CLOCK: Callable[[], float] = time.perf_counter


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up: allocation, kernel selection
    times = []
    for _ in range(repeats):
        t0 = FLOOR_CLOCK()
        fn()
        times.append(FLOOR_CLOCK() - t0)
    return statistics.median(times)


def _matmul_kernels(a: torch.Tensor, b: torch.Tensor) -> list[Callable[[], Any]]:
    """``a @ b`` on each CPU GEMM kernel PyTorch ships: MKL (``matmul``) and oneDNN, which the
    decode's LM head uses where it is faster (``groupflow/rollout/engines/kernels.py``; 1.3-1.8x on
    vocabulary-sized heads on our CPU)."""
    kernels = [lambda: a @ b]
    # (the check of groupflow.rollout.engines.kernels.onednn_linear_available, inlined so that the floor
    # also runs beside a groupflow from before that module: bench_generation.py --baseline)
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    if a.device.type == "cpu" and onednn:
        op, weight = torch.ops.mkldnn._linear_pointwise, b.t()  # a @ b = linear(a, b^T)
        kernels.append(lambda: op(a, weight, None, "none", [], ""))
    return kernels


def _matmul_s(a: torch.Tensor, b: torch.Tensor, repeats: int = 3) -> float:
    """Median seconds of ``a @ b`` on the faster kernel, operands hot in the caches."""
    return min(_median_s(k, repeats) for k in _matmul_kernels(a, b))


def _streamed_pass_s(products: list[tuple[torch.Tensor, torch.Tensor]], repeats: int = 3) -> float:
    """Seconds for every ``a @ b`` of ``products`` once, in turn, each on its faster kernel — a
    decode step's (or prefill's) GEMMs as they really run: each weight used once per pass, the
    weights together larger than the CPU's caches, so they stream from memory. (Timing each
    product on its own, repeated, keeps its weight in cache: for SmolLM2 at 16 rows that
    understated a decode step's GEMMs by ~25%.)"""
    fastest = [min(_matmul_kernels(a, b), key=lambda k: _median_s(k, repeats)) for a, b in products]
    return _median_s(lambda: [k() for k in fastest], repeats)


@torch.no_grad()
def gemm_floor(model, s: Settings, prompt_len: int) -> dict[str, float]:
    """Seconds this machine needs for just the matrix multiplies of one step of the benchmark's
    work, done by any framework that computes the full batch: generation (one shared prefill per
    prompt, then one token for all B·G rows per step) and the update (forward, input-gradient and
    weight-gradient GEMMs of every linear layer over B·G·(prompt + new) positions; LM head over
    the response positions), each on the faster of MKL and oneDNN; generation's GEMMs are timed
    as whole passes over the weights, which then stream from memory as in a real decode step.
    Attention, norms, activations, sampling and the optimizer are left out, so this is a strict
    lower bound on a step: no framework doing this work in fp32 on these cores can be faster
    than TRL's step divided by it."""
    torch.set_num_threads(s.threads)
    head = model.get_output_embeddings().weight
    # (weight, is it the LM head's)
    linears = [
        (m.weight.detach(), m.weight is head)
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    rows = s.prompts_per_step * s.samples_per_prompt
    train_m, resp_m = rows * (prompt_len + s.new_tokens), rows * s.new_tokens

    def forward_pass(m: int, head_m: int) -> float:
        # the LM head runs only where a token is predicted: the last prompt position in a
        # prefill, every row in a decode step
        products = [
            (torch.randn(head_m if is_head else m, w.shape[1]), w.t()) for w, is_head in linears
        ]
        return _streamed_pass_s(products)

    def matmuls(m: int, head_m: int, backward: bool) -> float:
        # the update: the LM head over the response positions
        total = 0.0
        for w, is_head in linears:
            n, k = w.shape
            mm = head_m if is_head else m
            x, dy, wt = torch.randn(mm, k), torch.randn(mm, n), w.t()
            # large, compute-bound products: one timed run after the warm-up is steady enough
            total += _matmul_s(x, wt, repeats=1)  # nn.Linear's x @ W^T
            if backward:
                total += _matmul_s(dy, w, repeats=1)  # grad of the input
                total += _matmul_s(dy.t(), x, repeats=1)  # grad of the weight
        return total

    decode = forward_pass(rows, rows) * (s.new_tokens - 1)
    prefill = forward_pass(s.prompts_per_step * prompt_len, s.prompts_per_step)
    update = matmuls(train_m, resp_m, backward=True)
    return {"generate_s": prefill + decode, "update_s": update, "step_s": prefill + decode + update}


# ----- the memory probe (runs in its own process) ------------------------------------------------


def memory_probe(framework: str, size: str, s: Settings) -> dict[str, Any]:
    """Build one framework, run warm-up + ``memory_steps`` steps, report RSS figures in MiB."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework '{framework}'; valid: {', '.join(FRAMEWORKS)}")
    torch.set_num_threads(s.threads)
    steps = s.memory_steps + 1
    with tempfile.TemporaryDirectory(prefix="bench-trl-mem-") as tmp:
        if framework == "groupflow":
            gf = build_groupflow(size, s, Path(tmp))
            before = _rss_kib("VmRSS")
            resettable = _reset_peak_rss()
            for _ in range(steps):
                groupflow_step(gf)
        else:
            # The same construction path as the timing run (groupflow's Trainer builds the model,
            # tokenizer and rows); the Trainer itself is dropped before measuring.
            gf = build_groupflow(size, s, Path(tmp))
            model, tokenizer, rows = (
                actor_worker(gf).model,
                gf.policy.tokenizer,
                gf.workflow.train_rows,
            )
            del gf
            gc.collect()
            trl = build_trl(model, tokenizer, rows, s, Path(tmp), max_steps=steps, callbacks=[])
            before = _rss_kib("VmRSS")
            resettable = _reset_peak_rss()
            trl.train()
        peak = (
            _rss_kib("VmHWM") if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        )
    return {
        "peak_mib": peak / 1024,
        "before_steps_mib": before / 1024,
        "steps_mib": (peak - before) / 1024,
        "peak_is_whole_process": not resettable,
    }


def run_memory_probe(framework: str, size: str, s: Settings) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--memory-probe",
        framework,
        size,
        "--settings",
        json.dumps(asdict(s)),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"memory probe {framework}/{size} failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----- report ------------------------------------------------------------------------------------


def summarize(size: str, timing: dict[str, Any], memory: dict[str, dict[str, Any]]) -> list[dict]:
    def med(key: str) -> dict[str, float]:
        return {fw: statistics.median(timing[key][fw]) for fw in FRAMEWORKS}

    wall, cpu, gen = med("step_s"), med("step_cpu_s"), med("generate_s")
    return [
        {
            "size": size,
            "params": timing["params"],
            "framework": fw,
            "median_step_s": wall[fw],
            "min_step_s": min(timing["step_s"][fw]),
            "max_step_s": max(timing["step_s"][fw]),
            "median_step_cpu_s": cpu[fw],
            "median_generate_s": gen[fw],
            "speedup_vs_trl": wall["trl"] / wall[fw],
            "cpu_speedup_vs_trl": cpu["trl"] / cpu[fw],
            "floor": timing["floor"],
            "trl_over_floor": wall["trl"] / timing["floor"]["step_s"],
            "over_floor": wall[fw] / timing["floor"]["step_s"],
            "phases_s": (
                {k: statistics.median(v) for k, v in timing["groupflow_phases_s"].items()}
                if fw == "groupflow"
                else {"generate": gen["trl"], "rest": wall["trl"] - gen["trl"]}
            ),
            "zero_adv_skipped": timing["zero_adv_skipped"] if fw == "groupflow" else 0.0,
            **memory[fw],
        }
        for fw in FRAMEWORKS
    ]


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'model':<7} {'params':>7} {'framework':<10} {'wall s/step':>11} {'[min-max]':>11} "
        f"{'gen s':>6} {'CPU s/step':>10} {'peak MiB':>9} {'+steps MiB':>10} "
        f"{'speed-up':>8} {'(CPU)':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        star = "*" if r["peak_is_whole_process"] else ""
        lines.append(
            f"{r['size']:<7} {r['params'] / 1e6:>6.2f}M {r['framework']:<10} "
            f"{r['median_step_s']:>11.3f} {r['min_step_s']:>5.2f}-{r['max_step_s']:<5.2f} "
            f"{r['median_generate_s']:>6.3f} {r['median_step_cpu_s']:>10.3f} "
            f"{r['peak_mib']:>8.0f}{star} {r['steps_mib']:>10.0f} "
            f"{r['speedup_vs_trl']:>7.2f}x {r['cpu_speedup_vs_trl']:>5.2f}x"
        )
    lines.append(
        "wall s/step, gen s (generation only), CPU s/step: medians over the timed steps; "
        "speed-up = TRL / groupflow"
    )
    if any(r["peak_is_whole_process"] for r in rows):
        lines.append("* whole-process high-water mark (VmHWM could not be reset)")
    return "\n".join(lines)


def _x(ratio: float) -> str:
    return f"{ratio:.2f}×"


def results_rows(rows: list[dict], s: Settings) -> list[dict]:
    """The summarized rows in the docs' shape: for each model TRL, groupflow, then the floor."""
    out: list[dict] = []
    trl_label = "trl (activation checkpointing on)" if s.trl_gradient_checkpointing else "trl"
    for size in dict.fromkeys(r["size"] for r in rows):
        trl, gf = (next(r for r in rows if r["size"] == size and r["framework"] == fw)
                   for fw in FRAMEWORKS)  # fmt: skip
        f = gf["floor"]
        if s.model_dir:  # per phase, in seconds
            ph = gf["phases_s"]
            out += [
                {"": "TRL `GRPOTrainer`", "s/step": round(trl["median_step_s"], 1),
                 "generation": round(trl["phases_s"]["generate"], 1),
                 "loss forward": f"{trl['phases_s']['rest']:.1f} (the rest)", "backward": "",
                 "optimizer": "", "ratio": "1.00×"},
                {"": "groupflow", "s/step": round(gf["median_step_s"], 1),
                 "generation": round(ph["generate"], 1), "loss forward": round(ph["loss_forward"], 1),
                 "backward": round(ph["backward"], 1), "optimizer": round(ph["optimizer"], 1),
                 "ratio": f"{_x(gf['speedup_vs_trl'])} TRL (CPU time {_x(gf['cpu_speedup_vs_trl'])})"},
                {"": "matrix-multiply floor of the work", "s/step": round(f["step_s"], 1),
                 "generation": round(f["generate_s"], 1),
                 "loss forward": f"{f['update_s']:.1f} (update)", "backward": "", "optimizer": "",
                 "ratio": f"groupflow {_x(gf['over_floor'])} the floor"},
            ]  # fmt: skip
            continue
        for r, label in ((trl, trl_label), (gf, "groupflow")):
            mem = r["peak_mib"] == r["peak_mib"]  # NaN with --no-memory
            star = "*" if r["peak_is_whole_process"] else ""
            out.append({
                "model": size, "params": f"{r['params'] / 1e6:.2f}M", "framework": label,
                "wall s/step": round(r["median_step_s"], 3),
                "[min-max]": f"{r['min_step_s']:.2f}-{r['max_step_s']:.2f}",
                "gen s": round(r["median_generate_s"], 3),
                "CPU s/step": round(r["median_step_cpu_s"], 3),
                "peak MiB": f"{r['peak_mib']:.0f}{star}" if mem else "",
                "+steps MiB": f"{r['steps_mib']:.0f}" if mem else "",
                "speed-up": _x(r["speedup_vs_trl"]), "(CPU)": _x(r["cpu_speedup_vs_trl"]),
                "samples left out": f"{100 * r['zero_adv_skipped']:.0f} %" if r is gf else "",
            })  # fmt: skip
        out.append({
            "model": size, "params": f"{gf['params'] / 1e6:.2f}M",
            "framework": "matrix-multiply floor", "wall s/step": round(f["step_s"], 3),
            "[min-max]": "", "gen s": round(f["generate_s"], 3), "CPU s/step": "", "peak MiB": "",
            "+steps MiB": "", "speed-up": f"{_x(gf['trl_over_floor'])} (TRL / floor)", "(CPU)": "",
            "samples left out": "",
        })  # fmt: skip
    return out


def write_rows(path: Path, rows: list[dict], s: Settings, argv: list[str]) -> None:
    """``--results``: the measured rows as a results file (``groupflow.utils.results``)."""
    import transformers
    import trl

    from groupflow.utils.results import write_results

    table = results_rows(rows, s)
    trl_row, gf = rows[-2], rows[-1]  # the last model's
    what = (f"s/step of one GRPO step, B={s.prompts_per_step} × G={s.samples_per_prompt} × "
            f"{s.new_tokens} tokens, fp32, {s.threads} thread(s)")  # fmt: skip
    model = Path(s.model_dir).name if s.model_dir else ", ".join(s.sizes)
    write_results(
        path, name=path.stem, rows=table,
        command="python benchmarks/bench_trl.py " + shlex.join(argv),
        summary={
            "recipe": f"benchmarks/bench_trl.py ({model})"
            + (", TRL with activation checkpointing" if s.trl_gradient_checkpointing else ""),
            "what": what,
            "before": f"TRL {trl_row['median_step_s']:.3g} s/step ({gf['size']})",
            "after": f"groupflow {gf['median_step_s']:.3g} s/step ({_x(gf['speedup_vs_trl'])}; "
                     f"{_x(gf['over_floor'])} the floor)",
            "guide": "docs/benchmarks/trl.md",
        },
        notes=f"torch {torch.__version__}, transformers {transformers.__version__}, trl "
              f"{trl.__version__}, {s.threads} thread(s); medians of {s.steps} timed steps after a "
              "warm-up, TRL and groupflow alternating in one process. The floor is the "
              "matrix-multiply floor of the same work (generation plus update); 'samples left "
              "out' are groupflow's zero-advantage samples, skipped in its update"
              + (f" ({100 * gf['zero_adv_skipped']:.0f} % here)." if s.model_dir else "."),
    )  # fmt: skip
    print(f"results: {path}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small batch, few steps (a few minutes)")
    p.add_argument("--sizes", nargs="+", choices=list(MODEL_SIZES), help="model sizes to run")
    p.add_argument("--steps", type=int, help="timed steps per framework (after one warm-up)")
    p.add_argument("--prompts-per-step", type=int, help="B")
    p.add_argument("--samples-per-prompt", type=int, help="G")
    p.add_argument("--threads", type=int, help="torch threads, the same for both frameworks")
    p.add_argument("--new-tokens", type=int, help="new tokens per sample (exactly)")
    p.add_argument(
        "--model", help="a Hugging Face model directory to compare on instead of the tiny sizes"
    )
    p.add_argument(
        "--trl-gradient-checkpointing",
        action="store_true",
        help="TRL with its default activation checkpointing (more work than groupflow does)",
    )
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    p.add_argument("--results", type=Path, help="also write the rows as a results file here")
    p.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    p.add_argument("--memory-probe", nargs=2, metavar=("FRAMEWORK", "SIZE"), help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def settings_from_args(a: argparse.Namespace) -> Settings:
    base = asdict(QUICK if a.quick else Settings())
    chosen = {
        "sizes": tuple(a.sizes) if a.sizes else None,
        "steps": a.steps,
        "prompts_per_step": a.prompts_per_step,
        "samples_per_prompt": a.samples_per_prompt,
        "threads": a.threads,
        "trl_gradient_checkpointing": a.trl_gradient_checkpointing or None,
        "new_tokens": a.new_tokens,
        "model_dir": a.model,
    }
    if a.model:
        if a.sizes:
            raise SystemExit("--model replaces --sizes: give one of them")
        if not (Path(a.model) / "config.json").is_file():
            raise SystemExit(f"--model: '{a.model}' is not a Hugging Face model directory")
        chosen["sizes"] = (MODEL_DIR_SIZE,)
    base.update({k: v for k, v in chosen.items() if v is not None})
    return Settings(**base)


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    # TRL 1.x calls transformers APIs that v5 deprecates; the warnings say nothing about the run.
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    if a.memory_probe:
        raw = json.loads(a.settings)
        s = Settings(**{**raw, "sizes": tuple(raw["sizes"])})
        print(json.dumps(memory_probe(*a.memory_probe, s)))
        return []
    s = settings_from_args(a)
    print(
        f"B={s.prompts_per_step} prompts × G={s.samples_per_prompt} samples × {s.new_tokens} new "
        f"tokens; {s.steps} timed steps each (+1 warm-up); torch threads={s.threads}; "
        f"TRL gradient checkpointing={'on' if s.trl_gradient_checkpointing else 'off'}",
        flush=True,
    )
    rows: list[dict] = []
    for size in s.sizes:
        timing = time_alternating(size, s)
        print(f"[{size}] wall s per step: {json.dumps(timing['step_s'])}", flush=True)
        nan = {"peak_mib": float("nan"), "before_steps_mib": float("nan")}
        memory = {
            fw: (
                {**nan, "steps_mib": float("nan"), "peak_is_whole_process": False}
                if a.no_memory
                else run_memory_probe(fw, size, s)
            )
            for fw in FRAMEWORKS
        }
        rows += summarize(size, timing, memory)
    print()
    print(format_table(rows))
    medium = [r for r in rows if r["size"] == "medium" and r["framework"] == "groupflow"]
    for r in (r for r in rows if r["framework"] == "groupflow"):
        f, ph = r["floor"], r["phases_s"]
        trl = next(t for t in rows if t["size"] == r["size"] and t["framework"] == "trl")
        print(
            f"\n[{r['size']}] groupflow per phase (medians): generation {ph['generate']:.2f} s, "
            f"loss forward {ph['loss_forward']:.2f} s, backward (rest of update) "
            f"{ph['backward']:.2f} s, optimizer {ph['optimizer']:.2f} s; TRL: generation "
            f"{trl['phases_s']['generate']:.2f} s, the rest {trl['phases_s']['rest']:.2f} s"
        )
        print(
            f"[{r['size']}] ratios: {r['speedup_vs_trl']:.2f}x TRL's speed; groupflow's step is "
            f"{r['over_floor']:.2f}x the matrix-multiply floor ({f['step_s']:.2f} s)"
        )
        print(
            f"\n[{r['size']}] matrix-multiply floor of this work: generation {f['generate_s']:.3f} s"
            f" + update {f['update_s']:.3f} s = {f['step_s']:.3f} s/step, so no framework computing "
            f"the full batch in fp32 here beats TRL by more than {r['trl_over_floor']:.2f}x; "
            f"groupflow left {100 * r['zero_adv_skipped']:.0f}% of the samples (zero advantage: "
            "no gradient) out of its update"
        )
    if medium:
        verdict = "meets" if medium[0]["speedup_vs_trl"] >= TARGET_SPEEDUP else "misses"
        print(
            f"\nmedium model: groupflow is {medium[0]['speedup_vs_trl']:.2f}x TRL's speed "
            f"(CPU time {medium[0]['cpu_speedup_vs_trl']:.2f}x; {verdict} the "
            f"{TARGET_SPEEDUP:.0f}x target)"
        )
    if a.json:
        a.json.write_text(json.dumps({"settings": asdict(s), "rows": rows}, indent=2))
    if a.results:
        write_rows(a.results, rows, s, argv)
    return rows


if __name__ == "__main__":
    main()
