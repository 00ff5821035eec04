"""The server from a run's config: ``serve`` section limits, ``rollout`` sampling and parser.

Design decision: ``groupflow serve`` and a training run's in-process server are built by this one
function from the same config, over a policy's rollout group (local or Ray, any engine), so what
a checkpoint serves is what the run trained through.
"""

from __future__ import annotations

import json
from pathlib import Path

from groupflow.config import Config, present
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.serve.access import Access
from groupflow.serve.batcher import group_batcher
from groupflow.serve.core import ServeLimits, ServerCore

__all__ = ["server_core", "context_length"]

_FALLBACK_CONTEXT = 4096


def context_length(cfg: Config) -> int:
    """``serve.max_context_tokens``, else the model's positions (tiny config or config.json)."""
    if cfg.serve.max_context_tokens is not None:
        return cfg.serve.max_context_tokens
    m = present(cfg.model, "model")
    if m.tiny is not None:
        return m.tiny.max_positions
    config = Path(present(m.path, "model.path")).expanduser() / "config.json"
    if config.is_file():
        n = json.loads(config.read_text()).get("max_position_embeddings")
        if isinstance(n, int) and n > 0:
            return n
    return _FALLBACK_CONTEXT


def server_core(cfg: Config, tokenizer, rollout, defaults: SamplingParams,
                access: Access | None = None) -> ServerCore:  # fmt: skip
    """The server over a policy's rollout group ``rollout`` (``serve.batcher.group_batcher``)."""
    s = cfg.serve
    limits = ServeLimits(
        max_body_bytes=s.max_body_bytes, max_tokens=s.max_tokens,
        max_context_tokens=context_length(cfg), max_n=s.max_n,
        max_conversations=s.max_conversations, max_batch_samples=s.max_batch_samples,
        max_pending_samples=s.max_pending_samples, max_prompt_chars=s.max_prompt_chars,
    )  # fmt: skip
    batcher = group_batcher(
        rollout, continuous=s.continuous_batching, prefix_tokens=s.prefix_cache_tokens,
        max_batch_samples=s.max_batch_samples,
        max_pending_samples=s.max_pending_samples, wait_s=s.batch_wait_ms / 1000,
    )  # fmt: skip
    return ServerCore(
        tokenizer, batcher, defaults, model_name=s.model_name or cfg.run.name, limits=limits,
        access=access, tool_parser=cfg.rollout.tool_parser, describe_tools=s.describe_tools,
    )  # fmt: skip
