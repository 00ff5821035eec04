"""Causal LMs: build a tiny one from a config, load a real one from a local HF directory.

Design decision: groupflow uses plain HF ``PreTrainedModel`` objects and touches them only through
three narrow helpers — ``decoder_forward`` (hidden states), the output embedding (LM head) and a
KV-cache forward used by the rollout engine. That keeps every HF causal LM (Llama, Qwen, SmolLM,
Mistral...) usable without per-architecture code, and lets log-probs be computed from hidden states
in chunks so memory never holds B·T·V logits at once.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "ModelLoadError",
    "build_tiny_llama",
    "load_causal_lm",
    "cache_kwarg",
    "token_positions",
]


class ModelLoadError(ValueError):
    """A model or tokenizer path is missing or not an HF directory."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype '{name}'; valid: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def build_tiny_llama(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_positions: int = 128,
    tie_embeddings: bool = True,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    seed: int = 0,
) -> nn.Module:
    """A small Llama-architecture LM, randomly initialised from ``seed`` (for tests and the demo)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} must be divisible by num_heads {num_heads}")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or int(hidden_size * 8 / 3 + 7) // 8 * 8,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    # Initialisation draws from the global RNG; fork it so building a model does not shift the
    # caller's random stream (resume must replay identical numbers).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def load_causal_lm(
    path: str | Path,
    *,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    gguf_file: str | None = None,
) -> nn.Module:
    """Load an HF causal LM from a local directory (never from a hub: no network at run time)."""
    from transformers import AutoModelForCausalLM

    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"model path '{path}' does not exist or is not a directory")
    if gguf_file is None and not (path / "config.json").is_file():
        raise ModelLoadError(
            f"model path '{path}' has no config.json: it is not a Hugging Face model directory "
            "(for a GGUF file, convert it first with `groupflow convert-gguf`)"
        )
    if gguf_file is not None and not (path / gguf_file).is_file():
        raise ModelLoadError(f"GGUF file '{gguf_file}' not found in '{path}'")
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=resolve_dtype(dtype), **kwargs
        )
    except ValueError as e:
        if "trust_remote_code" in str(e) and not trust_remote_code:
            raise ModelLoadError(
                f"model at '{path}' needs custom code; set model.trust_remote_code=true if you trust it"
            ) from e
        raise
    return model


def read_model_type(path: str | Path) -> str | None:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    return json.loads(cfg.read_text()).get("model_type")


def cache_kwarg(model: nn.Module) -> str:
    """Name of the KV-cache argument: transformers >= 5.x calls it ``cache``, older ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def token_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded rows: 0 at the first real token, pads clamped to 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def decoder_hidden_states(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Last hidden states [B, L, H] of the decoder stack, without the LM head."""
    decoder = model.get_decoder()
    out = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=token_positions(attention_mask),
        use_cache=False,
    )
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
