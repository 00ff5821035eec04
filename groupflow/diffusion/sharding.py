"""FSDP2 and activation checkpointing for the flow model, and its full (world-size-free) state.

Design decision: the diffusion worker shards exactly like the LLM actor — each transformer block,
then the root — with ``groupflow.distributed.parallel.shard``; the blocks are found by name
(``blocks`` in Wan and the tiny model, ``transformer_blocks`` in SD3). Checkpoints hold the FULL
model and optimizer state keyed by parameter name (``torch.distributed.checkpoint.state_dict``),
gathered on every rank, so a run saved with N workers resumes with M (resharding is loading).
"""

from __future__ import annotations

from torch import nn

__all__ = [
    "flow_layers",
    "enable_activation_checkpointing",
    "full_state",
    "load_full_state",
    "memory_stats",
]


def _transformer(model: nn.Module) -> nn.Module:
    return getattr(model, "transformer", model)


def flow_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 shards one by one (the root keeps embeddings and heads)."""
    inner = _transformer(model)
    for name in ("blocks", "transformer_blocks"):
        blocks = getattr(inner, name, None)
        if isinstance(blocks, nn.ModuleList):
            return list(blocks)
    raise ValueError(
        f"diffusion.fsdp: {type(inner).__name__} has no `blocks` / `transformer_blocks` list to shard"
    )


def enable_activation_checkpointing(model: nn.Module) -> None:
    """diffusers' own switch: each block's activations are recomputed in the backward pass."""
    inner = _transformer(model)
    if not hasattr(inner, "enable_gradient_checkpointing"):
        raise ValueError(
            "diffusion.activation_checkpointing is for the diffusers transformers (kind sd3 / wan), "
            f"not {type(inner).__name__}"
        )
    inner.enable_gradient_checkpointing()


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def memory_stats(model: nn.Module, optimizer) -> dict[str, float]:
    """Bytes of this rank's parameters, gradients and optimizer state (local shards), and the
    process's peak resident set (Linux ru_maxrss, KiB) — the numbers the memory benchmark prints."""
    import resource

    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel")]
    return {
        "param_bytes": float(sum(_local_bytes(p) for p in params)),
        "grad_bytes": float(sum(_local_bytes(p.grad) for p in params if p.grad is not None)),
        "optimizer_bytes": float(sum(_local_bytes(v) for v in state if v.dim() > 0)),
        "peak_rss_bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
    }


def full_state(model: nn.Module, optimizer) -> tuple[dict, dict]:
    """Full model and optimizer state by parameter name, on CPU (a collective when sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, optimizer, options=opts)


def load_full_state(model: nn.Module, optimizer, model_state: dict, optim_state: dict) -> None:
    """Load a :func:`full_state` into a model sharded over any number of ranks (or none)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(
        model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
        options=StateDictOptions(full_state_dict=True),
    )  # fmt: skip
