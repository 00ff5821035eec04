"""diffusion.model.kind flux2: a Flux2Transformer2DModel built from FLUX.2-dev's config shrunk
(layers, widths, rope axes; guidance embedding kept), random weights, offline.

Packing, position ids and the image-size shift are checked against Flux2Pipeline's own functions
and a scheduler set up as its; the adapter's call against the transformer called as Flux2Pipeline
calls it; the SDE step's log-prob against the Flow-GRPO formula; then one GRPO step and an exact
resume through the Trainer."""

import json
import math

import pytest
import torch

from groupflow.diffusion.kinds import (
    default_shift,
    flux2_image_ids,
    flux2_text_ids,
    pack_flux2_latents,
    unpack_flux2_latents,
)
from groupflow.diffusion.models import load_diffusers_model
from groupflow.diffusion.schedule import flux2_shift
from tests.diffusion.kind_checks import (
    check_grpo_step_and_resume,
    check_objectives_train,
    check_sde_logprob,
    our_sigmas,
    scheduler_sigmas,
)

pytestmark = pytest.mark.slow  # importing diffusers takes 10-20 s on a shared CPU

# FLUX.2-dev's transformer config (Flux2Transformer2DModel's defaults) with layers and widths
# shrunk: 8 -> 1 dual-stream and 48 -> 1 single-stream blocks, 48 heads of 128 -> 2 of 8 (rope
# axes [32, 32, 32, 32] -> [2, 2, 2, 2], summing to the head width), in_channels 128 (32 VAE
# channels patchified 2x2) -> 16, Mistral text 15360 -> 16 features, timestep/guidance channels
# 256 -> 8; the guidance embedding kept (klein's config has none: guidance_embeds false).
TINY_FLUX2 = {
    "patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1,
    "attention_head_dim": 8, "num_attention_heads": 2, "joint_attention_dim": 16,
    "timestep_guidance_channels": 8, "axes_dims_rope": [2, 2, 2, 2], "guidance_embeds": True,
}  # fmt: skip
# FLUX.2's scheduler: exponential dynamic shifting by the μ the pipeline passes
FLUX2_SCHEDULER = {"shift": 3.0, "use_dynamic_shifting": True, "time_shift_type": "exponential"}
SHAPE = (16, 4, 4)  # the 2x2-patchified latent the pipeline samples in


@pytest.fixture(scope="module")
def flux2_dir(tmp_path_factory):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("flux2")
    Flux2Transformer2DModel(**TINY_FLUX2).save_pretrained(path)
    return path


def test_packing_ids_and_shift_match_flux2_pipeline():
    from diffusers import Flux2Pipeline
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    x = torch.randn(2, 16, 3, 5)
    packed = pack_flux2_latents(x)
    assert torch.equal(packed, Flux2Pipeline._pack_latents(x))
    assert torch.equal(unpack_flux2_latents(packed, 3, 5), x)
    ids = Flux2Pipeline._prepare_latent_ids(x)  # [B, H·W, 4]
    assert torch.equal(flux2_image_ids(3, 5), ids[0]) and torch.equal(ids[0], ids[1])
    back = Flux2Pipeline._unpack_latents_with_ids(packed, ids)
    assert torch.equal(back, x)
    text = torch.randn(2, 7, 16)
    assert torch.equal(flux2_text_ids(7), Flux2Pipeline._prepare_text_ids(text)[1])
    for tokens, steps in ((16, 3), (1024, 28), (4096, 50), (5000, 10)):
        mu = compute_empirical_mu(tokens, steps)
        assert flux2_shift(tokens, steps) == pytest.approx(math.exp(mu))
    mu = compute_empirical_mu(16, 6)
    assert torch.allclose(scheduler_sigmas(FLUX2_SCHEDULER, 6, mu), our_sigmas(6, math.exp(mu)))
    # 1024x1024: a 128x128 VAE latent, patchified to 64x64 = 4096 tokens
    assert default_shift("flux2", (128, 64, 64), 28) == pytest.approx(
        math.exp(compute_empirical_mu(4096, 28))
    )


