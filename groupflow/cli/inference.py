"""``groupflow eval``, ``generate`` and ``export``: a trained LLM run loaded in this process.

Design decision: the three commands (and ``groupflow serve`` with a run's config) share one
loader, :func:`load_trainer_for_inference`: the run's config forced to one local worker, its
``Trainer`` built to read the run directory (never to prepare or clear it), and the weights of
``--checkpoint`` (a checkpoint directory, or a run directory's newest complete one) loaded into
it, resharded when the checkpoint is sharded. They live together because they need the same
imports (the trainer already imports the benchmarks and tokenizers).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from groupflow.assembly.tokenizers import save_processor
from groupflow.config import load_config
from groupflow.evals import get_benchmark
from groupflow.evals.runner import run_benchmark, write_records
from groupflow.run.checkpoint import CheckpointError, find_latest_checkpoint, load_checkpoint
from groupflow.run.rundir import RUN_ENTRIES
from groupflow.trainer import Trainer
from groupflow.utils.progress import Progress

__all__ = ["evaluate", "export", "generate", "load_trainer_for_inference"]

_GENERATE_CHUNK = 16  # prompts per generate call of `groupflow generate`


def load_trainer_for_inference(args: argparse.Namespace) -> Trainer:
    # Inference runs in this process on one worker; a sharded checkpoint is resharded on load.
    overrides = list(args.overrides) + ["run.backend=local", "run.num_workers=1"]
    cfg = load_config(args.config, overrides)
    if not cfg.kind.writes_text:
        raise ValueError(
            f"'{args.command}' works on LLM policies; a diffusion run is evaluated during training "
            "(validation.every_steps: eval reward and PNG grids in the run directory)"
        )
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    checkpoint = None
    if args.checkpoint:
        run_dir, checkpoint = _locate_checkpoint(Path(args.checkpoint), run_dir)
    # The run's directory is read (its tokenizer), never prepared for training or cleared.
    trainer = Trainer(cfg, inference_run_dir=run_dir)
    if checkpoint is not None:
        try:
            state = load_checkpoint(checkpoint)
        except CheckpointError as e:
            raise ValueError(f"--checkpoint: {e}") from None
        if "shards" in state:
            trainer.policy.actor.load_sharded(str(state["shards"]))
        else:
            trainer.policy.actor.load_weights(state["model"])
    return trainer


def _locate_checkpoint(path: Path, config_run_dir: Path) -> tuple[Path, Path]:
    """(run directory, checkpoint directory) for ``--checkpoint``: a run directory (its newest
    complete checkpoint) or one checkpoint directory (in its run's ``checkpoints/``)."""
    if not path.exists():
        raise FileNotFoundError(f"--checkpoint: '{path}' does not exist")
    if (path / "manifest.json").exists() or path.name.startswith("step_"):
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else config_run_dir
        return run_dir, path
    if any((path / name).exists() for name in RUN_ENTRIES):  # a run directory
        latest = find_latest_checkpoint(path / "checkpoints")
        if latest is not None:
            return path, latest
        if (path / "checkpoints").is_dir() and any((path / "checkpoints").iterdir()):
            raise FileNotFoundError(
                f"run {path} has no complete checkpoint: every save under {path}/checkpoints "
                "was cut short (resume training with run.resume=auto to write one)"
            )
        raise FileNotFoundError(
            f"run {path} saved no checkpoint; set run.save_every (or keep run.save_final=true, "
            "the default) and train again"
        )
    raise FileNotFoundError(
        f"--checkpoint: '{path}' is neither a run directory nor a checkpoint directory "
        "(give runs/<name> or runs/<name>/checkpoints/step_<N>)"
    )


def evaluate(args: argparse.Namespace) -> int:
    """``groupflow eval``: the validation data, or ``--benchmark NAME``."""
    if args.benchmark is not None:
        return _eval_benchmark(args)
    if args.limit is not None:
        raise ValueError(
            "--limit applies to --benchmark NAME (the validation data has data.max_val_prompts)"
        )
    trainer = load_trainer_for_inference(args)
    if getattr(trainer.workflow, "val", None) is None:
        raise ValueError(
            "eval needs validation data: set data.val_files (or use a built-in data.task)"
        )
    metrics, records = trainer.validate(return_records=True, progress_label="eval")
    for k, val in sorted(metrics.items()):
        print(f"{k:<40} {val:.4f}")
    if args.output:
        with open(args.output, "w") as f:
            for mode, recs in records.items():
                for r in recs:
                    f.write(json.dumps({"mode": mode, **r}) + "\n")
        print(f"wrote {args.output}")
    return 0


def _eval_benchmark(args: argparse.Namespace) -> int:
    get_benchmark(args.benchmark)  # an unknown name fails before the model loads
    trainer = load_trainer_for_inference(args)
    result = run_benchmark(
        trainer.policy, args.benchmark, limit=args.limit, samples=args.samples,
        temperature=args.temperature, seed=trainer.cfg.run.seed,
        max_new_tokens=args.max_new_tokens,
        use_chat_template=trainer.cfg.data.use_chat_template, progress_label=f"eval {args.benchmark}",
        batch_prompts=args.batch_prompts,
    )  # fmt: skip
    by_reason: dict[str, list[str]] = {}
    for key, reason in result.excluded.items():
        by_reason.setdefault(reason, []).append(key)
    for reason, keys in by_reason.items():
        print(f"{args.benchmark}: {len(keys)} prompt(s) excluded, {reason}: keys "
              f"{', '.join(sorted(keys, key=_key_order))}")  # fmt: skip
    for k, val in result.metrics.items():
        print(f"{args.benchmark}/{k:<28} {val:.4f}")
    if args.output:
        print(f"wrote {write_records(args.output, result)}")
    return 0


def _key_order(key: str):
    return (0, int(key)) if key.isdigit() else (1, key)


def generate(args: argparse.Namespace) -> int:
    """``groupflow generate``: completions for ``--prompt`` or standard input, as JSON lines."""
    trainer = load_trainer_for_inference(args)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("generate: give --prompt TEXT (repeatable) or prompts on standard input")
    params = replace(trainer.policy.sampling, n=args.num_samples)
    if args.greedy:
        params = replace(params, temperature=0.0)
    # Chunks of prompts, each printed as it finishes: many prompts on stdin stream out with a
    # progress report instead of one long silence. Seeds depend on the prompt's index only. The
    # workflow samples, so a tool-using policy answers with its tools (the whole trajectory).
    with Progress("generate", len(prompts)) as progress:
        for start in range(0, len(prompts), _GENERATE_CHUNK):
            chunk = prompts[start : start + _GENERATE_CHUNK]
            seeds = [
                list(range(i * params.n, (i + 1) * params.n))
                for i in range(start, start + len(chunk))
            ]
            lines = trainer.workflow.sample(chunk, params, seeds)
            for line in lines:
                progress.write(json.dumps(line), sys.stdout)
            progress.update(len(chunk), tokens=sum(line["tokens"] for line in lines))
    return 0


def export(args: argparse.Namespace) -> int:
    """``groupflow export``: the run's model as a Hugging Face directory (with its tokenizer)."""
    trainer = load_trainer_for_inference(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trainer.policy.actor.save_pretrained(str(out))
    save_processor(trainer.cfg, trainer.policy.tokenizer, out)
    print(f"exported HF model to {out}")
    return 0
