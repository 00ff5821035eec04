"""diffusion.model.kind flux: a FluxTransformer2DModel built from FLUX.1-dev's config shrunk
(layers, widths, rope axes; guidance embedding kept), random weights, offline.

Packing, position ids and the image-size shift are checked against FluxPipeline's own functions;
the adapter's call against the transformer called as FluxPipeline calls it; the SDE step's
log-prob against the Flow-GRPO formula written out here; then one GRPO step and an exact resume
through the Trainer."""

import json
import math

import pytest
import torch

from groupflow.diffusion.models import (
    flux_image_ids,
    load_diffusers_model,
    pack_flux_latents,
    unpack_flux_latents,
)
from groupflow.diffusion.samplers import sample_trajectory
from groupflow.diffusion.schedule import flux_shift, sigma_schedule
from tests.diffusion.kind_checks import check_objectives_train

pytestmark = pytest.mark.slow  # importing diffusers takes 10-20 s on a shared CPU

# FLUX.1-dev's transformer config with layers and widths shrunk: 19 -> 1 dual-stream and 38 -> 1
# single-stream blocks, 24 heads of 128 -> 2 of 8 (rope axes [16, 56, 56] -> [2, 2, 4], summing to
# the head width), in_channels 64 (16 latent channels packed 2x2) -> 16 (4 channels), T5 4096 ->
# 16 and CLIP pooled 768 -> 8 features.
TINY_FLUX = {
    "patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1,
    "attention_head_dim": 8, "num_attention_heads": 2, "joint_attention_dim": 16,
    "pooled_projection_dim": 8, "guidance_embeds": True, "axes_dims_rope": [2, 2, 4],
}  # fmt: skip
SHAPE = (4, 8, 8)


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("flux")
    FluxTransformer2DModel(**TINY_FLUX).save_pretrained(path)
    return path


def test_packing_ids_and_shift_match_flux_pipeline():
    from diffusers import FluxPipeline
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    x = torch.randn(2, 4, 6, 8)
    packed = pack_flux_latents(x)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 2, 4, 6, 8))
    assert torch.equal(unpack_flux_latents(packed, 6, 8), x)
    # vae_scale_factor 1: the pipeline's pixel height is our latent height
    assert torch.equal(FluxPipeline._unpack_latents(packed, 6, 8, 1), x)
    ids = FluxPipeline._prepare_latent_image_ids(2, 3, 4, "cpu", torch.float32)
    assert torch.equal(flux_image_ids(6, 8), ids)
    for tokens in (16, 256, 1024, 4096):
        assert flux_shift(tokens) == pytest.approx(math.exp(calculate_shift(tokens)))
    # a 1024x1024 image (128x128 latent, 4096 tokens) gets e^1.15
    assert flux_shift(4096) == pytest.approx(math.exp(1.15))


def test_adapter_calls_the_transformer_as_flux_pipeline_does(flux_dir):
    torch.set_num_threads(1)
    model = load_diffusers_model(flux_dir, "flux", SHAPE, guidance=3.5)
    cond = model.encode(["a cat", "a dog"])
    assert cond["encoder_hidden_states"].shape == (2, 4, 16)
    assert cond["pooled_projections"].shape == (2, 8)
    x, sigma = torch.randn(2, *SHAPE), torch.tensor([1.0, 0.4])
    v = model(x, sigma, cond)
    assert v.shape == x.shape and torch.isfinite(v).all()
    with torch.no_grad():
        direct = model.transformer(
            hidden_states=FluxPipelinePack(x), timestep=sigma, guidance=torch.full((2,), 3.5),
            pooled_projections=cond["pooled_projections"],
            encoder_hidden_states=cond["encoder_hidden_states"], txt_ids=torch.zeros(4, 3),
            img_ids=flux_image_ids(8, 8), return_dict=False,
        )[0]  # fmt: skip
    assert torch.allclose(v, unpack_flux_latents(direct, 8, 8), atol=1e-6)
    other = load_diffusers_model(flux_dir, "flux", SHAPE, guidance=1.0)
    assert not torch.allclose(other(x, sigma, cond), v)  # the guidance embedding is used


def FluxPipelinePack(x):  # noqa: N802 (the reference is FluxPipeline's own packing)
    from diffusers import FluxPipeline

    b, c, h, w = x.shape
    return FluxPipeline._pack_latents(x, b, c, h, w)


def test_sde_logprob_is_the_flow_grpo_formula_and_groups_share_noise(flux_dir):
    torch.set_num_threads(1)
    model = load_diffusers_model(flux_dir, "flux", SHAPE)
    cond = model.encode(["a cat"] * 2)
    sigmas = sigma_schedule(3, flux_shift(16))
    noise = torch.randn(1, *SHAPE).expand(2, *SHAPE).clone()  # one group: the same start
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


def test_bad_flux_input_names_the_key(flux_dir, tmp_path):
    with pytest.raises(ValueError, match=r"packed 2x2 patches of 4 latent channels .* not 16"):
        load_diffusers_model(flux_dir, "flux", (16, 8, 8))
    with pytest.raises(ValueError, match="height 7 is not divisible by FLUX's 2x2 packing"):
        load_diffusers_model(flux_dir, "flux", (4, 7, 8))
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "SD3Transformer2DModel"}))
    with pytest.raises(ValueError, match="holds a SD3Transformer2DModel, but diffusion.model.kind "
                       "'flux' takes a FluxTransformer2DModel"):  # fmt: skip
        load_diffusers_model(tmp_path, "flux", SHAPE)


def test_one_grpo_step_and_an_exact_resume(flux_dir, tmp_path):
    from groupflow.config import config_from_dict
    from groupflow.run.tracking import read_metrics
    from groupflow.trainer import Trainer

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a cat", "a dog")))

    def run(name, steps, **run_over):
        cfg = config_from_dict({
            "run": {"name": name, "output_dir": str(tmp_path), "seed": 0, "total_steps": steps,
                    "loggers": [], "num_threads": 1, **run_over},
            "diffusion": {"model": {"kind": "flux", "path": str(flux_dir),
                                    "latent_shape": list(SHAPE)},
                          "num_steps": 2, "timestep_fraction": 1.0, "save_images": False},
            "data": {"train_files": [str(prompts)], "prompts_per_step": 2},
            "rollout": {"samples_per_prompt": 2},
            "validation": {"every_steps": 0},
            "actor": {"lr": 1e-3},
            "reward": {"functions": [{"name": "brightness"}]},
        })  # fmt: skip
        trainer = Trainer(cfg)
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


def test_flux_config_shift_and_guidance(flux_dir):
    from groupflow.config import ConfigError, config_from_dict
    from groupflow.policies.diffusion import resolve_shift

    def cfg(model=None, **diffusion):
        model = {"kind": "flux", "path": str(flux_dir), "latent_shape": [4, 8, 8], **(model or {})}
        return config_from_dict({"diffusion": {"model": model, **diffusion},
                                 "data": {"train_files": ["p.jsonl"]}})  # fmt: skip

    assert resolve_shift(cfg().diffusion) == pytest.approx(flux_shift(16))  # 4x4 packed tokens
    assert resolve_shift(cfg(shift=2.0).diffusion) == 2.0
    assert resolve_shift(cfg({"kind": "sd3"}).diffusion) == 3.0
    with pytest.raises(
        ConfigError, match="diffusion.model.guidance is for kind 'flux' or 'flux2', not 'sd3'"
    ):
        cfg({"kind": "sd3", "guidance": 5.0})


def test_nft_awm_and_flow_dppo_train_it(flux_dir, tmp_path):
    check_objectives_train("flux", flux_dir, SHAPE, tmp_path)
