"""The run directory: does this process start a run there, or continue the one it holds?

Design decision: a run directory holds exactly one run. Before any model is built, the trainer
decides from ``run.resume``, ``run.overwrite`` and the directory's contents whether it continues
the run there (resume) or starts one (fresh), and refuses what would silently mix two runs:

- A fresh start into a directory that holds an earlier run (metrics, samples, checkpoints, plots,
  logger directories) is refused unless ``run.overwrite`` is true; then the entries groupflow
  writes (``RUN_ENTRIES``) are deleted first and nothing else is touched. Leftovers of a start
  that never logged a step (a tokenizer, a config.yaml) are cleared without asking. Either way a
  fresh run never reuses an old tokenizer.
- A resume compares the checkpoint's config (saved inside the checkpoint, else the run's
  config.yaml) with this one, key by key. Keys that only change bookkeeping, speed/memory or
  what is evaluated (``SAFE_TO_CHANGE``) may differ; any other difference stops the resume with a
  diff of the keys, unless the key (or its section) is listed in ``run.allow_config_changes``.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import yaml

from groupflow.config import Config, ConfigError, config_from_dict
from groupflow.run.checkpoint import find_latest_checkpoint
from groupflow.utils.env import redact_secrets

__all__ = [
    "RUN_ENTRIES",
    "SAFE_TO_CHANGE",
    "RunDirError",
    "checkpoint_config",
    "clear_run_dir",
    "config_diff",
    "earlier_run",
    "plain_config",
    "prepare_run_dir",
    "relevant_changes",
]

log = logging.getLogger("groupflow")

# Everything a training run writes into its directory (tracking.py, checkpoint.py,
# assembly/tokenizers.py, plotting.py, diffusion/policy.py). Files and directories of any other name are the user's.
RUN_ENTRIES = (
    "config.yaml",
    "metrics.jsonl",
    "samples.jsonl",
    "checkpoints",
    "tokenizer",
    "plots",
    "images",
    "tensorboard",
    "wandb",
    "mlruns",
    "wandb_run_id.txt",
    "mlflow_run_id.txt",
)
# The entries that show a run got as far as logging or saving something; the others (a
# tokenizer, config.yaml) are also left by a start that failed before its first step.
_EVIDENCE = (
    "metrics.jsonl",
    "samples.jsonl",
    "checkpoints",
    "plots",
    "images",
    "tensorboard",
    "wandb",
    "mlruns",
)
# Temp files of the atomic writers (run.files.atomic_write_text): ".tmp_<name>_<pid>".
_TMP_FILE = re.compile(r"^\.tmp_(.+)_\d+$")

# Keys a resume may change without being told: they decide where and how the run is written and
# logged, where and how fast it runs (resharding, placement, micro-batching and the decode path
# give the same numbers), or what is evaluated — not what is trained. A longer run.total_steps
# stretches a cosine LR schedule from the resumed step on. Dotted prefixes: a section covers
# every key under it.
SAFE_TO_CHANGE = (
    "run.name",
    "run.output_dir",
    "run.total_steps",
    "run.resume",
    "run.overwrite",
    "run.allow_config_changes",
    "run.save_every",
    "run.save_final",
    "run.keep_last",
    "run.loggers",
    "run.console_every",
    "run.samples_every",
    "run.samples_token_ids",
    "run.num_threads",
    "run.backend",
    "run.num_workers",
    "run.ray_address",
    "run.worker_timeout_s",
    "placement",
    "parallel.sequence_parallel",
    "model.gradient_checkpointing",
    "diffusion.fsdp",
    "diffusion.activation_checkpointing",
    "actor.micro_batch_samples",
    "actor.micro_batch_tokens",
    "actor.logprob_chunk_tokens",
    "actor.share_prompt_prefix",
    "critic.micro_batch_samples",
    "critic.micro_batch_tokens",
    "reward_model.micro_batch_samples",
    "rollout.static_kv_cache",
    "rollout.vllm.gpu_memory_utilization",
    "rollout.vllm.sleep_mode",
    "rollout.vllm.cpu_kv_cache_gib",
    "rollout.vllm.enforce_eager",
    "validation",
    "data.val_files",
    "data.max_val_prompts",
    "diffusion.eval_sampler",
    "diffusion.eval_samples_per_prompt",
    "diffusion.save_images",
)
_ABSENT = object()


class RunDirError(ValueError):
    """The run directory holds another run, or a checkpoint belongs to a different config."""


# ----- config comparison (pure) ---------------------------------------------------------------


def plain_config(cfg: Config) -> dict[str, Any]:
    """The config as config.yaml and the checkpoint record it: JSON types, secrets redacted."""
    return redact_secrets(cfg.to_dict())


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value. Lists of sections are indexed (``reward.functions.0.kwargs.mode``);
    lists of plain values are one value; an empty section is no key at all."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        out = {}
        for i, value in enumerate(obj):
            out.update(_flatten(value, f"{prefix}.{i}"))
        return out
    return {prefix: obj}


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (old value, new value) for every key whose value differs; a key present on
    one side only has a marker on the other (shown as "(absent)", never confused with None)."""
    a, b = _flatten(old), _flatten(new)
    return {
        key: (a.get(key, _ABSENT), b.get(key, _ABSENT))
        for key in sorted(set(a) | set(b))
        if a.get(key, _ABSENT) != b.get(key, _ABSENT)
    }


