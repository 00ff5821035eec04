"""The diffusion workflow: prompts → G images (or videos) per prompt from the SDE sampler → rewards,
and the online test (fixed prompts × fixed noise, ODE sampler, PNG grids).

Design decision: what is specific to a flow-matching generator's *experience* lives here — prompt
texts (no tokenizer), seeds per sample, image rewards, the images written for the online test —
while its training calls are the diffusion *policy*'s and its advantages the shared credit
stage's. Every ``validation.every_steps`` steps (and before/after training) the fixed validation
prompts are sampled from fixed noise seeds with the ODE sampler; the mean reward is logged as
``val/reward/mean`` and a PNG grid (one row per prompt) is written to
``<run>/images/step_<N>.png``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from groupflow.batch import Batch
from groupflow.config import Config, present
from groupflow.contracts import validate
from groupflow.data import DataError, PromptRow
from groupflow.diffusion import rewards as _rewards  # noqa: F401  (registers the image rewards)
from groupflow.diffusion.worker import prompt_rows
from groupflow.utils.progress import Progress
from groupflow.utils.seeds import step_seeds
from groupflow.workflows.detach import PolicyParts
from groupflow.workflows.llm import finite_metrics, row_fields, with_prompt_info

__all__ = ["DiffusionWorkflow", "save_image_grid"]


def _prompt_text(row: PromptRow) -> str:
    if not isinstance(row.prompt, str):
        raise DataError(
            "a diffusion prompt must be a plain string, got chat messages",
            source=row.source, index=row.index, field="prompt",
        )  # fmt: skip
    return row.prompt


class DiffusionWorkflow(PolicyParts):
    """Text prompts → SDE samples with per-step log-probs → image rewards."""

    takes_run_dir = True  # validation writes image grids under the run directory
    # the prompt texts are looked up by row identity, the process's own: attach builds them again
    over_policy = (*PolicyParts.over_policy, "train_texts")
    travels_as_built = True  # to the asynchronous rollout side (workflows.detach)

    def __init__(self, cfg: Config, policy, train_rows: list[PromptRow], val_rows: list[PromptRow],
                 rewards, run_dir: Path):  # fmt: skip
        self.cfg, self.policy, self.run_dir = cfg, policy, run_dir
        self.train_texts = {id(r): _prompt_text(r) for r in train_rows}
        self._train_rows = train_rows
        self.reward_fn = rewards
        self.data_stats: dict[str, float] = {}
        # Fixed prompts for the online test: the validation rows, else the distinct training prompts.
        self.val_rows = (
            val_rows or list({self.train_texts[id(r)]: r for r in train_rows}.values())[:8]
        )
        self.contracts = policy.contracts

    def attach(self, policy, rewards) -> None:
        self.train_texts = {id(r): _prompt_text(r) for r in self._train_rows}
        self.reward_fn, self.contracts = rewards, policy.contracts

    @property
    def train_rows(self) -> list[PromptRow]:
        return self._train_rows

    def collect(self, rows: list[PromptRow], step: int, round_: int,
                version: int) -> tuple[Batch, dict[str, float]]:  # fmt: skip
        n = self.cfg.rollout.samples_per_prompt
        seeds, group_ids = step_seeds(self.cfg.run.seed, step, round_, len(rows), n)
        texts = [self.train_texts.get(id(r)) or _prompt_text(r) for r in rows]
        inputs = prompt_rows(texts, seeds, group_ids)
        out = self.policy.rollout.generate(inputs, n)
        batch = with_prompt_info(out, rows, texts, n, f"{step}-{round_}", version)
        batch["completion"] = [_describe(img) for img in batch["images"]]
        validate(batch, self.contracts["rollout"])
        result = self.reward_fn(
            list(batch["prompt"]), list(batch["images"]), group_ids=batch["group_ids"],
            **row_fields(batch["row"]),
        )  # fmt: skip
        batch["rewards"] = result.total.float()
        return validate(batch, self.contracts["rewarded"]), finite_metrics(result.metrics)

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
        return m

    def warm_start(self) -> dict[str, float]:
        return dict(self.policy.pretrain_stats)

    def validate(self, step: int, return_records: bool = False, progress_label="validation"):
        """Fixed prompts × fixed noise, ODE sampler: mean reward and a PNG grid in the run dir."""
        d = present(self.cfg.diffusion, "diffusion")
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
        with Progress(progress_label, len(texts), unit="images", leave=False) as progress:
            images = self.policy.rollout.sample_images(inputs, sampler=d.eval_sampler)["images"]
            progress.update(len(texts))
        result = self.reward_fn(texts, list(images), **row_fields(rows))
        metrics = {
            "val/reward/mean": float(result.total.mean()),
            "val/seconds": time.perf_counter() - start,
        }
        for key, v in result.metrics.items():
            if key.startswith("reward/") and key.endswith("/mean") and math.isfinite(v):
                metrics[f"val/{key}"] = float(v)
        if d.save_images:
            save_image_grid(images, k, self.run_dir / "images" / f"step_{step:06d}.png")
        return (metrics, {}) if return_records else metrics


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
        (pixels.shape[1] * scale, pixels.shape[0] * scale), Image.Resampling.NEAREST
    ).save(path)
    return path
