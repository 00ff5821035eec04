"""The sections of how the models learn from the experience: ``algorithm`` (advantages, presets,
the KL penalty in the reward), ``actor`` (the policy update, LoRA), ``critic`` (PPO's value
model) and ``sft`` (the optional supervised warm start).

Design decision: names of estimators, losses and presets are checked against their registries at
load (imported inside the validators, so loading the schema does not import the algorithms), and
a typed option the chosen loss does not take is an error rather than silently dropped; what
spans sections (e.g. PPO needs a critic) is checked on ``Config``.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from groupflow.config.base import FloatPair, _Section
from groupflow.config.loss_keys import LOSS_TYPED_OPTIONS
from groupflow.config.model_data import TinyModelConfig
from groupflow.config.presets import PRESETS
from groupflow.config.registries import (
    advantage_estimator,
    check_options,
    option_names,
    policy_loss,
)

# The modes of groupflow.algorithms.aggregation, spelled out so that a typo fails at load without
# importing the algorithms; the actor and the critic average their token losses the same ways.
LossAgg = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "local_token_mean"
]


def _one_micro_batch_limit(section: str, samples: int | None, tokens: int | None) -> None:
    if samples and tokens:
        raise ValueError(
            f"set at most one of {section}.micro_batch_samples and {section}.micro_batch_tokens"
        )


class KLInRewardConfig(_Section):
    """KL penalty subtracted from the token rewards (verl use_kl_in_reward, kl_ctrl)."""

    coef: float = Field(default=0.001, ge=0)  # β (the initial β of the adaptive controller)
    # the per-token KL estimator (k1 = log-ratio, k2, k3 / low_var_kl, mse)
    kind: Literal["k1", "k2", "k3", "kl", "mse", "low_var_kl"] = "k1"
    # fixed β, or adaptive (the PPO paper's controller, towards target_kl)
    controller: Literal["fixed", "adaptive"] = "fixed"
    target_kl: float | None = Field(default=None, gt=0)  # adaptive only
    horizon: int | None = Field(default=None, ge=1)  # adaptive only, in samples

    @model_validator(mode="after")
    def _adaptive(self):
        if self.controller == "adaptive" and (self.target_kl is None or self.horizon is None):
            raise ValueError("controller 'adaptive' needs target_kl and horizon")
        return self


class AlgorithmConfig(_Section):
    # One key for the keys an algorithm spreads over sections (groupflow.config.presets: grpo,
    # dapo, dr_grpo, gspo, bnpo, cispo, rloo, reinforce_pp, opd); keys given explicitly win.
    preset: str | None = None
    estimator: str = "grpo"  # a name in groupflow.algorithms.ADVANTAGE_ESTIMATORS
    # extra options of that estimator
    estimator_options: dict[str, Any] = Field(default_factory=dict)
    # divide advantages by the std of the group, of the batch, or not at all (Dr. GRPO)
    scale: Literal["group", "batch", "none"] = "group"
    eps: float = Field(default=1e-6, ge=0)  # added to the std before dividing
    # clip advantages to ±this (None: no clipping)
    adv_clip_max: float | None = Field(default=None, gt=0)
    # zero the advantages of groups whose mean reward is below this (MMDanceGRPO; None: off)
    reward_threshold: float | None = None
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill
    # A CONTROL, not a method: permute advantages across the batch before the update, so the
    # update has the same statistics but no link between a sample and its reward. A run that
    # still improves with it on learns from something other than the reward signal.
    shuffle_advantages: bool = False
    # dynamic_sampling: rounds of extra generation to refill dropped groups before training on fewer
    max_sampling_rounds: int = Field(default=3, ge=1)
    # estimator "gae" (PPO with a critic): discount and GAE lambda over response tokens
    gamma: float = Field(default=1.0, ge=0, le=1)
    lam: float = Field(default=1.0, ge=0, le=1)  # GAE λ
    whiten_advantages: bool = True  # GAE advantages whitened over the batch's valid tokens
    kl_in_reward: KLInRewardConfig | None = None  # None: no KL penalty in the reward

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, name: str | None) -> str | None:
        if name is not None and name not in PRESETS:
            close = difflib.get_close_matches(name, list(PRESETS), n=1, cutoff=0.4)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}{hint}")
        return name

    @field_validator("estimator")
    @classmethod
    def _known(cls, name: str) -> str:
        if name == "gae":  # token-level, with a critic: not an outcome estimator of the registry
            return name
        advantage_estimator(name)  # raises, listing the valid names
        return name


class LoraConfig(_Section):
    """LoRA adapters on the policy (PEFT); the reference policy is the base with adapters disabled."""

    rank: int = Field(default=8, ge=1)  # adapter rank r
    alpha: float = Field(default=16.0, gt=0)  # LoRA α (the update is scaled by α / r)
    dropout: float = Field(default=0.0, ge=0, lt=1)  # dropout on the adapters' input
    # module names (suffixes) to adapt; "all-linear" adapts every linear layer but the LM head
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    # vision-language models: adapt the image tower's matching layers too (default: the language
    # model only)
    vision_tower: bool = False


class ActorConfig(_Section):
    lr: float = Field(default=1e-6, gt=0)  # AdamW learning rate
    weight_decay: float = Field(default=0.0, ge=0)  # AdamW weight decay
    betas: FloatPair = (0.9, 0.999)  # AdamW (β1, β2)
    # constant, or cosine decay to min_lr_ratio × lr over run.total_steps
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)  # linear learning-rate warm-up steps
    # cosine schedule's floor as a fraction of lr
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    # clip the gradient's global norm to this (None: no clipping); the norm is logged before
    # clipping
    grad_clip: float | None = Field(default=1.0, gt=0)
    ppo_epochs: int = Field(default=1, ge=1)  # μ
    # None: one optimizer step per rollout step
    mini_batch_samples: int | None = Field(default=None, ge=1)
    # samples per forward/backward (gradient accumulation over a mini-batch); None: the whole mini-
    # batch
    micro_batch_samples: int | None = Field(default=None, ge=1)
    # form micro-batches by a token budget instead (at most one of the two)
    micro_batch_tokens: int | None = Field(default=None, ge=1)
    # how token losses are averaged: over all tokens, per sequence then over sequences, or per-
    # sequence sums over a fixed length (Dr. GRPO); local_token_mean is per micro-batch (not
    # invariant to micro-batching)
    loss_agg: LossAgg = "token_mean"
    loss_fn: str = "ppo_clip"  # a name in groupflow.algorithms.POLICY_LOSSES
    loss_options: dict[str, Any] = Field(default_factory=dict)  # extra options of that loss
    # importance ratio per token (PPO/GRPO) or per sequence (GSPO)
    ratio_level: Literal["token", "sequence"] = "token"
    clip_eps_low: float = Field(default=0.2, gt=0)  # PPO clip range below 1
    # PPO clip range above 1 (DAPO's clip-higher); None: clip_eps_low
    clip_eps_high: float | None = Field(default=None, gt=0)
    # dual-clip bound for negative advantages (verl's clip_ratio_c; None: off)
    clip_ratio_c: float | None = Field(default=3.0, gt=1)
    # upper bound of the ratio for positive advantages (TRL's delta, two-sided clipping; None: off)
    delta: float | None = Field(default=None, gt=1)
    # weight of the KL-to-reference loss term (0: no reference forward)
    kl_coef: float = Field(default=0.0, ge=0)
    # the KL estimator of the loss term (k3 / low_var_kl as in GRPO)
    kl_kind: Literal["k1", "k2", "k3", "kl", "mse", "low_var_kl"] = "k3"
    # Multiply the per-token KL of the loss term by the importance ratio π/π_old, with gradient
    # (TRL's use_bias_correction_kl, DeepSeek-V3.2; groupflow.algorithms.importance_weighted_kl).
    # False: the estimate as it is (verl). Needs kl_coef > 0.
    kl_bias_correction: bool = False
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss)
    logprob_chunk_tokens: int = Field(default=4096, ge=1)  # tokens whose logits exist at once
    # Encode each distinct prompt once per micro-batch and share its K/V with the rows that repeat
    # it (GRPO's G samples): the same log-probs and gradients with (G-1)/G of the prompt compute
    # saved. A switch only to rule it out when debugging; it falls back to one pass by itself.
    share_prompt_prefix: bool = True
    # Padding-free forwards (groupflow.models.packing): each micro-batch's samples (their
    # attended prompt and response tokens only) concatenated into one row, position ids
    # restarting per sample, attention confined to each sample (flash-attention's varlen path on
    # GPU, a block-diagonal SDPA mask on CPU) — for the update, the old-policy and reference
    # log-probs and the supervised warm start; the same log-probs, losses and gradients as the
    # padded forward. micro_batch_tokens then counts real tokens (a sample longer than it is an
    # error), micro-batches are filled first-fit-decreasing, and several workers get a split of
    # the batch balanced by tokens. Replaces share_prompt_prefix. Not with
    # parallel.sequence_parallel > 1 or vision-language models (refused at load).
    packing: bool = False
    # auto: recompute when there are several optimizer steps per batch, or when the rollout
    # engine is vLLM (its log-probs differ numerically from the training forward); with off_policy
    # tis/decoupled and one optimizer step the update's own forward gives the proximal log-probs
    # (the same weights: no extra pass; policies.llm.old_logprobs_source). always: a separate pass.
    recompute_old_logprobs: Literal["auto", "always", "never"] = "auto"
    # Truncated importance sampling: weight each token's loss by min(exp(old − rollout), tis_cap)
    # to correct for the rollout engine's numerics (groupflow.algorithms.correction). None: off.
    tis_cap: float | None = Field(default=None, gt=0)
    # Off-policy correction for stale or engine-sampled batches (groupflow.algorithms.correction):
    # none (naive PPO: the behaviour log-probs anchor the ratio unless recomputed), tis (needs
    # tis_cap), decoupled (AReaL: the proximal policy — the weights before this update — anchors
    # the ratio, loss weighted by π_prox/π_behav, tokens above behav_weight_cap dropped).
    # auto: tis when tis_cap is set, else none.
    off_policy: Literal["auto", "none", "tis", "decoupled"] = "auto"
    behav_weight_cap: float | None = Field(default=5.0, gt=0)  # decoupled only; None: no mask
    # consecutive steps with a non-finite loss (skipped, counted) before the run stops
    max_nonfinite_steps: int = Field(default=3, ge=1)
    # Leave samples whose advantages are all 0 (groups where every sample got the same reward)
    # out of the update's forward/backward. Exact: their loss and gradient are 0 and they still
    # count in the loss denominators. Applies only when nothing else gives them a gradient
    # (kl_coef = 0, entropy_coef = 0, a loss declared zero-advantage-inert, a global-denominator
    # loss_agg); the actor/* ratio, clip and entropy metrics then cover the updated samples.
    skip_zero_advantage: bool = True
    lora: LoraConfig | None = None  # None: full fine-tuning
    # FSDP2 CPUOffloadPolicy for the policy: parameter shards, their gradients and AdamW's state
    # in (pinned) CPU memory, a layer's shards copied to the device for its all-gather, the
    # optimizer step on the CPU (verl's param_offload + optimizer_offload); needs FSDP, i.e.
    # run.num_workers >= 2 (diffusion policies: diffusion.cpu_offload)
    cpu_offload: bool = False
    # Where a sharded actor (run.num_workers >= 2) generates from with the HF engine. gather: the
    # FSDP2-sharded policy itself, each decoder layer all-gathered when it runs and freed after it
    # (per-rank weight memory stays 1/world of the model plus one layer; the ranks decode in
    # lockstep, one all-gather per layer and token). copy: a full unsharded copy on every rank,
    # refreshed after every update (no collectives while decoding; a whole model per rank).
    # One worker, or an engine with weights of its own (vLLM), uses neither.
    generation_weights: Literal["gather", "copy"] = "gather"

    @field_validator("loss_fn")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        policy_loss(name)  # raises, listing the valid names
        return name

    @model_validator(mode="after")
    def _loss_options_fit_the_loss(self):
        # A typed PPO option the chosen loss does not take would be dropped silently
        # (workers.common.loss_options passes only those it declares): one set to a value other
        # than its default is an error (a dumped config, which holds every default, still loads).
        fn = policy_loss(self.loss_fn)
        accepted = option_names(fn)
        if accepted is not None:
            for key in LOSS_TYPED_OPTIONS:
                default = type(self).model_fields[key].default
                if key not in accepted and getattr(self, key) != default:
                    raise ValueError(
                        f"actor.{key} does not apply to actor.loss_fn={self.loss_fn!r} (its "
                        f"options: {', '.join(accepted) or '(none)'}; set them under "
                        "actor.loss_options)"
                    )
        try:
            check_options(fn, self.loss_options, what=f"actor.loss_fn={self.loss_fn!r}")
        except TypeError as e:  # pydantic reports ValueErrors with the location
            raise ValueError(f"actor.loss_options: {e}") from None
        return self

    @model_validator(mode="after")
    def _micro(self):
        _one_micro_batch_limit("actor", self.micro_batch_samples, self.micro_batch_tokens)
        if self.kl_bias_correction and self.kl_coef == 0:
            raise ValueError(
                "actor.kl_bias_correction weights the KL loss term, which actor.kl_coef=0 turns "
                "off; set actor.kl_coef > 0 or unset actor.kl_bias_correction"
            )
        return self


class SFTConfig(_Section):
    """Optional supervised warm start on the training prompts' answers (the CPU demo uses it)."""

    steps: int = Field(default=0, ge=0)  # supervised steps before RL (0: none)
    lr: float = Field(default=1e-3, gt=0)  # learning rate of the warm start
    batch_samples: int = Field(default=64, ge=1)  # samples per supervised step
    # on a probe of TRAINING prompts
    stop_at_accuracy: float | None = Field(default=None, ge=0, le=1)
    check_every: int = Field(default=10, ge=1)  # steps between probe-accuracy checks
    # training prompts in that probe (greedy episodes)
    probe_prompts: int = Field(default=128, ge=1)
    # agent workflow: rows whose demonstrations are played through the agent (an episode each;
    # an environment whose episodes are slow, e.g. a verifiers harness program, wants fewer)
    demonstrations: int = Field(default=1024, ge=1)
    target_field: str = "answer"  # the row field that holds the answer trained on


