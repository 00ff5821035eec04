"""``groupflow serve``: an OpenAI-compatible server for a run's config or a plain model.

Design decision: the target decides what is built. A run's ``CONFIG.yaml`` (with
``--checkpoint`` for its trained weights) goes through the inference commands' loader
(``groupflow.cli.inference``); a Hugging Face model directory or Hub id is served as it is, with a
config made on the spot and only the policy built (no data, a scratch run directory). The bind
address is checked before minutes of model loading.
"""

from __future__ import annotations

import argparse
import atexit
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import uvicorn

from groupflow.assembly.models import resolve_hub_models
from groupflow.cli.inference import load_trainer_for_inference
from groupflow.config import apply_overrides, config_from_dict, parse_overrides
from groupflow.policies.llm import LLMPolicy
from groupflow.serve.access import OpenAccess
from groupflow.serve.app import build_app
from groupflow.serve.build import server_core
from groupflow.serve.thread import check_bind
from groupflow.utils.hub import is_hub_id
from groupflow.workflows.build import check_paths

__all__ = ["serve", "serving"]


def serve(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get("GROUPFLOW_API_KEY") or None
    host = args.host
    check_bind(host, api_key)  # before minutes of model loading
    cfg, policy = serving(args)
    defaults = replace(policy.sampling, n=1)
    core = server_core(cfg, policy.tokenizer, policy.rollout, defaults,
                       OpenAccess(api_key))  # fmt: skip
    port = cfg.serve.port if args.port is None else args.port
    print(
        f"serving model '{core.model_name}' on http://{host}:{port}/v1 (Ctrl-C stops)", flush=True
    )
    uvicorn.run(build_app(core), host=host, port=port, log_level="warning")
    return 0


def serving(args: argparse.Namespace):
    """(config with Hub ids resolved, policy) for ``groupflow serve``: a run's config (its
    checkpoint with ``--checkpoint``), or a plain model — a local Hugging Face directory or a
    Hub id in the HF cache — with no config at all (only the policy is built: no data)."""
    if _serve_target(args.config) == "config":
        trainer = load_trainer_for_inference(args)
        return resolve_hub_models(trainer.cfg), trainer.policy
    if args.checkpoint:
        raise ValueError(
            f"--checkpoint needs the run's config: groupflow serve CONFIG --checkpoint "
            f"{args.checkpoint} ('{args.config}' is a model, served as it is)"
        )
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
