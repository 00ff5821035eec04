"""The critic worker: PPO's value model, its optimizer, and the clipped value-loss update.

Design decision: the critic is one more role the single controller drives through a WorkerGroup,
shaped like the actor worker and reusing its machinery — the same ``dp`` dispatch, the same
mini-batch / micro-batch loop with loss denominators computed once per mini-batch and summed over
ranks (so the gradient depends neither on the micro-batch size nor on the number of ranks), the
same FSDP2 sharding when world_size > 1 — but with its own model, optimizer and LR. The driver
calls ``compute_values`` before GAE and ``update_critic`` with the returns; nothing here knows
about rewards or advantages.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from groupflow.algorithms import value_loss
from groupflow.batch import Batch
from groupflow.config import CriticConfig
from groupflow.distributed import register
from groupflow.distributed.parallel import (
    all_reduce,
    clip_grad_norm,
    full_model_state,
    init_process_group,
    shard,
)
from groupflow.distributed.transport import tensors_nbytes
from groupflow.models.causal_lm import build_tiny_llama, hf_model, resolve_dtype
from groupflow.models.packing import packed_values
from groupflow.models.value import (
    decoder_layers,
    load_value_model,
    response_values,
    value_model_from_config,
    value_model_from_policy,
)
from groupflow.workers.common import ModelSpec, optimizer_and_schedule, worker_device
from groupflow.workers.state import CheckpointMethods, TrainedState
from groupflow.workers.update import (
    combine_steps,
    drop_padding,
    forward_groups,
    global_denominators,
    trim,
)

__all__ = ["CriticWorker", "CriticSpec"]


class CriticSpec:
    """How a critic worker builds its value model in its own process (picklable for Ray)."""

    def __init__(self, cfg: CriticConfig, policy: ModelSpec, seed: int):
        self.cfg, self.policy, self.seed = cfg, policy, seed

    def build(self) -> nn.Module:
        return self._build().to(resolve_dtype(self.cfg.dtype))

    def _build(self) -> nn.Module:
        c = self.cfg
        if c.path is not None:
            return load_value_model(
                c.path, dtype=c.dtype, trust_remote_code=self.policy.model_cfg.trust_remote_code
            )
        if c.tiny is not None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.policy.tokenizer_path(), local_files_only=True)
            t = c.tiny
            lm = build_tiny_llama(
                len(tok), hidden_size=t.hidden_size, num_layers=t.num_layers, num_heads=t.num_heads,
                intermediate_size=t.intermediate_size, max_positions=t.max_positions,
                seed=self.seed if t.seed is None else t.seed,
            )  # fmt: skip
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                return value_model_from_config(lm.config)
        policy, _ = self.policy.build()
        return value_model_from_policy(policy, self.seed)


class _ValueForward(nn.Module):
    """The FSDP root: its forward computes response values, so root-level parameters are gathered."""

    def __init__(self, model: nn.Module, packing: bool = False):
        super().__init__()
        self.model = model
        self.packing = packing  # critic.packing: one padding-free row per call (models.packing)

    def forward(self, prompt_ids, prompt_mask, responses, response_mask):
        values = packed_values if self.packing else response_values
        return values(self.model, prompt_ids, prompt_mask, responses, response_mask)


class CriticWorker(CheckpointMethods):
    """Value model (FSDP2-sharded when world_size > 1) + AdamW + LR schedule."""

    def __init__(
        self,
        model: nn.Module,
        cfg: CriticConfig,
        *,
        total_steps: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.rank, self.world_size, self.cfg = rank, world_size, cfg
        self.device = next(model.parameters()).device
        self.model = model
        self.critic = shard(_ValueForward(model, cfg.packing), decoder_layers(model))
        self.optimizer, self.scheduler = optimizer_and_schedule(
            self.critic, cfg, total_steps, cfg.lr_warmup_steps
        )
        self.trained = TrainedState(
            self.critic, self.optimizer, self.scheduler, sharded=world_size > 1
        )

    @classmethod
    def create(
        cls,
        rank: int,
        world_size: int,
        *,
        spec: CriticSpec,
        total_steps: int,
        pg_timeout_s: float = 600.0,
    ):
        """Factory used by WorkerGroup: join the process group, then build the value model here."""
        init_process_group(rank, world_size, pg_timeout_s)
        model = spec.build().to(worker_device(rank))
        return cls(model, spec.cfg, total_steps=total_steps, rank=rank, world_size=world_size)

    # ----- values -----------------------------------------------------------------------------
    @register("dp")
    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """``values`` [B, T] of the states before each response token; 0 where masked."""
        batch = batch.to(self.device)
        self.critic.eval()
        out = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
        groups = forward_groups(batch, self.cfg, section="critic")
        # Through the FSDP root (it gathers the shards), so every rank runs the same number of
        # forwards: a rank with fewer micro-batches repeats its last one and discards it.
        n_micro = int(all_reduce(len(groups), op="max"))
        for i in range(n_micro):
            idx = groups[min(i, len(groups) - 1)]
            mb = trim(batch.index(idx))
            v = self.critic(
                mb["prompt_ids"], mb["prompt_mask"], mb["responses"], mb["response_mask"]
            )
            if i < len(groups):
                out[idx, : v.shape[1]] = v * mb["response_mask"]
        self.critic.train()
        return Batch({"values": out.cpu()})

    # ----- update -----------------------------------------------------------------------------
    @register("dp")
    def update_critic(self, batch: Batch, *, shuffle_seed: int | None = None) -> dict[str, float]:
        """ppo_epochs × shuffled mini-batches of the clipped value loss against ``returns``.

        Needs ``values`` (recorded before the update, the clip centre) and ``returns`` [B, T].
        """
        cfg = self.cfg
        for key in ("values", "returns"):
            if key not in batch:
                raise KeyError(
                    f"update_critic needs '{key}' in the batch; keys: {sorted(batch.keys())}"
                )
        batch = drop_padding(batch.to(self.device))
        self.critic.train()
        n = len(batch)
        mb_size = max(1, (cfg.mini_batch_samples or n * self.world_size) // self.world_size)
        gen = torch.Generator().manual_seed(shuffle_seed) if shuffle_seed is not None else None
        lr = self.optimizer.param_groups[0]["lr"]
        steps = []
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(n, generator=gen) if n > mb_size else torch.arange(n)
            for start in range(0, n, mb_size):
                steps.append(self._optimizer_step(batch.index(order[start : start + mb_size])))
        self.scheduler.step()
        metrics = combine_steps(steps)
        metrics["critic/lr"] = lr
        return metrics

    def _optimizer_step(self, mini: Batch) -> dict[str, float]:
        cfg = self.cfg
        groups = forward_groups(mini, cfg, section="critic")
        dens = global_denominators(mini, groups)
        # Same number of forward/backward passes on every rank (FSDP collectives); extra passes
        # repeat the last micro-batch with a zero mask.
        n_micro = int(all_reduce(len(groups), op="max"))
        self.optimizer.zero_grad(set_to_none=True)
        total, clipfrac, vpred = 0.0, 0.0, 0.0
        for i in range(n_micro):
            mb = trim(mini.index(groups[min(i, len(groups) - 1)]))
            mask = mb["response_mask"] if i < len(groups) else torch.zeros_like(mb["response_mask"])
            v = self.critic(
                mb["prompt_ids"], mb["prompt_mask"], mb["responses"], mb["response_mask"]
            )
            loss, m = value_loss(
                v,
                mb["values"],
                mb["returns"],
                mask,
                clip_range=cfg.value_clip,
                agg=cfg.loss_agg,
                **dens,
            )
            # FSDP2 averages gradients over ranks; the loss already uses global denominators.
            (loss * self.world_size).backward()
            share = float(mask.sum()) / max(1, dens["num_tokens"])
            total += float(loss.detach())
            clipfrac += float(m["vf_clipfrac"]) * share
            vpred += float(m["vpred_mean"]) * share
        grad_norm = clip_grad_norm(list(self.critic.parameters()), cfg.grad_clip)
        stats = {
            "critic/vf_loss": all_reduce(total),
            "critic/vf_clipfrac": all_reduce(clipfrac),
            "critic/vpred_mean": all_reduce(vpred),
            "critic/grad_norm": grad_norm,
        }
        if math.isfinite(stats["critic/vf_loss"]) and math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            # A non-finite critic step is skipped (and visible in the metric), never applied.
            self.optimizer.zero_grad(set_to_none=True)
            stats["critic/nonfinite_skipped"] = 1.0
        return stats

    # ----- initialisation from the (warm-started) policy ----------------------------------------
    @register("all")
    def receive_backbone(self, ticket, transport) -> int:
        """``load_backbone`` with the policy's weights fetched through ``transport``; the bytes
        received."""
        weights = transport.receive(ticket, role="critic", rank=self.rank)
        self.load_backbone(weights)
        return tensors_nbytes(weights)

    @register("all")
    def load_backbone(self, policy_weights: dict[str, torch.Tensor]) -> None:
        """Copy a causal LM's decoder weights (full state dict, HF names) into the backbone."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        prefix = hf_model(self.model).base_model_prefix + "."
        backbone = {k: v for k, v in policy_weights.items() if k.startswith(prefix)}
        if not backbone:
            raise ValueError(
                f"policy weights have no '{prefix}*' entries to initialise the critic from"
            )
        set_model_state_dict(
            self.critic, {f"model.{k}": v for k, v in backbone.items()},
            options=StateDictOptions(full_state_dict=True, strict=False),
        )  # fmt: skip

    # ----- state ------------------------------------------------------------------------------
    @register("rank0")
    def save_pretrained(self, out_dir: str) -> None:
        """The critic as a plain HF token-classification directory (loadable as critic.path)."""
        full = full_model_state(self.critic)
        if self.rank == 0:
            # a sharded model's parameters are DTensors: write through an unsharded copy
            target = (
                hf_model(value_model_from_config(hf_model(self.model).config))
                if self.world_size > 1
                else hf_model(self.model)
            )
            target.load_state_dict({k.removeprefix("model."): v for k, v in full.items()})
            target.save_pretrained(out_dir, safe_serialization=True)
