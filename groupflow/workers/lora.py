"""LoRA on the actor: PEFT adapters injected in place, switched off for the reference, merged on export.

Design decision: the model stays a plain HF model whose adapted Linear layers are LoRA layers, so
generation, log-probs and FSDP see the same object with or without LoRA, and the reference policy
is the same weights with the adapters off — no second copy in memory.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
from torch import nn

from groupflow.models.vision import vision_tower_modules

__all__ = ["apply_lora", "set_adapters", "merged_lora_copy"]


def apply_lora(model: nn.Module, lora) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place (PEFT) and freeze everything else.

    The model stays a plain HF model whose adapted Linear layers are LoRA layers, so generation,
    log-probs and FSDP see the same object as without LoRA. The adapters' random init (A; B is 0,
    so the policy starts equal to the base) uses a fixed seed outside the caller's RNG stream.
    """
    from peft import LoraConfig, inject_adapter_in_model

    # A vision-language model's image tower has q_proj/k_proj/... layers too: LoRA adapts the
    # language part unless actor.lora.vision_tower asks for both.
    exclude = None
    if not getattr(lora, "vision_tower", False):
        towers = {id(m) for m in vision_tower_modules(model)}
        tower_names = [n for n, m in model.named_modules() if id(m) in towers]
        exclude = [n for n, _ in model.named_modules()
                   if any(n == t or n.startswith(t + ".") for t in tower_names)] or None  # fmt: skip
    config = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=lora.target_modules, bias="none", exclude_modules=exclude,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            inject_adapter_in_model(config, model)
        except ValueError as e:  # PEFT's message does not name our config key
            raise ValueError(
                f"actor.lora.target_modules={lora.target_modules!r}: {e} Use names of "
                f"{type(model).__name__}'s Linear layers (e.g. q_proj, v_proj) or 'all-linear'"
            ) from e
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"actor.lora.target_modules={lora.target_modules!r} matched no module of "
            f"{type(model).__name__}; use names of its Linear layers (e.g. q_proj, v_proj) or 'all-linear'"
        )
    return model


def set_adapters(model: nn.Module, enabled: bool) -> None:
    """Switch every LoRA layer of ``model`` on or off (off: the base model); no-op without LoRA."""
    for module in model.modules():
        if hasattr(module, "enable_adapters") and hasattr(module, "base_layer"):
            cast(Any, module).enable_adapters(enabled)  # a peft tuner layer (duck-typed)


def merged_lora_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with LoRA merged into the base weights and the LoRA layers removed."""
    out = copy.deepcopy(model)
    for name, module in list(out.named_modules()):
        if hasattr(module, "merge") and hasattr(module, "base_layer"):
            layer = cast(Any, module)  # a peft tuner layer (duck-typed)
            layer.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(
                out.get_submodule(parent_name) if parent_name else out,
                child,
                layer.get_base_layer(),
            )
    out.requires_grad_(True)
    return out
