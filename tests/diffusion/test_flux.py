"""diffusion.model.kind flux: a FluxTransformer2DModel built from FLUX.1-dev's config shrunk
(layers, widths, rope axes; guidance embedding kept), random weights, offline.

Packing, position ids and the image-size shift are checked against FluxPipeline's own functions;
the adapter's call against the transformer called as FluxPipeline calls it; the SDE step's
log-prob against the Flow-GRPO formula; then one GRPO step and an exact resume through the
Trainer, and one step of each other objective (the last three are ``kind_checks``, shared by
every kind's tests)."""

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
from groupflow.diffusion.schedule import flux_shift
from tests.diffusion.kind_checks import (
    check_grpo_step_and_resume,
    check_objectives_train,
    check_sde_logprob,
)

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
    check_sde_logprob(load_diffusers_model(flux_dir, "flux", SHAPE), SHAPE, flux_shift(16))


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
    check_grpo_step_and_resume("flux", flux_dir, SHAPE, tmp_path)


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
