"""The checks every diffusers model kind's test runs the same way (test_flux.py wrote them out
first): the SDE step's log-prob against the Flow-GRPO formula with a group sharing its start
noise, the schedule a pipeline's scheduler makes from a shift, one GRPO step plus an exact resume
through the Trainer (on ``diffusion_config``), and one step of each other objective."""

from __future__ import annotations

import json
import math

import numpy as np
import torch

from groupflow.diffusion.samplers import sample_trajectory
from groupflow.diffusion.schedule import shift_sigmas, sigma_schedule


def check_sde_logprob(model, shape, shift: float) -> None:
    """Flow-GRPO's Gaussian step x_{i+1} ~ N(mean, std²), written out, equals the sampler's
    log-prob; two samples from the same start noise take different SDE steps."""
    cond = model.encode(["a cat"] * 2)
    sigmas = sigma_schedule(3, shift)
    noise = torch.randn(1, *shape).expand(2, *shape).clone()  # one group: the same start
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    with torch.no_grad():
        traj = sample_trajectory(lambda x, s: model(x, s, cond), noise, sigmas, "flow_sde",
                                 noise_level=0.7, generators=gens)  # fmt: skip
        assert torch.equal(traj.latents[0, 0], traj.latents[1, 0])
        assert not torch.equal(traj.next_latents[0, 0], traj.next_latents[1, 0])
        i = 1  # a step with 0 < σ < 1
        x, xn = traj.latents[:, i].double(), traj.next_latents[:, i].double()
        s, sn = float(sigmas[i]), float(sigmas[i + 1])
        v = model(traj.latents[:, i], torch.full((2,), s), cond).double()
    dt = sn - s
    g = 0.7 * math.sqrt(s / (1 - s))
    mean = x * (1 + g**2 / (2 * s) * dt) + v * (1 + g**2 * (1 - s) / (2 * s)) * dt
    std = g * math.sqrt(-dt)
    lp = -((xn - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    assert torch.allclose(traj.logprobs[:, i].double(), lp.reshape(2, -1).mean(1), atol=1e-5)


def scheduler_sigmas(config: dict, steps: int, mu: float | None) -> torch.Tensor:
    """The sigmas FlowMatchEulerDiscreteScheduler makes as the pipelines call it: from
    linspace(1, 1/N, N), with the pipeline's μ (ignored without dynamic shifting)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps).tolist(), mu=mu)
    return scheduler.sigmas[:-1].double()


def our_sigmas(steps: int, shift: float) -> torch.Tensor:
    """Our schedule's first N sigmas on the same unshifted grid the pipelines use."""
    return shift_sigmas(torch.linspace(1.0, 1 / steps, steps, dtype=torch.float64), shift)


def diffusion_config(
    kind: str,
    model_dir,
    shape,
    tmp_path,
    *,
    name: str,
    steps: int,
    model: dict | None = None,
    diffusion: dict | None = None,
    **run_over,
):
    """The config every kind's Trainer checks run: two prompts, 2 x 2 samples of 2 denoising
    steps, the brightness reward, no validation (``model``, ``diffusion``, ``run_over``: keys
    over that)."""
    from groupflow.config import config_from_dict

    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a cat", "a big dog")))
    return config_from_dict({
        "run": {"name": name, "output_dir": str(tmp_path), "seed": 0, "total_steps": steps,
                "loggers": [], "num_threads": 1, **run_over},
        "diffusion": {"model": {"kind": kind, "path": str(model_dir), "latent_shape": list(shape),
                                **(model or {})},
                      "num_steps": 2, "timestep_fraction": 1.0, "save_images": False,
                      **(diffusion or {})},
        "data": {"train_files": [str(prompts)], "prompts_per_step": 2},
        "rollout": {"samples_per_prompt": 2},
        "validation": {"every_steps": 0},
        "actor": {"lr": 1e-3},
        "reward": {"functions": [{"name": "brightness"}]},
    })  # fmt: skip


def check_grpo_step_and_resume(kind: str, model_dir, shape, tmp_path) -> None:
    """Two GRPO steps train (finite loss, a gradient), and one step, a checkpoint and a resumed
    second step reach the same metrics and weights exactly."""
    from groupflow.run.tracking import read_metrics
    from groupflow.trainer import Trainer

    def run(name, steps, **run_over):
        trainer = Trainer(diffusion_config(kind, model_dir, shape, tmp_path, name=name,
                                           steps=steps, **run_over))  # fmt: skip
        trainer.fit()
        return trainer

    full = run("full", 2)
    rows = [r for r in read_metrics(full.run_dir / "metrics.jsonl") if "actor/loss" in r]
    assert len(rows) == 2 and all(r["actor/grad_norm"] > 0 for r in rows)
    assert all(math.isfinite(r["actor/loss"]) for r in rows)
    run("part", 1, save_every=1)
    resumed = run("part", 2)
    a, b = rows[-1], read_metrics(resumed.run_dir / "metrics.jsonl")[-1]
    for key in ("reward/mean", "actor/grad_norm", "actor/loss"):
        assert a[key] == b[key], key
    wa, wb = full.policy.actor.state_dict()["model"], resumed.policy.actor.state_dict()["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def check_objectives_train(kind: str, model_dir, shape, tmp_path) -> None:
    """One step of each likelihood-free or ratio-free objective (DiffusionNFT, AWM, Flow-DPPO)
    trains the kind: a finite loss and a gradient (the objectives never look inside the model,
    so this checks that the kind's call and latents carry them)."""
    from groupflow.run.tracking import read_metrics
    from groupflow.trainer import Trainer

    for objective in ("nft", "awm", "flow_dppo"):
        cfg = diffusion_config(kind, model_dir, shape, tmp_path, name=objective, steps=1,
                               diffusion={"objective": objective})  # fmt: skip
        trainer = Trainer(cfg)
        trainer.fit()
        rows = [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if "actor/loss" in r]
        assert len(rows) == 1 and math.isfinite(rows[0]["actor/loss"]), objective
        assert rows[0]["actor/grad_norm"] > 0, objective
