"""FSDP2 and activation checkpointing for the flow model, and each rank's shards read from disk.

Design decision: the diffusion worker shards exactly like the LLM actor — each transformer block,
then the root — with ``groupflow.distributed.parallel.shard``; the blocks are found by name
(``blocks`` in Wan and the tiny model, ``transformer_blocks`` in SD3). Its checkpoints are the
LLM actor's too (``groupflow.distributed.parallel``): a replicated model's hold the FULL model and
optimizer state keyed by parameter name (``full_state``), so a run saved with N workers resumes
with M; a sharded one's are every rank's own shards (``save_sharded_state``, with DiffusionNFT's
old copy beside the model), never gathered, resharded by DCP on load.

No rank ever holds the full transformer: with ``diffusion.fsdp`` it is built with its parameters
on the meta device (:func:`empty_parameters` — buffers such as Wan's rotary tables stay real, so
nothing needs re-deriving), sharded, then :func:`materialise_shards` allocates each rank's shards
and reads just those rows from the diffusers safetensors: per tensor one seek and one read of its
rows' bytes, located through the file's JSON header (the safetensors library's own slicing was
measured to touch every page: +546 MiB resident to read half of a 546 MiB model). FSDP2 shards dim 0 like ``torch.chunk``, so rank r's rows
are ``[r·⌈n/W⌉, (r+1)·⌈n/W⌉)``. Only safetensors are read: a pickled ``.bin`` is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "bf16_policy",
    "empty_parameters",
    "materialise_shards",
    "shard_rows",
    "flow_layers",
    "enable_activation_checkpointing",
    "memory_stats",
    "peak_rss_bytes",
]


def _transformer(model: nn.Module) -> nn.Module:
    return getattr(model, "transformer", model)


def flow_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 shards one by one (the root keeps embeddings and heads)."""
    inner = _transformer(model)
    # FLUX has dual-stream transformer_blocks, then single_transformer_blocks: both are shards;
    # Z-Image has its refiners (image, caption) before its main `layers`
    names = ("blocks", "transformer_blocks", "single_transformer_blocks", "noise_refiner",
             "context_refiner", "layers")  # fmt: skip
    found = [
        block
        for name in names
        if isinstance(getattr(inner, name, None), nn.ModuleList)
        for block in getattr(inner, name)
    ]
    if found:
        return found
    raise ValueError(
        f"diffusion.fsdp: {type(inner).__name__} has no `blocks` / `transformer_blocks` / `layers` "
        "list to shard"
    )


def enable_activation_checkpointing(model: nn.Module) -> None:
    """diffusers' own switch: each block's activations are recomputed in the backward pass."""
    inner = _transformer(model)
    if not hasattr(inner, "enable_gradient_checkpointing"):
        raise ValueError(
            "diffusion.activation_checkpointing is for the diffusers transformers (kind sd3 / wan), "
            f"not {type(inner).__name__}"
        )
    switch: Any = inner.enable_gradient_checkpointing  # diffusers' ModelMixin method
    switch()


