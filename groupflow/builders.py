"""Builders: turn the typed config into plain objects (tokenizer, model, data, rewards, worker).

Design decision: this is the only module that reads config sections to construct things; the
objects it returns take plain arguments and never see the config again (style.md principle 6).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from groupflow.config import Config, ModelConfig
from groupflow.data import (
    DataError,
    PromptRow,
    load_prompt_rows,
    make_task_rows,
    render_prompt,
    train_char_tokenizer,
)
from groupflow.data.tokenizer import DEFAULT_ALPHABET
from groupflow.distributed import PoolSpec, RayOptions, WorkerGroup
from groupflow.models.causal_lm import ModelLoadError, build_tiny_llama, load_causal_lm
from groupflow.rewards import build_reward_runner

log = logging.getLogger("groupflow")

__all__ = [
    "EncodedPrompts",
    "build_tokenizer",
    "build_model",
    "build_data",
    "build_reward",
    "build_rollout_engine",
    "encode_prompts",
    "build_policy",
    "role_group",
    "pool_spec",
    "total_cpus",
]


@dataclass
class EncodedPrompts:
    """Prompt rows with their rendered text and token ids (computed once at load)."""

    rows: list[PromptRow]
    texts: list[str]
    ids: list[list[int]]
    num_filtered: int = 0


def tokenizer_dir(cfg: Config, run_dir: Path) -> Path:
    """Where the tokenizer lives: the run's own (tiny models) or the model's local directory."""
    m = cfg.model
    if m.tiny is not None and m.tokenizer_path is None:
        return run_dir / "tokenizer"
    return Path(m.tokenizer_path or m.path).expanduser()


def build_tokenizer(cfg: Config, run_dir: Path, corpus: list[PromptRow] = ()):
    """Load the tokenizer from a local directory, or train a character tokenizer on ``corpus``.

    The tiny model's vocabulary is exactly the characters of the data (prompts and answers): a
    small output space is what lets a 0.2M-parameter model learn quickly on a CPU.
    """
    from transformers import AutoTokenizer

    m = cfg.model
    if m.tiny is not None and m.tokenizer_path is None:
        saved = run_dir / "tokenizer"
        if saved.is_dir():  # resume: reuse the exact tokenizer the run started with
            return AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
        texts = [str(r.prompt) for r in corpus] + [
            str(v) for r in corpus for v in r.fields.values()
        ]
        tok = train_char_tokenizer(texts, base_alphabet="" if corpus else DEFAULT_ALPHABET)
        tok.save_pretrained(str(saved))
        return tok
    path = Path(m.tokenizer_path or m.path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"tokenizer path '{path}' does not exist or is not a directory")
    tok = AutoTokenizer.from_pretrained(
        str(path), trust_remote_code=m.trust_remote_code, local_files_only=True
    )
    if tok.pad_token_id is None:
        # Padding is masked everywhere, so any id works; EOS is the usual choice (as TRL does).
        tok.pad_token = tok.eos_token
    return tok


def eos_ids(tokenizer, model) -> list[int]:
    ids = {tokenizer.eos_token_id}
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(extra, int):
        ids.add(extra)
    elif isinstance(extra, (list, tuple)):
        ids.update(extra)
    ids.discard(None)
    if not ids:
        raise ModelLoadError(
            "the tokenizer has no EOS token; generation could never stop on its own"
        )
    return sorted(ids)


def build_model(m: ModelConfig, tokenizer, seed: int):
    """The policy model: a tiny Llama built from ``m.tiny`` (initialised from ``seed`` unless it sets
    its own) or an HF model loaded from the local directory ``m.path``."""
    if m.tiny is not None:
        t = m.tiny
        model = build_tiny_llama(
            len(tokenizer),
            hidden_size=t.hidden_size,
            num_layers=t.num_layers,
            num_heads=t.num_heads,
            intermediate_size=t.intermediate_size,
            max_positions=t.max_positions,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            seed=seed if t.seed is None else t.seed,
        )
    else:
        model = load_causal_lm(m.path, dtype=m.dtype, trust_remote_code=m.trust_remote_code)
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def build_data(cfg: Config) -> tuple[list[PromptRow], list[PromptRow], dict[str, float]]:
    """Training and validation rows plus load statistics (skipped malformed rows).

    The built-in task's held-out split never overlaps its training split.
    """
    d = cfg.data
    if d.task is not None:
        train, val = make_task_rows(
            d.task.name, d.task.num_train, d.task.num_val, d.task.seed, digits=d.task.digits
        )
        train_set, val_set = load_prompt_rows(train), load_prompt_rows(val)
    else:
        train_set = load_prompt_rows(d.train_files, on_bad_row=d.bad_rows)
        val_set = load_prompt_rows(d.val_files, on_bad_row=d.bad_rows) if d.val_files else None
    val_rows = list(val_set) if val_set is not None else []
    if d.max_val_prompts is not None:
        val_rows = val_rows[: d.max_val_prompts]
    stats = {
        "data/train_rows": float(len(train_set)),
        "data/train_skipped_bad_rows": float(train_set.num_skipped),
        "data/val_rows": float(len(val_rows)),
        "data/val_skipped_bad_rows": float(val_set.num_skipped if val_set is not None else 0),
    }
    return list(train_set), val_rows, stats


def encode_prompts(rows: list[PromptRow], tokenizer, cfg: Config, split: str) -> EncodedPrompts:
    """Render (chat template where asked) and tokenize each prompt once; filter or reject over-long ones."""
    d = cfg.data
    texts = [render_prompt(r, tokenizer, d.use_chat_template) for r in rows]
    # A chat template writes its own special tokens into the text; a plain prompt gets the
    # tokenizer's usual BOS (if it has one).
    templated = [r.is_chat or bool(d.use_chat_template) for r in rows]
    ids = [
        tokenizer(t, add_special_tokens=not chat)["input_ids"] for t, chat in zip(texts, templated)
    ]
    keep = []
    for r, t, i in zip(rows, texts, ids):
        if len(i) <= d.max_prompt_tokens:
            keep.append((r, t, i))
        elif d.overlong_prompts == "error":
            raise DataError(
                f"{split} prompt from {r.source}, row {r.index} has {len(i)} tokens, more than "
                f"data.max_prompt_tokens={d.max_prompt_tokens} (set data.overlong_prompts=filter to skip such rows)"
            )
    filtered = len(rows) - len(keep)
    if filtered:
        log.warning(
            "%s data: filtered %d prompt(s) longer than %d tokens",
            split,
            filtered,
            d.max_prompt_tokens,
        )
    if not keep:
        raise DataError(
            f"every {split} prompt is longer than data.max_prompt_tokens={d.max_prompt_tokens}"
        )
    rows_, texts_, ids_ = (list(x) for x in zip(*keep))
    return EncodedPrompts(rows_, texts_, ids_, filtered)


def build_reward(cfg: Config):
    specs = [s.model_dump() for s in cfg.reward.functions] or None
    return build_reward_runner(specs, failure_value=cfg.reward.failure_value)


def build_rollout_engine(cfg: Config):
    """Plain options of the vLLM engine for the actor workers, or None for the HF engine.

    Called at start-up: ``rollout.engine=vllm`` without vLLM installed fails here, naming the
    install command, before any data or model is loaded.
    """
    from groupflow.rollout.vllm_engine import VLLMOptions, require_vllm

    if cfg.rollout.engine == "hf":
        return None
    require_vllm()
    v = cfg.rollout.vllm
    return VLLMOptions(
        gpu_memory_utilization=v.gpu_memory_utilization,
        sleep_mode=v.sleep_mode,
        cpu_kv_cache_gib=v.cpu_kv_cache_gib,
        max_model_len=v.max_model_len,
        dtype=v.dtype,
        enforce_eager=v.enforce_eager,
        enable_prefix_caching=v.enable_prefix_caching,
        seed=cfg.run.seed,
    )


def build_policy(cfg: Config, run_dir: Path):
    """The policy object for a non-LLM policy type (``diffusion:``), or None for the built-in LLM policy."""
    if cfg.diffusion is None:
        return None
    from groupflow.diffusion.policy import DiffusionPolicy

    return DiffusionPolicy(cfg, run_dir)


# ----- worker groups: where each role runs ---------------------------------------------------------


def role_group(config: Config, role: str, worker_cls, /, **kwargs) -> WorkerGroup:
    """The worker group of one role, placed in the pool ``config.placement`` gives it; ``kwargs``
    go to the worker's constructor."""
    spec, run = pool_spec(config, role), config.run
    if run.backend == "ray" and not run.ray_address:
        # Declare logical CPUs for every role's pool at once: Ray starts with the first group, and
        # a later pool asking for more than was declared would wait for the placement timeout.
        import os

        from groupflow.distributed.group import ensure_ray

        ensure_ray(None, num_cpus=max(os.cpu_count() or 1, int(total_cpus(config)) + 2))
    return WorkerGroup(
        worker_cls, spec.world_size, backend=run.backend, timeout_s=run.worker_timeout_s,
        ray_options=RayOptions(address=run.ray_address), pool=spec,
        placement_timeout_s=config.placement.timeout_s, **kwargs,
    )  # fmt: skip


def pool_spec(cfg: Config, role: str) -> PoolSpec:
    """A role's pool; the critic and reward model take the actor's shape unless placed otherwise."""
    pool = getattr(cfg.placement, role)
    if pool is None:
        return replace(pool_spec(cfg, "actor"), name=role)
    default = cfg.run.num_workers // pool.nodes if role == "actor" else 1
    return PoolSpec(pool.nodes, pool.workers_per_node or default, pool.cpus_per_worker,
                    pool.gpus_per_worker, name=role)  # fmt: skip


def total_cpus(cfg: Config) -> float:
    """Logical CPUs every pool of this run reserves together (a local Ray instance declares them)."""
    roles = ["actor"] + [
        r for r in ("rollout", "reference") if getattr(cfg.placement, r) != "colocated"
    ]
    roles += [r for r in ("critic", "reward_model") if getattr(cfg, r) is not None]
    return sum(pool_spec(cfg, r).world_size * pool_spec(cfg, r).cpus_per_worker for r in roles)
