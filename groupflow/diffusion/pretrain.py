"""Pre-training the tiny flow model on synthetic coloured shapes (the demo's base model).

Design decision: the diffusion demo must start from a model that already generates something
recognisable, so that RL fine-tunes a distribution instead of learning images from scratch. The
data are made on the fly: for each text label (a colour name) a filled circle or square of that
colour, at a random place and size, on a dark grey gradient background — no dataset download.
Training is plain rectified flow (x_σ = (1−σ)·x0 + σ·ε, target v = ε − x0, σ from a logit-normal
as in SD3) with 10 % label dropout to the null label so classifier-free guidance works. On one CPU
thread the default recipe takes well under a minute.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from groupflow.diffusion.models import TinyFlowModel, save_tiny_model
from groupflow.utils.progress import Progress

__all__ = ["COLORS", "synthetic_images", "pretrain_tiny_model", "flow_matching_loss"]

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.1, 0.1),
    "green": (0.1, 0.8, 0.2),
    "blue": (0.15, 0.25, 0.95),
    "yellow": (0.95, 0.85, 0.1),
    "cyan": (0.1, 0.85, 0.9),
    "magenta": (0.85, 0.15, 0.8),
}


def synthetic_images(labels: Sequence[str], size: int, generator: torch.Generator) -> torch.Tensor:
    """[B, 3, size, size] in [-1, 1]: one shape of each label's colour on a dark gradient."""
    unknown = [lab for lab in labels if lab not in COLORS]
    if unknown:
        raise ValueError(
            f"no synthetic colour for label {unknown[0]!r}; valid labels: {sorted(COLORS)}"
        )
    b = len(labels)
    coords = (torch.arange(size, dtype=torch.float32) + 0.5) / size
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    r = torch.rand(b, 6, generator=generator)
    # background: grey level 0.1-0.3 plus a gentle gradient in a random direction
    angle = r[:, 0] * 2 * torch.pi
    ramp = torch.cos(angle)[:, None, None] * xx + torch.sin(angle)[:, None, None] * yy
    bg = (0.1 + 0.2 * r[:, 1])[:, None, None] + 0.1 * ramp
    img = bg[:, None].expand(b, 3, size, size).clone()
    cx, cy = 0.25 + 0.5 * r[:, 2], 0.25 + 0.5 * r[:, 3]
    rad = 0.18 + 0.17 * r[:, 4]
    dx, dy = xx[None] - cx[:, None, None], yy[None] - cy[:, None, None]
    circle = dx**2 + dy**2 <= rad[:, None, None] ** 2
    square = (dx.abs() <= rad[:, None, None]) & (dy.abs() <= rad[:, None, None])
    inside = torch.where((r[:, 5] < 0.5)[:, None, None], circle, square)
    color = torch.tensor([COLORS[lab] for lab in labels])[:, :, None, None]
    img = torch.where(inside[:, None], color.expand_as(img), img)
    return img.clamp(0, 1) * 2 - 1


def flow_matching_loss(
    model: TinyFlowModel, x0: torch.Tensor, labels: torch.Tensor, g: torch.Generator
):
    """Rectified-flow MSE between the predicted and the true velocity ε − x0."""
    sigma = torch.sigmoid(torch.randn(x0.shape[0], generator=g))
    eps = torch.randn(x0.shape, generator=g)
    s = sigma[:, None, None, None]
    x = (1 - s) * x0 + s * eps
    v = model(x, sigma, {"labels": labels})
    return ((v - (eps - x0)) ** 2).mean()


def pretrain_tiny_model(
    out_dir: str | Path | None,
    *,
    labels: Sequence[str] = tuple(COLORS),
    steps: int = 600,
    batch_size: int = 32,
    lr: float = 2e-3,
    image_size: int = 16,
    width: int = 16,
    blocks: int = 2,
    label_dropout: float = 0.1,
    seed: int = 0,
) -> tuple[TinyFlowModel, dict[str, float]]:
    """Train a :class:`TinyFlowModel` from scratch; save it to ``out_dir`` (if given)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = TinyFlowModel(labels, image_size=image_size, width=width, blocks=blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * (1 - s / max(steps, 1)) + 0.05
    )
    start = time.perf_counter()
    recent: list[float] = []
    with Progress("pre-training the tiny flow model", steps, unit="steps") as progress:
        for _ in range(steps):
            idx = torch.randint(len(labels), (batch_size,), generator=g)
            x0 = synthetic_images([labels[int(i)] for i in idx.tolist()], image_size, g)
            drop = torch.rand(batch_size, generator=g) < label_dropout
            cond = torch.where(drop, len(labels), idx)
            loss = flow_matching_loss(model, x0, cond, g)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            recent = (recent + [float(loss.detach())])[-50:]
            progress.update(1, loss=f"{sum(recent) / len(recent):.4f}")  # mean of the last 50
    stats = {
        "pretrain/loss": sum(recent) / len(recent),
        "pretrain/seconds": time.perf_counter() - start,
    }
    model.eval()
    if out_dir is not None:
        save_tiny_model(model, out_dir)
    return model, stats
