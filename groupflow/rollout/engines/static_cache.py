"""Decode steps with a preallocated KV cache for Llama-family HF models.

Design decision: HF's ``DynamicCache`` concatenates every layer's keys and values with the new
token at every decode step (the whole cache is copied T times: O(T²) memory traffic), and the HF
forward rebuilds attention masks and position embeddings through several layers of generic code
per step. For the small and mid-sized models groupflow runs on CPUs that plumbing costs as much as
the math. This module keeps HF's own modules for all of the math — embeddings, norms, the
q/k/v/o projections (biases included), Qwen3's q/k norms, the rotary embedding and the MLP — so
weights and numerics stay the model's (the LM head's output goes through the model's final logit
transform, ``models/logit_transform``), and replaces only the plumbing: K/V live in buffers sized
prompt + max_new_tokens, written in place, and attention reads the filled prefix.

Only architectures whose decoder layer is exactly "pre-norm attention + pre-norm MLP with full
causal attention" are driven this way (``SUPPORTED_MODEL_TYPES``); anything else — another model
type, sliding-window layers that would matter, a PEFT wrapper, an unexpected module layout —
makes ``StaticDecoder.build`` return None and the caller uses the plain HF forward, so this is a
speed path, never a requirement. Tests check tokens and log-probs against the HF forward.

Two parts of a step are computed differently from HF's forward, because a profile of SmolLM2-135M
(16 rows, 128 new tokens, fp32 CPU; ``benchmarks/README.md``) showed them as the largest costs
after the layer GEMMs: on a CPU, attention reads each key/value head once for the query heads that
share it (``grouped_attention``: grouped-query attention as two batched matmuls — HF's eager
formula — where SDPA's CPU kernel walks the cache once per query head; other devices keep SDPA),
and the LM head runs on the faster CPU kernel where that is safe (``rollout/kernels.py``). Both
change only the summation order, i.e. float rounding.
"""

from __future__ import annotations

import inspect
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from groupflow.distributed.parallel import gathered
from groupflow.models.causal_lm import full_attention_only
from groupflow.models.logit_transform import lm_logits
from groupflow.rollout.engines.kernels import head_kernel

