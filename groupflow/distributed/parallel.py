"""torch.distributed helpers for data-parallel workers: process group, FSDP2, reductions, state.

Design decision: every function here is a no-op (or the obvious single-process equivalent) when
no process group is initialised, so the worker code has one path for 1 and N ranks — the
difference between the embedded default and a Ray cluster is only whether ``init`` ran.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from groupflow.utils.safe_state import check_dcp_metadata

if TYPE_CHECKING:  # imported where used: torch.distributed.fsdp is heavy to import
    from torch.distributed.fsdp import FSDPModule

__all__ = [
    "init_process_group",
    "is_distributed",
    "all_reduce",
    "shard",
    "cpu_offload_policy",
    "full_model_state",
    "clip_grad_norm",
    "sum_grads",
    "agree",
    "gathered",
    "gathered_root",
    "prepare_unsharded_use",
    "release_gathered",
    "save_sharded_state",
    "load_sharded_state",
    "full_state",
    "load_full_state",
    "load_full_weights",
]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def process_group_backend(cuda: bool) -> str:
    """gloo on CPU; on GPUs nccl for CUDA tensors plus gloo for the CPU ones — the scalar
    reductions (loss denominators, metrics, decisions every rank must share) are CPU tensors,
    which a pure nccl group refuses."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def init_process_group(rank: int, world_size: int, timeout_s: float = 600.0) -> None:
    """Join the group described by MASTER_ADDR/MASTER_PORT (set by the WorkerGroup)."""
    if world_size <= 1 or dist.is_initialized():
        return
    backend = process_group_backend(torch.cuda.is_available())
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise RuntimeError(
            "init_process_group: MASTER_ADDR/MASTER_PORT are not set (start workers through a WorkerGroup)"
        )
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def all_reduce(value: float | int | torch.Tensor, op: str = "sum") -> float:
    """Reduce a Python number across ranks (identity on one rank)."""
    if not is_distributed():
        return float(value)
    t = torch.tensor(float(value), dtype=torch.float64)
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    dist.all_reduce(t, op=ops[op])
    return float(t)


def shard(
    root: nn.Module, layers: list[nn.Module], mp_policy=None, offload_policy=None
) -> nn.Module:
    """FSDP2: shard each transformer layer, then the root (embeddings, norm, head) — only if
    distributed. ``mp_policy``: an FSDP2 ``MixedPrecisionPolicy`` (None: full precision);
    ``offload_policy``: e.g. ``CPUOffloadPolicy`` (None: shards stay on the device)."""
    if not is_distributed():
        return root
    from torch.distributed.fsdp import fully_shard

    kw = {"mp_policy": mp_policy} if mp_policy is not None else {}
    if offload_policy is not None:
        kw["offload_policy"] = offload_policy
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(root, **kw)
    return root


def cpu_offload_policy(enabled: bool):
    """FSDP2's ``CPUOffloadPolicy`` (pinned host memory when there is a GPU to copy to), or None:
    parameter shards, their gradients and so the optimizer state live in CPU memory, a layer's
    shards are copied to the device for its all-gather, the optimizer steps on the CPU."""
    if not enabled:
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def full_model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on every rank; a plain state_dict when not distributed."""
    if not is_distributed():
        return {k: v.detach() for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return cast(dict[str, torch.Tensor], state)  # a model's: tensors only


def clip_grad_norm(params: list[nn.Parameter], max_norm: float | None) -> float:
    """Global grad norm (before clipping) over possibly sharded (DTensor) gradients, then clip.

    torch's clip_grad_norm_ handles FSDP2's DTensor gradients (the norm is reduced across ranks);
    the returned norm is a DTensor there, so it is materialised for logging.
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    total = torch.nn.utils.clip_grad_norm_(
        params, max_norm if max_norm is not None else float("inf")
    )
    from torch.distributed.tensor import DTensor

    if isinstance(total, DTensor):
        total = total.full_tensor()
    return float(total)


def sum_grads(params: list[nn.Parameter]) -> None:
    """Sum a replicated model's gradients over ranks (its losses use global denominators, so the
    sum is the gradient); a parameter no local loss reached contributes zeros. No-op on one rank."""
    if not is_distributed():
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)


def _sharded_state(module: nn.Module, optimizer, extra: dict[str, nn.Module]) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer)
    return {"model": model_sd, "optim": optim_sd} | {
        k: get_model_state_dict(m) for k, m in extra.items()
    }


