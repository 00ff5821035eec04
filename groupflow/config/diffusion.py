"""The ``diffusion`` section: a flow-matching policy (model, sampler, timestep selection, LoRA).

Design decision: its own file beside the LLM sections because nothing else in the schema refers to
its fields; the cross-section rules (which LLM-only keys a diffusion run refuses) live on
``Config``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from groupflow.config.sections import IntPair, _Section


class DiffusionLoraConfig(_Section):
    """LoRA adapters (PEFT) on the flow model; the reference policy is the model with them disabled."""

    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    target_modules: list[str] = Field(default_factory=lambda: ["conv1", "conv2"])


class DiffusionModelConfig(_Section):
    """Where the flow-matching model comes from (a LOCAL directory, never a hub id)."""

    kind: Literal["tiny", "sd3", "wan"] = "tiny"
    path: str  # tiny: a `groupflow pretrain-diffusion` dir; sd3/wan: a diffusers transformer dir
    latent_shape: list[int] | None = None  # sd3: [C, H, W]; wan: [C, F, H, W]; tiny: from the model
    # tiny only: pre-train the base model into `path` first when it is missing (cached after)
    pretrain_if_missing: bool = False
    pretrain_steps: int = Field(600, ge=1)
    lora: DiffusionLoraConfig | None = None

    @model_validator(mode="after")
    def _shape(self):
        if self.kind != "tiny" and self.latent_shape is None:
            raise ValueError(f"diffusion.model.latent_shape is required for kind '{self.kind}'")
        if self.kind != "tiny" and self.pretrain_if_missing:
            raise ValueError("diffusion.model.pretrain_if_missing applies to kind 'tiny' only")
        return self


class DiffusionConfig(_Section):
    """GRPO for flow-matching generators (Flow-GRPO / DanceGRPO); algorithms.md §7.

    Setting this section makes the policy a diffusion model: prompts still come from ``data``,
    samples per prompt from ``rollout.samples_per_prompt``, optimisation from ``actor`` and
    advantages from ``algorithm`` (with diffusion defaults: ``actor.clip_eps_low = 1e-4`` and
    ``algorithm.adv_clip_max = 5`` unless set). ``model`` must then be absent.
    """

    model: DiffusionModelConfig
    sampler: str = "flow_sde"  # training sampler: flow_sde | dance_sde
    noise_level: float | None = Field(None, ge=0)  # None: flow_sde 0.7, dance_sde 0.3
    num_steps: int = Field(10, ge=1)
    shift: float = Field(3.0, gt=0)
    cfg_scale: float = Field(1.0, ge=0)  # 1: no classifier-free guidance
    same_noise_per_group: bool = True
    timestep_selection: Literal["random", "window"] = "random"
    timestep_fraction: float = Field(0.5, gt=0, le=1)  # of the steps, chosen per sample
    window: IntPair | None = None  # [start, end) steps for timestep_selection=window
    eval_sampler: str = "ode"
    eval_samples_per_prompt: int = Field(2, ge=1)  # fixed noise seeds per validation prompt
    save_images: bool = True  # PNG grids of the online test in <run>/images/

    @field_validator("sampler", "eval_sampler")
    @classmethod
    def _known_sampler(cls, name: str) -> str:
        from groupflow.diffusion.samplers import get_sampler

        get_sampler(name)  # raises, listing the valid names
        return name

    @model_validator(mode="after")
    def _train_sampler(self):
        from groupflow.diffusion.samplers import get_sampler

        if not get_sampler(self.sampler).stochastic:
            raise ValueError(
                f"diffusion.sampler '{self.sampler}' has no step log-probs; train with flow_sde or "
                "dance_sde (use it as diffusion.eval_sampler)"
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