def bf16_policy():
    """FSDP2 mixed precision: parameters all-gathered and computed in bf16, gradients reduced in
    fp32 into the fp32 shards AdamW updates; outputs (velocities) come back in fp32, so step
    means and log-probs are computed in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
    )


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def peak_rss_bytes() -> float:
    """The process's peak resident set so far: Linux's VmHWM (ru_maxrss, the fallback, survives
    fork and exec, so a spawned worker would report its parent's peak)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(int(line.split()[1]) * 1024)
    except OSError:
        pass
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def memory_stats(model: nn.Module, optimizer) -> dict[str, float]:
    """Bytes of this rank's parameters, gradients and optimizer state (local shards), and the
    process's peak resident set (Linux ru_maxrss, KiB) — the numbers the memory benchmark prints."""
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel")]
    return {
        "param_bytes": float(sum(_local_bytes(p) for p in params)),
        "grad_bytes": float(sum(_local_bytes(p.grad) for p in params if p.grad is not None)),
        "optimizer_bytes": float(sum(_local_bytes(v) for v in state if v.dim() > 0)),
        "peak_rss_bytes": peak_rss_bytes(),
    }


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

    setattr(nn.Module, "register_parameter", on_meta)  # noqa: B010 - the method patched
    try:
        yield
    finally:
        setattr(nn.Module, "register_parameter", register)  # noqa: B010


def shard_rows(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [start, stop) of a dim-0 length ``n`` that FSDP2 (``torch.chunk``) gives ``rank``."""
    size = math.ceil(n / world_size) if n else 0
    start = min(rank * size, n)
    return start, min(start + size, n)


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's JSON header (name -> dtype, shape, data_offsets) and where its data
    starts: the format is an 8-byte little-endian length, the header, then the raw tensors."""
    import json

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def _safetensors_index(directory: Path) -> dict[str, tuple[Path, dict, int]]:
    """Tensor name -> (file, its header entry, data start), over diffusers' single or split files."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"diffusion.fsdp: '{directory}' has no *.safetensors weights; sharded loading reads "
            "only safetensors (convert a pickled .bin checkpoint with diffusers' save_pretrained)"
        )
    index = {}
    for f in files:
        header, base = _header(f)
        index.update((k, (f, entry, base)) for k, entry in header.items())
    return index


def _read_rows(f, entry: dict, base: int, start: int, stop: int, where: str) -> torch.Tensor:
    """Rows [start, stop) of a row-major tensor: one seek and one read of just their bytes (the
    safetensors library's slicing touches the whole tensor's pages)."""
    if entry["dtype"] not in _DTYPES:
        raise ValueError(
            f"diffusion.fsdp: {where} has dtype {entry['dtype']}, not one of {sorted(_DTYPES)}"
        )
    dtype, shape = _DTYPES[entry["dtype"]], list(entry["shape"])
    size = torch.empty((), dtype=dtype).element_size()
    row = math.prod(shape[1:]) * size
    begin, end = entry["data_offsets"]
    if end - begin != math.prod(shape) * size:
        raise ValueError(f"diffusion.fsdp: {where}: {end - begin} bytes for shape {shape}")
    f.seek(base + begin + start * row)
    data = f.read((stop - start) * row if shape else size)
    if len(data) != ((stop - start) * row if shape else size):
        raise ValueError(f"diffusion.fsdp: {where}: the file ends early")
    out = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
    return out.reshape([stop - start, *shape[1:]] if shape else [])


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def materialise_shards(
    model: nn.Module,
    directory: str | Path,
    device: torch.device,
    prefix: str = "transformer.",
    params_on: torch.device | None = None,
) -> None:
    """Allocate a meta-built, FSDP2-sharded ``model`` and fill each meta parameter's local shard
    from the safetensors in ``directory`` (tensor names = parameter names without ``prefix`` and
    without peft's ``base_layer`` level).
    Parameters go to ``params_on`` (default ``device``; the CPU with FSDP2's CPU offload),
    buffers to ``device``. Parameters that are already real (LoRA adapters, initialised before
    sharding) keep their values; buffers too, and those in the checkpoint are read in full."""
    directory = Path(directory).expanduser()
    index = _safetensors_index(directory)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    kept = {
        n: _local(p).detach().clone() for n, p in model.named_parameters() if not _local(p).is_meta
    }
    model.to_empty(device=params_on or device)
    for module in model.modules():  # buffers live where the computation runs
        for name, b in module.named_buffers(recurse=False):
            module._buffers[name] = b.to(device)
    for name, b in model.named_buffers():
        b.copy_(buffers[name])
    for name, p in model.named_parameters():
        if name in kept:
            _local(p).copy_(kept[name])

    def key(name: str) -> str:  # without the adapter's wrapper level (peft's base_layer)
        name = name.replace(".base_layer.", ".")
        return name[len(prefix) :] if name.startswith(prefix) else name

    wanted = [(n, p) for n, p in model.named_parameters() if n not in kept]
    wanted += [(n, b) for n, b in model.named_buffers() if key(n) in index]
    missing = [key(n) for n, _ in wanted if key(n) not in index]
    if missing:
        raise KeyError(
            f"diffusion.fsdp: the weights in '{directory}' have no tensor {missing[0]!r} "
            f"({len(missing)} missing); is diffusion.model.path the transformer's directory?"
        )
    by_file: dict[Path, list] = {}
    for n, t in wanted:
        by_file.setdefault(index[key(n)][0], []).append((n, t))
    for path, items in by_file.items():
        with open(path, "rb") as f:
            for n, t in items:
                _, entry, base = index[key(n)]
                _fill(t, f, entry, base, f"{path.name}:{key(n)}")


def _fill(t: torch.Tensor, f, entry: dict, base: int, where: str) -> None:
    """Fill ``t`` from an open safetensors file: the whole tensor, or a DTensor's local rows."""
    full = tuple(entry["shape"])
    if tuple(t.shape) != full:
        raise ValueError(
            f"diffusion.fsdp: {where} has shape {list(full)}; the model's is {list(t.shape)}"
        )
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        t.copy_(_read_rows(f, entry, base, 0, full[0] if full else 0, where))
        return

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
        local.copy_(_read_rows(f, entry, base, start, stop, where))
