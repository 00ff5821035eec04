"""The diffusion policy on the driver side: the small object the trainer hands policy-specific work to.

Design decision: the trainer's loop (collect → old log-probs → advantages → update → validate →
checkpoint) is the same for every policy type; what differs is how a rollout becomes a Batch, what
the reward functions see, which tensors the workers need, how validation works and which metrics
describe a step. This object supplies exactly those five things for a flow-matching generator
(``rollout_and_reward``, ``add_logprobs``, ``update``, ``validate``, ``step_metrics``), so the
trainer does not branch on the policy type beyond choosing this object. Advantages, the loss, the
LR schedule and checkpoints are the trainer's and the LLM's code.

Online test: every ``validation.every_steps`` steps (and before/after training), the fixed
validation prompts are sampled from fixed noise seeds with the ODE sampler; the mean reward is
logged as ``val/reward/mean`` and a PNG grid (one row per prompt) is written to
``<run>/images/step_<N>.png``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch

from groupflow import builders
from groupflow.batch import Batch
from groupflow.config import Config, DiffusionConfig
from groupflow.contracts import DIFFUSION_CONTRACTS, validate
from groupflow.data import DataError, PromptLoader, PromptRow
from groupflow.diffusion import rewards as _rewards  # noqa: F401  (registers the image rewards)
from groupflow.diffusion.worker import COND_PREFIX, DiffusionSettings, DiffusionWorker, prompt_rows

log = logging.getLogger("groupflow")

__all__ = ["DiffusionPolicy", "FlowModelSpec", "settings_from_config", "save_image_grid"]

_MODEL_KEYS = (
    "latents", "next_latents", "sigmas", "sigmas_next", "response_mask", "advantages", "old_logprobs",
)  # fmt: skip


class FlowModelSpec:
    """How a worker builds its flow model inside its own process (picklable for Ray)."""

    def __init__(self, kind: str, path: str, latent_shape: list[int] | None = None):
        self.kind, self.path, self.latent_shape = kind, path, latent_shape

    def build(self):
        from groupflow.diffusion.models import load_diffusers_model, load_tiny_model

        if self.kind == "tiny":
            return load_tiny_model(self.path)
        return load_diffusers_model(self.path, self.kind, self.latent_shape)


def settings_from_config(d: DiffusionConfig) -> DiffusionSettings:
    return DiffusionSettings(
        sampler=d.sampler, noise_level=d.noise_level, num_steps=d.num_steps, shift=d.shift,
        cfg_scale=d.cfg_scale, same_noise_per_group=d.same_noise_per_group,
        timestep_selection=d.timestep_selection, timestep_fraction=d.timestep_fraction,
        window=d.window, lora=d.model.lora.model_dump() if d.model.lora else None,
    )  # fmt: skip


def _prompt_text(row: PromptRow) -> str:
    if not isinstance(row.prompt, str):
        raise DataError(
            "a diffusion prompt must be a plain string, got chat messages",
            source=row.source, index=row.index, field="prompt",
        )  # fmt: skip
    return row.prompt


def ensure_tiny_model(d: DiffusionConfig, seed: int) -> dict[str, float]:
    """Pre-train the tiny base model (labels: the synthetic colours) into ``d.model.path`` when
    asked and missing; later runs reuse it."""
    m = d.model
    path = Path(m.path).expanduser()
    if m.kind != "tiny" or (path / "config.json").is_file():
        return {}
    if not m.pretrain_if_missing:
        raise FileNotFoundError(
            f"diffusion.model.path '{path}' holds no tiny model; create it with "
            f"`groupflow pretrain-diffusion --out {path}` or set diffusion.model.pretrain_if_missing=true"
        )
    from groupflow.diffusion.pretrain import pretrain_tiny_model

    log.info("pre-training the tiny flow model into %s (%d steps)", path, m.pretrain_steps)
    _, stats = pretrain_tiny_model(path, steps=m.pretrain_steps, seed=seed)
    return stats


class DiffusionPolicy:
    """Driver-side half of the diffusion policy: data, rewards, the worker group, validation."""

    contracts = DIFFUSION_CONTRACTS

    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        d = cfg.diffusion
        train_rows, val_rows, self.data_stats = builders.build_data(cfg)
        self.train_texts = {id(r): _prompt_text(r) for r in train_rows}
        self.data_stats.update(ensure_tiny_model(d, cfg.run.seed))
        if d.model.kind == "tiny":
            _check_labels(Path(d.model.path), train_rows + val_rows)
        self.reward_fn = builders.build_reward(cfg)
        self.reward_fn.check_fields({k for r in train_rows for k in r.fields})
        self.loader = PromptLoader(
            train_rows, cfg.data.prompts_per_step, seed=cfg.run.seed, shuffle=cfg.data.shuffle
        )
        # Fixed prompts for the online test: the validation rows, else the distinct training prompts.
        self.val_rows = (
            val_rows or list({self.train_texts[id(r)]: r for r in train_rows}.values())[:8]
        )
        spec = FlowModelSpec(d.model.kind, d.model.path, d.model.latent_shape)
        from groupflow.builders import role_group

        self.actor = role_group(
            cfg, "actor", DiffusionWorker, spec=spec, settings=settings_from_config(d), cfg=cfg.actor,
            total_steps=cfg.run.total_steps, pg_timeout_s=cfg.run.worker_timeout_s,
        )  # fmt: skip

    # ----- stages -----------------------------------------------------------------------------
    def rollout_and_reward(self, rows: list[PromptRow], step: int, round_: int) -> Batch:
        from groupflow.trainer import sample_seed, with_prompt_info

        n = self.cfg.rollout.samples_per_prompt
        base = round_ * 1_000_000  # distinct seeds and group ids for refill rounds
        seeds = [sample_seed(self.cfg.run.seed, step, base + i) for i in range(len(rows) * n)]
        texts = [self.train_texts.get(id(r)) or _prompt_text(r) for r in rows]
        inputs = prompt_rows(
            texts,
            [seeds[i * n : (i + 1) * n] for i in range(len(rows))],
            [base + i for i in range(len(rows))],
        )
        out = self.actor.generate(inputs, n)
        batch = with_prompt_info(out, rows, texts, n, uid_prefix=f"{step}-{round_}")
        batch["completion"] = [_describe(img) for img in batch["images"]]
        validate(batch, DIFFUSION_CONTRACTS["rollout"])
        return validate(self.add_rewards(batch), DIFFUSION_CONTRACTS["rewarded"])

    def add_rewards(self, batch: Batch) -> Batch:
        from groupflow.trainer import _fields

        result = self.reward_fn(
            list(batch["prompt"]), list(batch["images"]), **_fields(batch["row"])
        )
        batch["rewards"] = result.total.float()
        batch.meta["reward_metrics"] = result.metrics
        return batch

    def add_logprobs(self, batch: Batch) -> Batch:
        """Old log-probs: recomputed when a batch gets several optimizer steps, else the rollout's."""
        a = self.cfg.actor
        several = a.ppo_epochs > 1 or (a.mini_batch_samples or len(batch)) < len(batch)
        if a.recompute_old_logprobs == "always" or (a.recompute_old_logprobs == "auto" and several):
            batch["old_logprobs"] = self.actor.compute_logprobs(self.model_inputs(batch))[
                "logprobs"
            ]
        else:
            # One optimizer step per batch: the rollout's log-probs come from the same step function
            # computed the same way (step by step), so the first ratio is exactly 1.
            batch["old_logprobs"] = batch["rollout_logprobs"]
        return batch

    def update(self, batch: Batch, shuffle_seed: int) -> dict[str, float]:
        batch = validate(batch, DIFFUSION_CONTRACTS["train_ready"])
        return self.actor.update(self.model_inputs(batch), shuffle_seed=shuffle_seed)

    def model_inputs(self, batch: Batch) -> Batch:
        """Only the tensors the workers need: images, texts and dataset rows stay on the driver."""
        keys = [k for k in batch.tensors if k in _MODEL_KEYS or k.startswith(COND_PREFIX)]
        return batch.select(*keys, meta=False)

    def step_metrics(self, batch: Batch, seconds: float) -> dict[str, float]:
        rewards, adv = batch["rewards"], batch["advantages"]
        m = {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std(unbiased=False)),
            "reward/max": float(rewards.max()),
            "reward/min": float(rewards.min()),
            "advantages/mean": float(adv.mean()),
            "advantages/std": float(adv.std(unbiased=False)),
            "advantages/max": float(adv.max()),
            "advantages/min": float(adv.min()),
            "batch/samples": float(len(batch)),
            "batch/trained_steps_per_sample": float(batch["response_mask"].sum(1).float().mean()),
            "perf/samples_per_s": len(batch) / max(seconds, 1e-9),
        }
        for k, v in batch.meta.get("reward_metrics", {}).items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                m[k] = float(v)
        return m

    # ----- online test ------------------------------------------------------------------------
    def validate(self, step: int) -> dict[str, float]:
        """Fixed prompts × fixed noise, ODE sampler: mean reward and a PNG grid in the run dir."""
        d = self.cfg.diffusion
        k = d.eval_samples_per_prompt
        rows = [r for r in self.val_rows for _ in range(k)]
        texts = [_prompt_text(r) for r in rows]
        seeds = [
            self.cfg.run.seed * 7919 + i % k + 1000 * j
            for j in range(len(self.val_rows))
            for i in range(k)
        ]
        start = time.perf_counter()
        inputs = Batch({"noise_seed": torch.tensor(seeds)}, {"prompt": texts})
        images = self.actor.sample_images(inputs, sampler=d.eval_sampler)["images"]
        from groupflow.trainer import _fields

        result = self.reward_fn(texts, list(images), **_fields(rows))
        metrics = {
            "val/reward/mean": float(result.total.mean()),
            "val/seconds": time.perf_counter() - start,
        }
        for key, v in result.metrics.items():
            if key.startswith("reward/") and key.endswith("/mean") and math.isfinite(v):
                metrics[f"val/{key}"] = float(v)
        if d.save_images:
            save_image_grid(images, k, self.run_dir / "images" / f"step_{step:06d}.png")
        return metrics