def save_sharded_state(
    module: nn.Module, optimizer, path: str | Path, extra: dict[str, nn.Module] | None = None
) -> None:
    """Every rank writes its shards of ``module``, ``optimizer`` and the ``extra`` models (frozen
    copies that are part of the training state, e.g. DiffusionNFT's old copy) with
    torch.distributed.checkpoint (a collective: all ranks call it)."""
    from torch.distributed.checkpoint.state_dict_saver import save

    save(_sharded_state(module, optimizer, extra or {}), checkpoint_id=str(path))


def load_sharded_state(
    module: nn.Module, optimizer, path: str | Path, extra: dict[str, nn.Module] | None = None
) -> None:
    """Load :func:`save_sharded_state` output written by any number of ranks into these (DCP
    reshards on load).

    DCP unpickles its ``.metadata`` index with plain pickle; it is checked first with an allowlist
    of DCP's own types, so a crafted index is refused instead of running code.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    check_dcp_metadata(path)
    extra = extra or {}
    state = _sharded_state(module, optimizer, extra)
    load(state, checkpoint_id=str(path))
    set_state_dict(
        module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    for k, m in extra.items():
        set_model_state_dict(m, state[k])


def full_state(module: nn.Module, optimizer) -> tuple[dict, dict]:
    """Full model and optimizer state by parameter name, on CPU (a collective when sharded): a
    checkpoint any number of ranks can load (:func:`load_full_state`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(module, optimizer, options=opts)


def load_full_state(module: nn.Module, optimizer, model_state: dict, optim_state: dict) -> None:
    """Load a full state by parameter name into a module sharded over any number of ranks (or
    none); each rank keeps its rows."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(
        module, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
        options=StateDictOptions(full_state_dict=True),
    )  # fmt: skip


def load_full_weights(module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load full weights by parameter name into a module sharded over any number of ranks (or
    none); each rank keeps its rows."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, cast(dict[str, Any], weights),
                         options=StateDictOptions(full_state_dict=True))  # fmt: skip


def agree(flag: bool, op: str) -> bool:
    """``flag`` decided by all ranks: ``"any"`` (true on some rank) or ``"all"`` (on every rank);
    the flag itself on one rank. For loops whose every step is a collective (a sharded decode)."""
    if op not in ("any", "all"):
        raise ValueError(f"agree: op must be 'any' or 'all', got {op!r}")
    return bool(all_reduce(int(flag), op="max" if op == "any" else "min"))


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


@contextmanager
def gathered(module: nn.Module) -> Iterator[nn.Module]:
    """``module``'s own FSDP2 parameters all-gathered inside the block, freed after it (a
    collective: every rank enters the same blocks in the same order); a no-op when unsharded.
    For code that calls a sharded layer's submodules directly, bypassing its forward hooks."""
    if not _is_fsdp(module):
        yield module
        return
    fsdp = cast("FSDPModule", module)
    fsdp.unshard()
    try:
        yield module
    finally:
        fsdp.reshard()


def prepare_unsharded_use(root: nn.Module) -> None:
    """Make a sharded model runnable outside its root's forward (generation; a collective).

    FSDP2 learns which module is the root on its first forward: a layer run first would take that
    role and break training, so the root is initialised here (FSDP2's own lazy init, idempotent;
    torch has no public call for it). And FSDP2 allocates each module's gathered-parameter
    buffers at its first all-gather: one first made inside ``torch.inference_mode`` (the decode
    loop) would be an inference tensor that training may not write into, so every module is
    gathered and freed once here, outside it. A no-op when unsharded.
    """
    if not _is_fsdp(root):
        return
    cast(Any, root)._get_fsdp_state()._lazy_init()  # FSDP2's own (private) lazy init
    for module in root.modules():
        if _is_fsdp(module):
            cast("FSDPModule", module).unshard()
            cast("FSDPModule", module).reshard()


def release_gathered(module: nn.Module) -> None:
    """Free every gathered FSDP2 parameter in ``module`` (local, no collective; a no-op when
    unsharded). FSDP2 keeps the root's parameters gathered after a forward that no backward
    follows (sampling), so until this they are plain tensors, not the DTensor shards that
    shard-wise arithmetic (an EMA over ``parameters()``) expects."""
    for m in module.modules():
        if _is_fsdp(m):
            cast("FSDPModule", m).reshard()


@contextmanager
def gathered_root(root: nn.Module) -> Iterator[nn.Module]:
    """Run a sharded model outside its root's forward (after ``prepare_unsharded_use``): the
    root's own parameters (embeddings, final norm, head) gathered for the block, each layer
    gathering at its own use (its forward hooks, or ``gathered``). A no-op when unsharded."""
    # FSDP2's unshard of a root gathers only the parameters its own group holds, so the root's
    # block is ``gathered``'s; the name says at which level a caller uses it
    with gathered(root):
        yield root