def _covered(key: str, prefixes: tuple[str, ...] | list[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def relevant_changes(
    diff: dict[str, tuple[Any, Any]], allowed: list[str] | tuple[str, ...] = ()
) -> dict[str, tuple[Any, Any]]:
    """The differences that are neither safe to change nor explicitly allowed."""
    return {
        k: v
        for k, v in diff.items()
        if not _covered(k, SAFE_TO_CHANGE) and not _covered(k, allowed)
    }


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else repr(value)


def _normalised(config: dict[str, Any]) -> dict[str, Any]:
    """An older run's config with today's defaults filled in, so that a key added since then does
    not count as a change (the raw dict when it no longer validates)."""
    try:
        return plain_config(config_from_dict(config, "<checkpoint config>"))
    except ConfigError:
        return config


# ----- what a directory holds -------------------------------------------------------------------


def _has_content(path: Path) -> bool:
    if path.is_symlink() or path.is_file():
        return path.is_symlink() or path.stat().st_size > 0
    return path.is_dir() and any(path.iterdir())


def earlier_run(run_dir: Path) -> list[str]:
    """The entries of ``run_dir`` that show an earlier run logged or saved something there."""
    return [name for name in _EVIDENCE if _has_content(run_dir / name)]


def _ours(run_dir: Path) -> list[Path]:
    if not run_dir.is_dir():
        return []
    found = [
        run_dir / name
        for name in RUN_ENTRIES
        if (run_dir / name).exists() or (run_dir / name).is_symlink()
    ]
    found += [
        p
        for p in run_dir.iterdir()
        if p.is_file() and (m := _TMP_FILE.match(p.name)) and m.group(1) in RUN_ENTRIES
    ]
    return found


def clear_run_dir(run_dir: Path) -> list[str]:
    """Delete what groupflow writes into ``run_dir`` (``RUN_ENTRIES`` and their temp files);
    returns the names removed. Anything else there — an export, the user's notes — stays, and a
    symlinked entry loses only the link, never its target."""
    removed = []
    for path in _ours(run_dir):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(path.name)
    return removed


def checkpoint_config(checkpoint: Path) -> dict[str, Any] | None:
    """The config a checkpoint was written under: its own ``config`` component (written by the
    trainer since run-directory checks exist), else its run's config.yaml; None if neither."""
    try:
        manifest = json.loads((checkpoint / "manifest.json").read_text(encoding="utf-8"))
        info = manifest["components"]["config"]
        if info.get("format") == "json":
            return json.loads((checkpoint / info["file"]).read_text(encoding="utf-8"))
    except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError):
        pass
    run_yaml = checkpoint.parent.parent / "config.yaml"
    if checkpoint.parent.name == "checkpoints" and run_yaml.is_file():
        loaded = yaml.safe_load(run_yaml.read_text(encoding="utf-8"))
        return loaded if isinstance(loaded, dict) else None
    return None


# ----- the decision -------------------------------------------------------------------------------


def check_resume_config(cfg: Config, checkpoint: Path) -> None:
    """Refuse to resume ``checkpoint`` under a config whose training-relevant keys differ."""
    old = checkpoint_config(checkpoint)
    if old is None:
        log.warning(
            "cannot check that %s was written under this config: it has no config component and "
            "its run has no config.yaml",
            checkpoint,
        )
        return
    diff = config_diff(_normalised(old), plain_config(cfg))
    relevant = relevant_changes(diff, cfg.run.allow_config_changes)
    if relevant:
        keys = ",".join(relevant)
        lines = [
            f"run.resume: checkpoint {checkpoint} was written under a different configuration; "
            f"{len(relevant)} training-relevant key(s) differ (checkpoint → now). Resume with the "
            "checkpoint's values, start a new run (another run.name, or run.overwrite=true to "
            f"replace this one), or accept the change with run.allow_config_changes=[{keys}]:"
        ]
        lines += [f"  - {k}: {_show(a)} → {_show(b)}" for k, (a, b) in relevant.items()]
        raise RunDirError("\n".join(lines))
    if diff:
        log.info(
            "resuming %s with changed keys: %s",
            checkpoint,
            "; ".join(f"{k}: {_show(a)} → {_show(b)}" for k, (a, b) in diff.items()),
        )


def _inside(path: Path, directory: Path) -> bool:
    return path.resolve().is_relative_to(directory.resolve())


def _start_fresh(cfg: Config, run_dir: Path, why: str) -> None:
    """Make ``run_dir`` hold no earlier run: refuse one unless run.overwrite, then clear ours."""
    found = earlier_run(run_dir)
    if found and not cfg.run.overwrite:
        raise RunDirError(
            f"run directory {run_dir} holds an earlier run ({', '.join(found)}) and {why}; a new "
            "run there would mix with it. Set run.overwrite=true to delete it (only the files "
            "groupflow writes) and start afresh, or choose another run.name or run.output_dir"
        )
    removed = clear_run_dir(run_dir)
    if found:
        log.warning(
            "run.overwrite: deleted the earlier run in %s (%s)", run_dir, ", ".join(removed)
        )
    elif removed:
        log.info("cleared what a start that never logged a step left in %s: %s", run_dir, removed)


def prepare_run_dir(cfg: Config, run_dir: Path) -> Path | None:
    """Decide fresh start or resume, clearing or refusing as the module docstring says.

    Returns the checkpoint to resume from, or None for a fresh run. Call it before anything reads
    or writes ``run_dir`` (the tokenizer in particular).
    """
    run = cfg.run
    if run.resume not in ("auto", "never"):
        path = Path(run.resume)
        if not path.is_dir():
            raise FileNotFoundError(f"run.resume: checkpoint directory '{path}' does not exist")
        if _inside(path, run_dir):
            if run.overwrite:
                raise RunDirError(
                    f"run.overwrite=true would delete {path}, the checkpoint run.resume names; "
                    "unset one of them"
                )
        else:  # continuing another run's checkpoint in a directory of its own
            _start_fresh(cfg, run_dir, f"run.resume names a checkpoint of another run ({path})")
            _adopt_tokenizer(path, run_dir)
        check_resume_config(cfg, path)
        return path
    if run.resume == "auto" and not run.overwrite:
        path = find_latest_checkpoint(run_dir / "checkpoints")
        if path is not None:
            check_resume_config(cfg, path)
            return path
        why = "no complete checkpoint to resume from"
    else:
        why = "run.resume=never" if run.resume == "never" else "run.overwrite=true"
    _start_fresh(cfg, run_dir, why)
    return None


def _adopt_tokenizer(checkpoint: Path, run_dir: Path) -> None:
    """A checkpoint's weights index its own run's vocabulary: take that tokenizer along."""
    source = checkpoint.parent.parent / "tokenizer"
    if checkpoint.parent.name == "checkpoints" and source.is_dir():
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copytree(source, run_dir / "tokenizer")