def test_adapter_calls_the_transformer_as_flux2_pipeline_does(flux2_dir):
    from diffusers import Flux2Pipeline

    torch.set_num_threads(1)
    model = load_diffusers_model(flux2_dir, "flux2", SHAPE, guidance=4.0)
    cond = model.encode(["a cat", "a dog"])
    assert cond["encoder_hidden_states"].shape == (2, 4, 16) and "pooled_projections" not in cond
    x, sigma = torch.randn(2, *SHAPE), torch.tensor([1.0, 0.4])
    v = model(x, sigma, cond)
    assert v.shape == x.shape and torch.isfinite(v).all()
    with torch.no_grad():
        ids = Flux2Pipeline._prepare_latent_ids(x)
        direct = model.transformer(
            hidden_states=Flux2Pipeline._pack_latents(x), timestep=(1000 * sigma) / 1000,
            guidance=torch.full((2,), 4.0), encoder_hidden_states=cond["encoder_hidden_states"],
            txt_ids=Flux2Pipeline._prepare_text_ids(cond["encoder_hidden_states"]), img_ids=ids,
            return_dict=False,
        )[0]  # fmt: skip
        assert torch.allclose(v, Flux2Pipeline._unpack_latents_with_ids(direct, ids), atol=1e-6)
        other = load_diffusers_model(flux2_dir, "flux2", SHAPE, guidance=1.0)
        assert not torch.allclose(other(x, sigma, cond), v)  # the guidance embedding is used


def test_sde_logprob_is_the_flow_grpo_formula_and_groups_share_noise(flux2_dir):
    torch.set_num_threads(1)
    model = load_diffusers_model(flux2_dir, "flux2", SHAPE)
    check_sde_logprob(model, SHAPE, default_shift("flux2", SHAPE, 3))


def test_bad_flux2_input_names_the_key(flux2_dir, tmp_path):
    with pytest.raises(ValueError, match=r"diffusion.model.latent_shape=\[4, 8, 8\]: the "
                       r"Flux2Transformer2DModel takes the 2x2-patchified latent of 16 channels"):  # fmt: skip
        load_diffusers_model(flux2_dir, "flux2", (4, 8, 8))
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
    with pytest.raises(ValueError, match="holds a FluxTransformer2DModel, but diffusion.model.kind "
                       "'flux2' takes a Flux2Transformer2DModel"):  # fmt: skip
        load_diffusers_model(tmp_path, "flux2", SHAPE)


def test_one_grpo_step_and_an_exact_resume(flux2_dir, tmp_path):
    check_grpo_step_and_resume("flux2", flux2_dir, SHAPE, tmp_path)


def test_nft_awm_and_flow_dppo_train_it(flux2_dir, tmp_path):
    check_objectives_train("flux2", flux2_dir, SHAPE, tmp_path)


def test_flux2_config_shift_and_guidance(flux2_dir):
    from groupflow.config import config_from_dict
    from groupflow.policies.diffusion import resolve_shift

    def cfg(model=None, **diffusion):
        model = {"kind": "flux2", "path": str(flux2_dir), "latent_shape": list(SHAPE),
                 **(model or {})}  # fmt: skip
        return config_from_dict({"diffusion": {"model": model, **diffusion},
                                 "data": {"train_files": ["p.jsonl"]}})  # fmt: skip

    # 4x4 tokens and the step count: both move FLUX.2's shift
    assert resolve_shift(cfg(num_steps=4).diffusion) == pytest.approx(flux2_shift(16, 4))
    assert resolve_shift(cfg(num_steps=20).diffusion) == pytest.approx(flux2_shift(16, 20))
    assert resolve_shift(cfg(shift=2.0).diffusion) == 2.0
    assert cfg({"guidance": 4.0}).diffusion.model.guidance == 4.0