__all__ = ["SUPPORTED_MODEL_TYPES", "StaticDecoder", "grouped_attention", "unsupported_reason"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.56
        return layers[layer].keys, layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def _layers(model: nn.Module) -> nn.ModuleList:
    """A supported model's decoder layers (``unsupported_reason`` checked ``.model.layers``)."""
    return cast(nn.ModuleList, cast(nn.Module, model.model).layers)


def unsupported_reason(model: nn.Module, total_len: int) -> str | None:
    """Why ``model`` cannot use the static-cache decode for ``total_len`` positions (None: it can)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    inner = getattr(model, "model", None)
    for name in ("layers", "embed_tokens", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            return f"the model has no .model.{name}"
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        return "the model has no lm_head"
    if not full_attention_only(model, total_len):
        return f"sliding-window or non-full-attention layers at {total_len} positions"
    if _rope_function(model) is None:
        return "the model's module has no apply_rotary_pos_emb"
    return None


def grouped_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_pad: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attention of one new query per row over the cached keys: q [B, Hq, 1, D], keys/values
    [B, Hkv, L, D], ``key_pad`` [B, 1, 1, L] True where a key is padding (or None) -> [B, Hq·D].

    Query head j attends with key/value head j // (Hq / Hkv), as HF's ``repeat_kv`` pairs them;
    the Hq / Hkv query heads of a group form the rows of one matmul against their shared keys, so
    the cache is read once per key/value head (SDPA's CPU kernel reads it once per query head:
    3× the bytes for SmolLM2's 9/3 heads). The arithmetic is HF's eager attention: scores scaled
    after the product, masked, softmax in float32 cast back to the values' dtype, times the
    values.
    """
    rows, q_heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(rows, kv_heads, q_heads // kv_heads, dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).mul_(scale)  # [B, Hkv, G, L]
    if key_pad is not None:
        scores.masked_fill_(key_pad, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(probs, values).reshape(rows, q_heads * dim)


def _sdpa(q, keys, values, key_pad, scale) -> torch.Tensor:
    """The same attention through SDPA, whose fused GPU kernels beat two matmuls there (the
    grouped form was measured faster on CPUs only)."""
    out = F.scaled_dot_product_attention(
        q,
        keys,
        values,
        attn_mask=None if key_pad is None else ~key_pad,
        scale=scale,
        enable_gqa=q.shape[1] != keys.shape[1],
    )
    return out.reshape(q.shape[0], -1)  # [B, Hq, 1, D] -> [B, Hq·D]


def _rope_function(model: nn.Module):
    # The model's own rotary application (same formula, same floating-point order).
    return getattr(inspect.getmodule(type(model)), "apply_rotary_pos_emb", None)


class StaticDecoder:
    """Decodes one token per row per ``step``; K/V of the prompt are copied in once by ``build``."""

    def __init__(self, model: nn.Module, keys, values, key_pad: torch.Tensor | None,
                 prompt_len: int):  # fmt: skip
        self.model = model
        # HF's decoder stack, whose modules unsupported_reason checked (nn.Module's __getattr__
        # types each of them as Tensor | Module)
        self.inner: Any = model.model
        rope = _rope_function(model)
        assert rope is not None, "unsupported_reason checked the model's apply_rotary_pos_emb"
        self.rope = rope
        # chosen per generation: the weights (and so the probe) change with every update
        self.head = head_kernel(cast(nn.Module, model.lm_head))  # checked by unsupported_reason
        device = next(model.parameters()).device
        self.attend = grouped_attention if device.type == "cpu" else _sdpa
        self.keys, self.values = keys, values  # per layer [B, H_kv, prompt_len + new, D]
        # [B, 1, 1, L] over all columns, True at padding; None when no prompt is padded
        self.key_pad = key_pad
        self.prompt_len = prompt_len

    @classmethod
    def build(
        cls,
        model: nn.Module,
        cache,
        prompt_mask: torch.Tensor,
        repeats: int,
        max_new_tokens: int,
    ) -> StaticDecoder | None:
        """A decoder whose cache holds the prefilled ``cache`` (one row per prompt) repeated
        ``repeats`` times per prompt, or None where the model is not supported."""
        prompt_len = prompt_mask.shape[1]
        if unsupported_reason(model, prompt_len + max_new_tokens) is not None:
            return None
        keys, values = [], []
        for i in range(len(_layers(model))):
            k, v = _kv(cache, i)
            if k.shape[2] != prompt_len:
                return None  # an unexpected cache layout: let HF's forward handle it
            shape = (k.shape[0] * repeats, k.shape[1], prompt_len + max_new_tokens, k.shape[3])
            k_buf = k.new_empty(shape)
            v_buf = v.new_empty(shape)
            k_buf[:, :, :prompt_len] = k.repeat_interleave(repeats, dim=0)
            v_buf[:, :, :prompt_len] = v.repeat_interleave(repeats, dim=0)
            keys.append(k_buf)
            values.append(v_buf)
        key_pad = None
        if not bool(prompt_mask.all()):
            pad = prompt_mask.repeat_interleave(repeats, dim=0) == 0
            new = torch.zeros(pad.shape[0], max_new_tokens, dtype=torch.bool, device=pad.device)
            key_pad = torch.cat([pad, new], dim=1)[:, None, None, :]
        return cls(model, keys, values, key_pad, prompt_len)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, t: int,
             columns: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Logits [B, V] after feeding ``tokens`` [B] at ``positions`` [B] (the t-th new token).
        ``columns`` [B] (continuous batching, ``rollout.continuous``): each row's key/value go
        to its own column, ``prompt_len + t`` being the last of them (the attention's width)."""
        inner = self.inner
        col = self.prompt_len + t
        if columns is None:
            at = (slice(None), slice(None), col)
        else:
            at = (torch.arange(len(columns), device=columns.device), slice(None), columns)
        x = inner.embed_tokens(tokens)  # [B, H]: one position per row, so no length axis
        cos, sin = inner.rotary_emb(x, positions[:, None])  # [B, 1, D]
        pad = None if self.key_pad is None else self.key_pad[..., : col + 1]
        for i, layer in enumerate(inner.layers):
            with gathered(layer):  # a sharded layer: its weights for this step only
                x = self._layer(i, layer, x, cos, sin, pad, col, at)
        return lm_logits(self.model, inner.norm(x), self.head)

    def _layer(self, i, layer, x, cos, sin, pad, col, at) -> torch.Tensor:
        """Layer ``i``'s step: [B, H] -> [B, H], its K/V written at ``at`` (column ``col`` of
        every row, or each row's own), attention over the columns up to ``col``."""
        rows = x.shape[0]
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        # [B, heads, 1, D]: HF's [B, 1, heads, D].transpose(1, 2), without the transpose
        q = attn.q_proj(h).view(rows, -1, 1, attn.head_dim)
        k = attn.k_proj(h).view(rows, -1, 1, attn.head_dim)
        v = attn.v_proj(h).view(rows, -1, 1, attn.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rope(q, k, cos, sin)
        self.keys[i][at] = k[:, :, 0]
        self.values[i][at] = v[:, :, 0]
        out = self.attend(
            q, self.keys[i][:, :, : col + 1], self.values[i][:, :, : col + 1], pad, attn.scaling
        )
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x