def _check_labels(path: Path, rows: list[PromptRow]) -> None:
    labels = json.loads((path / "config.json").read_text()).get("labels", [])
    for r in rows:
        if isinstance(r.prompt, str) and r.prompt not in labels:
            raise DataError(
                f"prompt {r.prompt!r} is not a label of the tiny diffusion model at {path}; "
                f"valid prompts: {labels}",
                source=r.source, index=r.index, field="prompt",
            )  # fmt: skip


def _describe(image: torch.Tensor) -> str:
    """A short text for samples.jsonl: size and mean colour of the generated image/video."""
    rgb = image.reshape(image.shape[0], -1).mean(1).tolist()
    return (
        f"<image {'x'.join(map(str, image.shape))} mean rgb ({', '.join(f'{c:.2f}' for c in rgb)})>"
    )


def save_image_grid(images: torch.Tensor, per_row: int, path: Path, scale: int = 4) -> Path:
    """[B, 3, H, W] (or video [B, 3, F, H, W]: first frame) in [0, 1] -> one PNG, ``per_row`` per row."""
    from PIL import Image

    if images.dim() == 5:
        images = images[:, :, 0]
    b, _, h, w = images.shape
    rows = math.ceil(b / per_row)
    grid = torch.ones(3, rows * (h + 1) + 1, per_row * (w + 1) + 1)
    for i, img in enumerate(images):
        r, c = divmod(i, per_row)
        grid[:, 1 + r * (h + 1) : 1 + r * (h + 1) + h, 1 + c * (w + 1) : 1 + c * (w + 1) + w] = img[
            :3
        ]
    pixels = (grid.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).resize(
        (pixels.shape[1] * scale, pixels.shape[0] * scale), Image.NEAREST
    ).save(path)
    return path
