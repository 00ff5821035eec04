"""FSDP2 and activation checkpointing for the flow model, and its full (world-size-free) state.

Design decision: the diffusion worker shards exactly like the LLM actor — each transformer block,
then the root — with ``groupflow.distributed.parallel.shard``; the blocks are found by name
(``blocks`` in Wan and the tiny model, ``transformer_blocks`` in SD3). Checkpoints hold the FULL
model and optimizer state keyed by parameter name (``torch.distributed.checkpoint.state_dict``),
gathered on every rank, so a run saved with N workers resumes with M (resharding is loading).

No rank ever holds the full transformer: with ``diffusion.fsdp`` it is built with its parameters
on the meta device (:func:`empty_parameters` — buffers such as Wan's rotary tables stay real, so
nothing needs re-deriving), sharded, then :func:`materialise_shards` allocates each rank's shards
and reads just those rows from the diffusers safetensors (``safe_open(...).get_slice``, which
reads the slice's bytes and no others). FSDP2 shards dim 0 like ``torch.chunk``, so rank r's rows
are ``[r·⌈n/W⌉, (r+1)·⌈n/W⌉)``. Only safetensors are read: a pickled ``.bin`` is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

__all__ = [
    "empty_parameters",
    "materialise_shards",
    "shard_rows",
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


@contextmanager
def empty_parameters() -> Iterator[None]:
    """Parameters registered inside live on the meta device (no memory); buffers stay real.

    ``torch.device("meta")`` would put buffers there too, and a non-persistent buffer (Wan's
    rotary frequencies) is not in the checkpoint to be read back, so only parameters move.
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def shard_rows(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [start, stop) of a dim-0 length ``n`` that FSDP2 (``torch.chunk``) gives ``rank``."""
    size = math.ceil(n / world_size) if n else 0
    start = min(rank * size, n)
    return start, min(start + size, n)


def _safetensors_index(directory: Path) -> dict[str, Path]:
    """Tensor name -> the ``*.safetensors`` file holding it (diffusers' single or split files)."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"diffusion.fsdp: '{directory}' has no *.safetensors weights; sharded loading reads "
            "only safetensors (convert a pickled .bin checkpoint with diffusers' save_pretrained)"
        )
    index = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            index.update((k, f) for k in h.keys())
    return index


@torch.no_grad()
def materialise_shards(
    model: nn.Module, directory: str | Path, device: torch.device, prefix: str = "transformer."
) -> None:
    """Allocate a meta-built, FSDP2-sharded ``model`` on ``device`` and fill each parameter's
    local shard from the safetensors in ``directory`` (tensor names = parameter names without
    ``prefix``); buffers keep their values, and those in the checkpoint are read in full."""
    from safetensors import safe_open

    directory = Path(directory).expanduser()
    index = _safetensors_index(directory)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    model.to_empty(device=device)
    for name, b in model.named_buffers():
        b.copy_(buffers[name])

    def key(name: str) -> str:
        return name[len(prefix) :] if name.startswith(prefix) else name

    wanted = [(n, p) for n, p in model.named_parameters()]
    wanted += [(n, b) for n, b in model.named_buffers() if key(n) in index]
    missing = [key(n) for n, _ in wanted if key(n) not in index]
    if missing:
        raise KeyError(
            f"diffusion.fsdp: the weights in '{directory}' have no tensor {missing[0]!r} "
            f"({len(missing)} missing); is diffusion.model.path the transformer's directory?"
        )
    by_file: dict[Path, list] = {}
    for n, t in wanted:
        by_file.setdefault(index[key(n)], []).append((n, t))
    for f, items in by_file.items():
        with safe_open(str(f), framework="pt") as h:
            for n, t in items:
                _fill(t, h, key(n), f"{f.name}:{key(n)}")


def _fill(t: torch.Tensor, handle, name: str, where: str) -> None:
    """Copy tensor ``name`` of an open safetensors file into ``t``: the whole tensor, or only a
    DTensor's local rows (read as a slice)."""
    src = handle.get_slice(name)
    full = tuple(src.get_shape())
    if tuple(t.shape) != full:
        raise ValueError(
            f"diffusion.fsdp: {where} has shape {list(full)}; the model's is {list(t.shape)}"
        )
    if not hasattr(t, "to_local"):
        t.copy_(handle.get_tensor(name))
        return
    from torch.distributed.tensor import Shard

    local = t.to_local()
    placements = tuple(t.placements)
    if placements != (Shard(0),):
        raise ValueError(f"diffusion.fsdp: {where}: unexpected placements {placements}")
    start, stop = shard_rows(full[0], t.device_mesh.get_local_rank(), t.device_mesh.size())
    if local.shape[0] != stop - start:
        raise ValueError(
            f"diffusion.fsdp: {where}: local shard has {local.shape[0]} rows, expected {stop - start}"
        )
    if stop > start:
        local.copy_(src[start:stop])
