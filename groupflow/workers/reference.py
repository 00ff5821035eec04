"""The actor's frozen reference policy: a copy of the initial model, sharded like the policy.

Design decision: the reference is its own small object the actor holds, not five attributes and
three branches spread over the actor: a plain frozen copy (``model``) and, with several ranks,
its FSDP2 root (``root``, 1/world of the weights per rank, the same ``PolicyForward`` the policy
has, so log-probs under both go through one code path). With LoRA there is none — the reference
is the base model with the adapters off, no second copy in memory — and β = 0 never builds one
(algorithms.md §4). Its weights move by parameter name, so a reference saved by N ranks loads
into M.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from groupflow.distributed.parallel import full_model_state, load_full_weights, shard
from groupflow.workers.common import decoder_layers
from groupflow.workers.policy_forward import PolicyForward

__all__ = ["FrozenReference"]


class FrozenReference:
    """A frozen copy of ``model``; ``forward`` (the policy's ``PolicyForward`` settings) and
    ``offload`` given: sharded with FSDP2 like the policy."""

    def __init__(self, model: nn.Module, forward: dict | None = None, offload=None):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.root: nn.Module | None = None  # the FSDP2 root when sharded
        if forward is not None:
            self.root = shard(
                PolicyForward(self.model, **forward),
                list(decoder_layers(self.model)),
                offload_policy=offload,
            )

    def reset_from(self, policy: nn.Module) -> None:
        """Take the weights of the policy's root (a collective when the policy is sharded)."""
        if self.root is not None:  # same layout, same sharding: shard into shard, no gather
            self.root.load_state_dict(policy.state_dict())
            return
        full = full_model_state(policy)
        self.model.load_state_dict({k.removeprefix("lm."): v for k, v in full.items()})

    def weights(self) -> dict[str, torch.Tensor]:
        """Full weights by plain HF name, on the CPU (sharded: gathered, a collective)."""
        if self.root is not None:
            full = full_model_state(self.root)
            return {k.removeprefix("lm."): v.detach().cpu() for k, v in full.items()}
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Full weights by plain HF name; sharded, each rank keeps its rows."""
        if self.root is not None:
            load_full_weights(self.root, {f"lm.{k}": v for k, v in weights.items()})
        else:
            self.model.load_state_dict(weights)
