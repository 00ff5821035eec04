"""The ``diffusion`` section: a flow-matching policy (model, sampler, timestep selection, LoRA).

Design decision: its own file beside the LLM sections because nothing else in the schema refers to
its fields; the cross-section rules (which LLM-only keys a diffusion run refuses, the defaults it
gives the actor's clip range) are the diffusion kind's, in ``groupflow.config.kinds``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from groupflow.config.base import IntPair, _Section
from groupflow.config.registries import get_sampler


class DiffusionLoraConfig(_Section):
    """LoRA adapters (PEFT) on the flow model; the reference policy is the model with them disabled."""

    rank: int = Field(default=8, ge=1)  # adapter rank r
    alpha: float = Field(default=16.0, gt=0)  # LoRA α (the update is scaled by α / r)
    # module names (suffixes) to adapt
    target_modules: list[str] = Field(default_factory=lambda: ["conv1", "conv2"])


# the kinds whose pipeline's VAE decodes through diffusion.model.vae_path (groupflow.diffusion.vaes)
VAE_KINDS = ("sd3", "wan", "flux", "qwen_image", "z_image", "flux2")
# ... and whose text encoder through text_encoder_path (groupflow.diffusion.text_encoders)
TEXT_ENCODER_KINDS = ("sd3", "wan", "flux", "qwen_image", "z_image", "flux2")
# the kinds with a second text encoder (text_encoder_2_path): SD3's CLIP-G, FLUX.1's T5
SECOND_ENCODER_KINDS = ("sd3", "flux")


class DiffusionModelConfig(_Section):
    """Where the flow-matching model comes from (a local directory or a Hub id)."""

    # the model family: tiny (built in), sd3 (SD3/3.5 transformer), wan (Wan2.1/2.2), flux (FLUX.1),
    # qwen_image (Qwen-Image), z_image (Z-Image), flux2 (FLUX.2 dev / klein)
    kind: Literal["tiny", "sd3", "wan", "flux", "qwen_image", "z_image", "flux2"] = "tiny"
    path: str  # tiny: a `groupflow pretrain-diffusion` dir; else a diffusers transformer dir
    revision: str | None = None  # of a Hub id in path
    # [C, H, W]; wan: [C, F, H, W]. flux, qwen_image: the unpacked latent (H and W even, packed
    # 2x2 by the adapter); z_image: H and W divisible by its patch; flux2: the pipeline's
    # 2x2-patchified latent [in_channels, H, W]
    latent_shape: list[int] | None = None
    # flux, flux2 only: the guidance scale a guidance-distilled FLUX (guidance_embeds: FLUX.1-dev,
    # FLUX.2-dev) takes
    guidance: float = Field(default=3.5, ge=0)
    # tiny only: pre-train the base model into `path` first when it is missing (cached after)
    pretrain_if_missing: bool = False
    # tiny with pretrain_if_missing: steps of flow-matching pre-training
    pretrain_steps: int = Field(default=600, ge=1)
    lora: DiffusionLoraConfig | None = None
    # The pipeline's parts below (text encoders, tokenizers, VAE) are each a local folder, a Hub
    # id, or, when `path` is a whole diffusers pipeline (a Hub snapshot: model_index.json), the
    # name of its folder there (`text_encoder`, `vae`); a local path wins.
    # the pipeline's text encoder (its `text_encoder/` folder), for kinds sd3, wan, flux,
    # qwen_image, z_image and flux2; without one, prompts get fixed random embeddings. sd3: CLIP-L
    # (CLIPTextModelWithProjection), with CLIP-G in text_encoder_2_path and T5 in
    # text_encoder_3_path; wan: UMT5; flux: CLIP (its pooled output), with T5 in
    # text_encoder_2_path; qwen_image: Qwen2.5-VL; z_image: Qwen3; flux2: Mistral3 (dev) or
    # Qwen3 (klein)
    text_encoder_path: str | None = None
    tokenizer_path: str | None = None  # default: `tokenizer/` beside the text encoder
    # sd3: CLIP-G (CLIPTextModelWithProjection); flux: FLUX.1's T5 encoder; default:
    # `text_encoder_2/` beside text_encoder_path
    text_encoder_2_path: str | None = None
    # sd3, flux; default: `tokenizer_2/` beside text_encoder_2_path's encoder
    tokenizer_2_path: str | None = None
    # sd3 only: SD3's T5-XXL (T5EncoderModel), its tokenizer `tokenizer_3/` beside it; unset:
    # no T5, its part of the prompt embedding zeros (the pipeline with text_encoder_3=None)
    text_encoder_3_path: str | None = None
    # text-encoder tokens per prompt, every prompt padded to them (sd3's T5 — its pipeline's
    # default is 256 —, wan, flux's T5, z_image, flux2; qwen_image: caption tokens after its
    # template, at most 1024)
    max_sequence_length: int = Field(default=512, ge=1)
    # the pipeline's VAE (its `vae/` folder), decoding what the rewards score; without
    # one, images are latent previews. sd3, flux, z_image: AutoencoderKL (its scaling_factor and
    # shift_factor); wan: AutoencoderKLWan; qwen_image: AutoencoderKLQwenImage; flux2:
    # AutoencoderKLFlux2
    vae_path: str | None = None

    @model_validator(mode="after")
    def _shape(self):
        for key, (kinds, what) in _PART_KINDS.items():
            if getattr(self, key) and self.kind not in kinds:
                raise ValueError(f"diffusion.model.{key} {what}, not '{self.kind}'")
        extra = [k for k in ("text_encoder_2_path", "tokenizer_2_path", "text_encoder_3_path")
                 if getattr(self, k)]  # fmt: skip
        if extra and not self.text_encoder_path:
            raise ValueError(
                f"diffusion.model.{extra[0]} needs diffusion.model.text_encoder_path (CLIP): "
                f"the '{self.kind}' pipeline conditions on all its text encoders together"
            )
        if self.kind != "tiny" and self.latent_shape is None:
            raise ValueError(f"diffusion.model.latent_shape is required for kind '{self.kind}'")
        if self.kind not in ("flux", "flux2") and self.guidance != 3.5:  # (dumped: the default)
            raise ValueError(
                f"diffusion.model.guidance is for kind 'flux' or 'flux2', not '{self.kind}'"
            )
        if self.kind != "tiny" and self.pretrain_if_missing:
            raise ValueError("diffusion.model.pretrain_if_missing applies to kind 'tiny' only")
        return self


_TEXT = (TEXT_ENCODER_KINDS, f"is for kinds {', '.join(TEXT_ENCODER_KINDS)} (their pipelines' "
         "text encoders)")  # fmt: skip
_SECOND = (SECOND_ENCODER_KINDS, "is SD3's CLIP-G (kind 'sd3') or FLUX.1's T5 (kind 'flux')")
# which kinds take each pipeline part, and what the part is (the refusal says it)
_PART_KINDS = {
    "text_encoder_path": _TEXT, "tokenizer_path": _TEXT,
    "text_encoder_2_path": _SECOND, "tokenizer_2_path": _SECOND,
    "text_encoder_3_path": (("sd3",), "is SD3's T5 (kind 'sd3')"),
    "vae_path": (VAE_KINDS, f"is for kinds {', '.join(VAE_KINDS)} (their pipelines' VAEs)"),
}  # fmt: skip


class SdeWindowConfig(_Section):
    """MixGRPO: the SDE (and training) only on a window of ``size`` denoising steps, the ODE
    elsewhere; the window moves ``stride`` steps every ``shift_interval`` training steps (stride 0:
    fixed) and stops at the last step, or with ``roll_back`` starts over."""

    size: int = Field(default=4, ge=1)  # steps in the SDE window
    shift_interval: int = Field(default=25, ge=1)  # training steps between window moves
    stride: int = Field(default=1, ge=0)  # steps the window moves each time (0: fixed)
    roll_back: bool = False  # start over at the first step after the last


class NftConfig(_Section):
    """DiffusionNFT (forward-process RL): ``beta`` mixes the trained and the old velocity into the
    implicit positive/negative policies; the old (sampling) model follows the trained one with an
    EMA whose decay rises by ``old_decay_rate`` per update up to ``old_decay_max``."""

    # mix of the trained and the old velocity in the implicit policies
    beta: float = Field(default=1.0, gt=0)
    # per-update increase of the old model's EMA decay
    old_decay_rate: float = Field(default=0.001, ge=0)
    old_decay_max: float = Field(default=0.5, ge=0, lt=1)  # the EMA decay's ceiling
    # floor of the adaptive loss weight's denominator (numerical safety)
    adaptive_weight_min: float = Field(default=1e-5, gt=0)


class FlowDppoConfig(_Section):
    """Flow-DPPO: the exact per-step Gaussian KL(old || new) above which an update that widens
    the gap is masked (verl-omni's default 1e-5)."""

    # per-step Gaussian KL above which a widening update is masked
    kl_mask_threshold: float = Field(default=1e-5, gt=0)


class AwmConfig(_Section):
    """AWM: the time weighting of the flow-matching log-likelihood surrogate."""

    # time weighting of the surrogate: uniform, t or t²
    weighting: Literal["uniform", "t", "t2"] = "uniform"


class DiffusionConfig(_Section):
    """GRPO for flow-matching generators (Flow-GRPO / DanceGRPO); algorithms.md §7.

    Setting this section makes the policy a diffusion model: prompts still come from ``data``,
    samples per prompt from ``rollout.samples_per_prompt``, optimisation from ``actor`` and
    advantages from ``algorithm`` (with diffusion defaults: ``actor.clip_eps_low = 1e-4`` and
    ``algorithm.adv_clip_max = 5`` unless set). ``model`` must then be absent.
    """

    model: DiffusionModelConfig
    sampler: str = "flow_sde"  # training sampler: flow_sde | dance_sde | cps (nft: any, ode too)
    noise_level: float | None = Field(default=None, ge=0)  # None: flow_sde 0.7, dance_sde 0.3
    num_steps: int = Field(default=10, ge=1)  # denoising steps per sample
    # timestep shift of the flow-matching schedule (SD3's shift); None: 3.0, or for kinds flux,
    # qwen_image and flux2 their pipeline's image-size-dependent shift (kinds.default_shift)
    shift: float | None = Field(default=None, gt=0)
    cfg_scale: float = Field(default=1.0, ge=0)  # 1: no classifier-free guidance
    # a group's samples start from the same initial noise (Flow-GRPO)
    same_noise_per_group: bool = True
    # which steps train: a random fraction per sample, or a fixed window
    timestep_selection: Literal["random", "window"] = "random"
    timestep_fraction: float = Field(default=0.5, gt=0, le=1)  # of the steps, chosen per sample
    window: IntPair | None = None  # [start, end) steps for timestep_selection=window
    eval_sampler: str = "ode"  # sampler of the validation images (ode: deterministic)
    eval_samples_per_prompt: int = Field(default=2, ge=1)  # fixed noise seeds per validation prompt
    save_images: bool = True  # PNG grids of the online test in <run>/images/
    sde_window: SdeWindowConfig | None = None  # MixGRPO: SDE on a sliding window, ODE elsewhere
    ratio_norm: bool = False  # GRPO-Guard: mean-corrected, step-scaled ratio and 1/|dt| weights
    # nft: DiffusionNFT's forward-process objective; flow_dppo: Flow-DPPO's divergence mask
    # instead of ratio clipping; awm: Advantage Weighted Matching (groupflow.diffusion.objectives)
    objective: Literal["grpo", "nft", "flow_dppo", "awm"] = "grpo"
    nft: NftConfig = Field(default_factory=NftConfig)
    flow_dppo: FlowDppoConfig = Field(default_factory=FlowDppoConfig)
    awm: AwmConfig = Field(default_factory=AwmConfig)
    # FSDP2 over run.num_workers ranks (each block, then the root) instead of full replicas
    fsdp: bool = False
    activation_checkpointing: bool = False  # diffusers transformers: recompute block activations
    # FSDP2 mixed precision: bf16 parameters and compute, fp32 gradient reduction and master
    # weights (AdamW updates the fp32 shards); needs fsdp on >= 2 workers
    bf16: bool = False
    # FSDP2 CPUOffloadPolicy: parameter shards, their gradients and AdamW's state in (pinned) CPU
    # memory, a block's shards copied to the GPU for its all-gather, the optimizer step on the
    # CPU (the seed's parameter/optimizer offload); needs fsdp on >= 2 workers
    cpu_offload: bool = False

    @field_validator("sampler", "eval_sampler")
    @classmethod
    def _known_sampler(cls, name: str) -> str:
        get_sampler(name)  # raises, listing the valid names
        return name

    @model_validator(mode="after")
    def _train_sampler(self):
        # DiffusionNFT needs no log-probs: any sampler, the ODE included, collects its data
        if self.objective in ("grpo", "flow_dppo") and not get_sampler(self.sampler).stochastic:
            raise ValueError(
                f"diffusion.sampler '{self.sampler}' has no step log-probs; train with flow_sde, "
                "dance_sde or cps (use it as diffusion.eval_sampler, or with diffusion.objective=nft)"
            )
        if self.ratio_norm and self.sampler == "cps":
            raise ValueError(
                "diffusion.ratio_norm (GRPO-Guard) corrects Gaussian log-probs; the cps sampler's "
                "are constant-free squared errors: use flow_sde or dance_sde"
            )
        if (
            self.objective in ("nft", "awm")
            and not get_sampler(self.sampler).stochastic
            and self.same_noise_per_group
        ):
            raise ValueError(
                f"diffusion.sampler '{self.sampler}' is deterministic: with "
                "diffusion.same_noise_per_group every sample of a group is the same image and "
                "every advantage 0; set same_noise_per_group: false"
            )
        if self.objective != "grpo" and self.ratio_norm:
            raise ValueError(
                "diffusion.ratio_norm (GRPO-Guard) rewrites Flow-GRPO's clipped ratio; "
                f"diffusion.objective={self.objective} has its own objective"
            )
        return self

    @model_validator(mode="after")
    def _memory_options(self):
        # FSDP2's options and activation checkpointing apply to the diffusers transformers
        if self.activation_checkpointing and self.model.kind == "tiny":
            raise ValueError(
                "diffusion.activation_checkpointing is for the diffusers transformers "
                "(diffusion.model.kind sd3 / wan), not 'tiny'"
            )
        if self.bf16 and not self.fsdp:
            raise ValueError(
                "diffusion.bf16 is FSDP2's mixed precision (bf16 compute, fp32 master weights): "
                "set diffusion.fsdp: true"
            )
        if self.cpu_offload and not self.fsdp:
            raise ValueError(
                "diffusion.cpu_offload is FSDP2's CPUOffloadPolicy (parameter shards, gradients "
                "and optimizer state in CPU memory): set diffusion.fsdp: true"
            )
        return self

    @model_validator(mode="after")
    def _trained_timesteps(self):
        if self.sde_window is not None:
            if self.sde_window.size > self.num_steps:
                raise ValueError(
                    f"diffusion.sde_window.size={self.sde_window.size} exceeds "
                    f"diffusion.num_steps={self.num_steps}"
                )
            if self.timestep_selection == "window" or "timestep_fraction" in self.model_fields_set:
                raise ValueError(
                    "diffusion.sde_window trains every step of its window: drop "
                    "diffusion.timestep_selection=window / diffusion.timestep_fraction"
                )
        if self.timestep_selection == "window":
            if self.window is None:
                raise ValueError(
                    "diffusion.window [start, end) is required for timestep_selection=window"
                )
            if not 0 <= self.window[0] < self.window[1] <= self.num_steps:
                raise ValueError(
                    f"diffusion.window {list(self.window)} must satisfy 0 <= start < end <= num_steps={self.num_steps}"
                )
        return self
