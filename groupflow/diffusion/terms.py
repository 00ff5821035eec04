"""The flow-matching objectives' training terms, computed step by step from stored trajectories.

Design decision: what a diffusion worker *holds* (the flow model, its reference, old and teacher
copies, shards, optimizer) and what an objective *computes* from a micro-batch are two jobs; this
module is the second, so an objective is read and changed in one place without the worker's
plumbing. ``ObjectiveTerms`` sees the models only through one ``velocity(x, sigma, cond,
reference=, old=, teacher=)`` callable (the worker's, which owns CFG, autocast and which copy
answers). Transitions are recomputed grouped by step index, as they were sampled (all samples at
step t in one forward), so a stored step's log-prob is reproduced bit for bit. ``ratio_norm``
(GRPO-Guard) rewrites the log-probs handed to the PPO loss and weights advantages per step;
``objective="flow_dppo"`` replaces the ratio clip by the exact step KL's asymmetric mask;
``nft`` (DiffusionNFT) and ``awm`` (Advantage Weighted Matching) train on re-noised final
latents, their noise drawn from each sample's rollout seed (``renoise_noise``), never from a
stream of the rank, so how samples are split over ranks and micro-batches changes nothing but
float reduction order. Sharded (``placeholder``), every rank runs the same forwards: a step no
local sample trains runs on row 0, masked out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from groupflow.algorithms import aggregate, masked_mean, policy_loss
from groupflow.batch import Batch
from groupflow.config import ActorConfig
from groupflow.diffusion import objectives as obj
from groupflow.diffusion.distillation import teacher_step_kl
from groupflow.diffusion.samplers import flow_kl
from groupflow.diffusion.settings import DiffusionSettings, cond_of, index_cond, renoise_noise

__all__ = ["ObjectiveTerms"]


class ObjectiveTerms:
    """The configured objective's per-step terms and loss for one worker's models."""

    def __init__(
        self,
        velocity: Callable[..., Tensor],
        spec,
        settings: DiffusionSettings,
        cfg: ActorConfig,
        *,
        noise_level: float,
        device: torch.device,
        loss_options: dict,
        distill: bool = False,
        placeholder: bool = False,
    ):
        """``spec``: the sampler's (``step``, ``step_logprob``); ``distill``: a teacher answers
        ``velocity(..., teacher=True)``; ``placeholder``: sharded, see the module docstring."""
        self.velocity, self.spec, self.settings, self.cfg = velocity, spec, settings, cfg
        self.noise_level, self.device, self.loss_options = noise_level, device, loss_options
        self.distill, self.placeholder = distill, placeholder

    def step_terms(
        self, mb: Batch, mask: Tensor, with_kl: bool, means: bool = False, distill: bool = False
    ):
        """Log-probs [b, N] of the masked transitions (0 elsewhere; differentiable) and the
        Flow-GRPO KL [b, N] (or None), computed step by step as they were sampled. With
        ``ratio_norm`` also GRPO-Guard's bias and std [b, N]; ``means``: also the step means;
        ``distill``: also the step KL to the teacher [b, N] (differentiable), else None."""
        b, n = mask.shape
        logp = torch.zeros(b, n, device=self.device)
        kl = torch.zeros(b, n, device=self.device) if with_kl else None
        to_teacher = torch.zeros(b, n, device=self.device) if distill else None
        guard = self.needs_step_kl()
        bias = torch.zeros(b, n, device=self.device) if guard else None
        stds = torch.ones(b, n, device=self.device) if guard else None
        step_means = torch.zeros_like(mb["latents"]) if means else None
        cond = cond_of(mb)
        for t in range(n):
            rows = mask[:, t].nonzero().flatten()
            rows = self._rows_or_placeholder(rows)
            if rows is None:
                continue
            x = mb["latents"][rows, t]
            s, s_next = mb["sigmas"][rows, t], mb["sigmas_next"][rows, t]
            c = index_cond(cond, rows)
            mean, std = self.spec.step(
                x, self.velocity(x, s, c), s, s_next, noise_level=self.noise_level
            )
            lp = self.spec.step_logprob(mb["next_latents"][rows, t], mean, std)
            at = (rows, torch.full_like(rows, t))
            logp = logp.index_put(at, lp)
            if step_means is not None:
                step_means[rows, t] = mean
            if bias is not None and stds is not None:  # GRPO-Guard / Flow-DPPO
                # one optimizer step per batch: the old means are this forward's, detached
                old = mb["old_means"][rows, t] if "old_means" in mb else mean.detach()
                bias = bias.index_put(at, obj.guard_bias(mean, old, std))
                stds = stds.index_put(at, std.to(stds.dtype))
            if to_teacher is not None:  # the teacher's step mean at the student's own state
                with torch.no_grad():
                    v_teacher = self.velocity(x, s, c, teacher=True)
                    t_mean, _ = self.spec.step(
                        x, v_teacher, s, s_next, noise_level=self.noise_level
                    )
                to_teacher = to_teacher.index_put(at, teacher_step_kl(mean, t_mean, std))
            if kl is not None:
                with torch.no_grad():
                    ref_mean, _ = self.spec.step(
                        x,
                        self.velocity(x, s, c, reference=True),
                        s,
                        s_next,
                        noise_level=self.noise_level,
                    )
                kl = kl.index_put(
                    (rows, torch.full_like(rows, t)), flow_kl(mean, ref_mean, std, s_next - s)
                )
        return logp, kl, (bias, stds), step_means, to_teacher

    def needs_step_kl(self) -> bool:
        """GRPO-Guard's bias and Flow-DPPO's trust region: ‖μ_θ − μ_old‖²/(2s²) per step."""
        return self.settings.ratio_norm or self.settings.objective == "flow_dppo"

    def loss(self, mb: Batch, mask: Tensor, epoch: int, denominators: dict):
        """The configured objective on one micro-batch: (loss, per-step KL to the reference or
        None, per-step KL to a teacher or None, the loss's metrics)."""
        cfg, objective = self.cfg, self.settings.objective
        with_kl, distill = cfg.kl_coef > 0, self.distill
        if objective == "nft":
            per_step, kl = self._nft_terms(mb, mask, with_kl, epoch)
            return aggregate(per_step, mask, cfg.loss_agg, **denominators), kl, None, {}
        if objective == "awm":
            logp, old, kl = self._awm_terms(mb, mask, with_kl, epoch)
            loss, m = policy_loss(
                logp, old, mb["advantages"], mask, loss_fn=cfg.loss_fn, agg=cfg.loss_agg,
                **self.loss_options, **denominators,
            )  # fmt: skip
            return loss, kl, None, m
        logp, kl, (step_kl_or_bias, stds), _, to_teacher = self.step_terms(
            mb, mask, with_kl, distill=distill
        )
        old = mb["old_logprobs"] if "old_logprobs" in mb else logp.detach()
        if objective == "flow_dppo":
            step_kl = step_kl_or_bias
            assert step_kl is not None  # needs_step_kl() holds for flow_dppo
            threshold = self.settings.flow_dppo.get("kl_mask_threshold", 1e-5)
            per_step, parts = obj.flow_dppo_loss(logp, old, mb["advantages"], step_kl, threshold)
            valid = mask != 0
            m = {
                "dppo_masked_frac": masked_mean((~parts["keep"]).float(), valid),
                "dppo_step_kl": masked_mean(step_kl.detach(), valid),
                "ratio_mean": torch.where(valid.any(), masked_mean(parts["ratio"], valid), 1.0),
            }
            return aggregate(per_step, mask, cfg.loss_agg, **denominators), kl, to_teacher, m
        adv = mb["advantages"]
        if self.settings.ratio_norm:  # GRPO-Guard: the step terms' mean bias and stds
            assert step_kl_or_bias is not None and stds is not None  # needs_step_kl() holds
            logp = obj.guard_logprobs(logp, old, step_kl_or_bias, stds)
            weights = obj.guard_step_weights(mb["sigmas"], mb["sigmas_next"])
            adv = (adv[:, None] if adv.dim() == 1 else adv) * weights
        loss, m = policy_loss(
            logp, old, adv, mask, loss_fn=cfg.loss_fn, agg=cfg.loss_agg,
            **self.loss_options, **denominators,
        )  # fmt: skip
        return loss, kl, to_teacher, m

    def _renoise(self, mb: Batch, rows: Tensor, x0: Tensor, t: int, epoch: int) -> Tensor:
        """The training noise of ``rows`` at step t: each sample's own (``renoise_noise``), so
        the update does not depend on how samples are split over ranks and micro-batches."""
        seeds = mb["sample_seeds"][rows]
        n = self.settings.num_steps
        return renoise_noise(seeds, x0.shape[1:], epoch, t, n).to(x0.device)

    def _nft_terms(self, mb: Batch, mask: Tensor, with_kl: bool, epoch: int):
        """DiffusionNFT's loss [b, N] on the masked steps' noise levels (0 elsewhere) and the
        velocity KL to the reference ‖v − v_ref‖² [b, N] (or None)."""
        b, n = mask.shape
        loss = torch.zeros(b, n, device=self.device)
        kl = torch.zeros(b, n, device=self.device) if with_kl else None
        cond, x0_all, adv = cond_of(mb), mb["clean_latents"], mb["advantages"]
        nft = self.settings.nft
        for t in range(n):
            rows = mask[:, t].nonzero().flatten()
            rows = self._rows_or_placeholder(rows)
            if rows is None:
                continue
            x0, s, c = x0_all[rows], mb["sigmas"][rows, t], index_cond(cond, rows)
            x_t = obj.nft_noised(x0, self._renoise(mb, rows, x0, t, epoch), s)
            v = self.velocity(x_t, s, c)
            with torch.no_grad():
                v_old = self.velocity(x_t, s, c, old=True)
            a = adv[rows] if adv.dim() == 1 else adv[rows, t]
            r = obj.nft_reward_weight(a, self.settings.adv_clip_max)
            per = obj.nft_loss(
                v, v_old, x_t, x0, s, r, beta=nft.get("beta", 1.0),
                adv_clip_max=self.settings.adv_clip_max,
                weight_min=nft.get("adaptive_weight_min", 1e-5),
            )  # fmt: skip
            at = (rows, torch.full_like(rows, t))
            loss = loss.index_put(at, per)
            if kl is not None:
                with torch.no_grad():
                    v_ref = self.velocity(x_t, s, c, reference=True)
                d = (v - v_ref) ** 2
                kl = kl.index_put(at, d.reshape(d.shape[0], -1).mean(1))
        return loss, kl

    def _awm_terms(self, mb: Batch, mask: Tensor, with_kl: bool, epoch: int):
        """AWM's log-likelihood surrogate [b, N] under the trained and (no grad) the old model at
        the same re-noised latents, on the masked steps' noise levels (0 elsewhere), and the
        velocity KL to the reference ‖v − v_ref‖² [b, N] (or None)."""
        b, n = mask.shape
        logp = torch.zeros(b, n, device=self.device)
        old_logp = torch.zeros(b, n, device=self.device)
        kl = torch.zeros(b, n, device=self.device) if with_kl else None
        cond, x0_all = cond_of(mb), mb["clean_latents"]
        weighting = self.settings.awm.get("weighting", "uniform")
        for t in range(n):
            rows = self._rows_or_placeholder(mask[:, t].nonzero().flatten())
            if rows is None:
                continue
            x0, s, c = x0_all[rows], mb["sigmas"][rows, t], index_cond(cond, rows)
            noise = self._renoise(mb, rows, x0, t, epoch)
            x_t = obj.nft_noised(x0, noise, s)
            v = self.velocity(x_t, s, c)
            at = (rows, torch.full_like(rows, t))
            logp = logp.index_put(at, obj.awm_logprob(v, x0, noise, s, weighting))
            with torch.no_grad():
                v_old = self.velocity(x_t, s, c, old=True)
                old_logp = old_logp.index_put(at, obj.awm_logprob(v_old, x0, noise, s, weighting))
            if kl is not None:
                with torch.no_grad():
                    v_ref = self.velocity(x_t, s, c, reference=True)
                d = (v - v_ref) ** 2
                kl = kl.index_put(at, d.reshape(d.shape[0], -1).mean(1))
        return logp, old_logp, kl

    def _rows_or_placeholder(self, rows: Tensor) -> Tensor | None:
        """The rows training step t; with none, None — or, sharded, row 0 as a placeholder: every
        rank must run the same forwards (FSDP2's all-gathers are collectives); row 0's step t is
        masked out, so it adds nothing but keeps the backward's reduce-scatters in step too."""
        if rows.numel() > 0:
            return rows
        return torch.zeros(1, dtype=torch.long, device=rows.device) if self.placeholder else None

    def trainable_steps(self, sigmas: Tensor) -> Tensor:
        """[N] bool: the steps the objective can train — every step when it re-noises final
        latents, else those with exploration noise (CPS's last step, σ' = 0, has none)."""
        if self.settings.objective in ("nft", "awm"):
            return torch.ones(self.settings.num_steps, dtype=torch.bool)
        s, s_next = sigmas[:-1], sigmas[1:]
        zeros = torch.zeros(len(s), 1)
        _, std = self.spec.step(zeros, zeros, s, s_next, noise_level=self.noise_level)
        return std > 0