class CriticConfig(_Section):
    """The value model of PPO (estimator gae): LM backbone + scalar head, its own optimizer."""

    path: str | None = None  # a local HF directory or Hub id (any causal LM; the head starts fresh)
    revision: str | None = None  # of a Hub id in path
    tiny: TinyModelConfig | None = None  # a tiny one; path and tiny both None: copy the policy
    lr: float = Field(default=1e-5, gt=0)  # AdamW learning rate
    weight_decay: float = Field(default=0.0, ge=0)  # AdamW weight decay
    betas: FloatPair = (0.9, 0.999)  # AdamW (β1, β2)
    # constant, or cosine decay to min_lr_ratio × lr
    lr_schedule: Literal["constant", "cosine"] = "constant"
    lr_warmup_steps: int = Field(default=0, ge=0)  # linear learning-rate warm-up steps
    # cosine schedule's floor as a fraction of lr
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    # clip the gradient's global norm (None: off)
    grad_clip: float | None = Field(default=1.0, gt=0)
    ppo_epochs: int = Field(default=1, ge=1)  # passes over each batch
    # None: one optimizer step per rollout step
    mini_batch_samples: int | None = Field(default=None, ge=1)
    # samples per forward/backward (None: the whole mini-batch)
    micro_batch_samples: int | None = Field(default=None, ge=1)
    # form micro-batches by a token budget instead
    micro_batch_tokens: int | None = Field(default=None, ge=1)
    # how token value losses are averaged (as actor.loss_agg)
    loss_agg: LossAgg = "token_mean"
    value_clip: float | None = Field(default=0.5, gt=0)  # verl cliprange_value; None: no clipping
    # Padding-free value forwards and updates, as actor.packing (critic.micro_batch_tokens then
    # counts real tokens)
    packing: bool = False
    # steps in which only the critic trains (verl critic_warmup)
    warmup_steps: int = Field(default=0, ge=0)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # parameter dtype of the critic

    @model_validator(mode="after")
    def _checks(self):
        if self.path is not None and self.tiny is not None:
            raise ValueError(
                "set at most one of critic.path and critic.tiny (neither: copy the policy)"
            )
        _one_micro_batch_limit("critic", self.micro_batch_samples, self.micro_batch_tokens)
        return self
