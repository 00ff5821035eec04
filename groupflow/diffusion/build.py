"""The models a diffusion worker holds, and where their parameters live.

Design decision: what a worker *computes* (``worker``) is apart from what it *holds*: the
trained flow model (LoRA adapters injected in place, the PeftModel kept for
``disable_adapter()``), the frozen reference (a copy, or with LoRA the same net without
adapters), DiffusionNFT's EMA "old" copy, and — with ``diffusion.fsdp`` on several ranks — their
FSDP2 sharding, optionally with CPU offload. :func:`build_worker_models` is the one place these
are decided, in one order: adapters, copies, activation checkpointing, shards, weights.

Meta-device construction (:func:`meta_init`): a sharded diffusers transformer is built with meta
parameters and each rank reads only its rows (``sharding.materialise_shards``). LoRA adapters
are not in the base checkpoint, so they must get their values otherwise: peft creates and
initialises every adapter on the CPU and then moves it to its base layer's device — the meta
device here, which drops the values. :func:`lora_adapters` then replays peft's creation and init
from the same fixed seed in the same order, so the adapters get exactly the values a real model
would (tested against peft's own): equal on every rank and to an unsharded run, and FSDP2 shards
them like any real parameter (``materialise_shards`` keeps parameters that are already real).

CPU offload (``diffusion.cpu_offload``): FSDP2's ``CPUOffloadPolicy`` keeps every parameter
shard, its gradient and so AdamW's state in (pinned) CPU memory and copies a block's shards to
the device for its all-gather; the optimizer step runs on the CPU. Buffers (Wan's rotary tables)
stay on the compute device.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from groupflow.diffusion.kinds import freeze_unused
from groupflow.diffusion.settings import DiffusionSettings
from groupflow.diffusion.sharding import (
    bf16_policy,
    enable_activation_checkpointing,
    flow_layers,
    materialise_shards,
)
from groupflow.distributed.parallel import cpu_offload_policy, is_distributed, shard

if TYPE_CHECKING:
    from peft import PeftModel

__all__ = [
    "LORA_INIT_SEED",
    "WorkerModels",
    "build_worker_models",
    "lora_adapters",
    "meta_init",
    "offload_policy",
]

LORA_INIT_SEED = 20251126  # adapters' init: the same on every rank and in every run


def meta_init(spec, settings: DiffusionSettings, world_size: int) -> bool:
    """Build on the meta device and load shards: a sharded diffusers transformer (with or
    without LoRA); the tiny model is always built whole."""
    return settings.fsdp and world_size > 1 and spec.kind != "tiny"


@dataclass
class WorkerModels:
    flow: nn.Module  # the trained FlowModel (adapters injected in place)
    peft: PeftModel | None  # with LoRA: its disable_adapter() is the reference
    ref: nn.Module | None  # a frozen copy (KL without LoRA)
    old: nn.Module | None  # DiffusionNFT's EMA sampling copy
    sharded: bool


def lora_adapters(model: nn.Module, lora: dict) -> PeftModel:
    """Inject LoRA into ``model`` in place (peft; rank, alpha, target modules from ``lora``) and
    return the PeftModel. The random init comes from :data:`LORA_INIT_SEED`: every rank (replica
    or shard) and every run starts alike. On a meta-built model the adapters come out real, with
    the values a real model would get (:func:`_replay_adapter_init`)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora["rank"], lora_alpha=lora["alpha"], target_modules=list(lora["target_modules"]),
        lora_dropout=0.0,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(LORA_INIT_SEED)
        peft = get_peft_model(model, config)
    if any(p.is_meta for n, p in model.named_parameters() if "lora_" in n):
        _replay_adapter_init(model)
    # peft makes every adapter trainable, also those on layers a kind froze as unused (Qwen-Image's
    # last text stream): they would get no gradient either, which DDP and FSDP2 refuse
    transformer, kind = getattr(model, "transformer", None), getattr(model, "kind", None)
    if isinstance(transformer, nn.Module) and isinstance(kind, str):
        freeze_unused(transformer, kind)
    return peft


@torch.no_grad()
def _replay_adapter_init(model: nn.Module) -> None:
    """Give meta LoRA adapters the values peft gave them before moving them to their (meta) base
    layers' device: from the same seed, layer by layer in injection order (the module order),
    what peft's ``update_layer`` does — A = Linear(in, r) and B = Linear(r, out) with their default
    init, then ``reset_lora_parameters`` (Kaiming-uniform A, zero B) — in the base layer's dtype.
    A test pins these values to peft's own on a real model, so a peft that changes its order
    fails there rather than silently here."""
    from peft.tuners.lora import LoraLayer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(LORA_INIT_SEED)
        for layer in model.modules():
            if not isinstance(layer, LoraLayer):
                continue
            dtype = cast(torch.dtype, layer.get_base_layer().weight.dtype)
            for name in list(layer.lora_A):
                in_features, out_features = (
                    cast(int, layer.in_features),
                    cast(int, layer.out_features),
                )
                layer.lora_A[name] = nn.Linear(in_features, layer.r[name], bias=False)
                layer.lora_B[name] = nn.Linear(
                    layer.r[name], out_features, bias=layer.lora_bias[name]
                )
                layer.reset_lora_parameters(name, True)
                layer.lora_A[name].to(dtype)
                layer.lora_B[name].to(dtype)
    left = [n for n, p in model.named_parameters() if "lora_" in n and p.is_meta]
    if left:
        raise RuntimeError(
            f"LoRA on a meta-built model: adapter {left[0]!r} is still on the meta device (a peft "
            "layer type other than Linear?); train without diffusion.fsdp to build it whole"
        )


def offload_policy(settings: DiffusionSettings):
    """FSDP2's CPU offload (pinned host memory when there is a GPU to copy to), or None."""
    return cpu_offload_policy(settings.cpu_offload)


def build_worker_models(
    model: nn.Module,
    settings: DiffusionSettings,
    *,
    kl_coef: float,
    device: torch.device,
    weights: str | None = None,
) -> WorkerModels:
    """Adapters, reference and old copies, activation checkpointing, then (sharded) placement.

    ``weights``: ``model`` was built with meta parameters; after sharding each rank reads its
    rows from this diffusers directory (into CPU memory with offload, else onto ``device``)."""
    peft = lora_adapters(model, settings.lora) if settings.lora else None
    # β = 0 never builds a reference; with LoRA the reference is the same net without adapters
    ref = copy.deepcopy(model).eval().requires_grad_(False) if kl_coef > 0 and not peft else None
    # DiffusionNFT's sampling policy: an EMA of the trained model (adapters included)
    # DiffusionNFT's EMA sampling copy; AWM's sampling policy (the weights before each update)
    needs_old = settings.objective in ("nft", "awm")
    old = copy.deepcopy(model).eval().requires_grad_(False) if needs_old else None
    if settings.activation_checkpointing:
        enable_activation_checkpointing(model)
    sharded = settings.fsdp and is_distributed()
    if not sharded and (weights or settings.bf16 or settings.cpu_offload):
        raise ValueError(
            "DiffusionWorker: meta init, bf16 and cpu_offload need diffusion.fsdp on >1 rank"
        )
    if sharded:
        offload = offload_policy(settings)
        mixed = bf16_policy() if settings.bf16 else None
        for m in (model, ref, old):
            if m is None:
                continue
            shard(m, flow_layers(m), mixed, offload)
            if weights:  # every copy is sharded alike: the old model's EMA works on local shards
                params_on = torch.device("cpu") if offload is not None else device
                materialise_shards(m, weights, device, params_on=params_on)
    return WorkerModels(model, peft, ref, old, sharded)
