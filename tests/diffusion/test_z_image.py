"""diffusion.model.kind z_image: a ZImageTransformer2DModel built from Z-Image-Turbo's config
shrunk (layers, widths, rope axes), random weights, offline.

The latent and caption lists and the schedule are checked against what ZImagePipeline does (it
has no helper functions for them: the expressions are its own, written out) and its scheduler;
the adapter's call against the transformer called as ZImagePipeline calls it (timestep 1 − σ,
output negated, unpadded captions); the SDE step's log-prob against the Flow-GRPO formula; then
one GRPO step and an exact resume through the Trainer."""

import json

import pytest
import torch

from groupflow.diffusion.kinds import default_shift, z_image_captions, z_image_inputs
from groupflow.diffusion.models import load_diffusers_model
from tests.diffusion.kind_checks import (
    check_grpo_step_and_resume,
    check_objectives_train,
    check_sde_logprob,
    our_sigmas,
    scheduler_sigmas,
)

pytestmark = pytest.mark.slow  # importing diffusers takes 10-20 s on a shared CPU

# Tongyi-MAI/Z-Image-Turbo's transformer config with layers and widths shrunk: 30 -> 1 main
# layer, 2 -> 1 noise- and caption-refiner layers, width 3840 in 30 heads -> 16 in 2 (rope axes
# [32, 48, 48] -> [2, 2, 4], summing to the head width), 16 -> 4 latent channels, Qwen3 caption
# features 2560 -> 16; patch 2 (frames 1), rope lengths [1536, 512, 512] as there.
TINY_Z_IMAGE = {
    "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 4, "dim": 16, "n_layers": 1,
    "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2, "cap_feat_dim": 16,
    "axes_dims": [2, 2, 4], "axes_lens": [1536, 512, 512],
}  # fmt: skip
# Tongyi-MAI/Z-Image-Turbo's scheduler_config.json: a fixed shift, no dynamic shifting
Z_SCHEDULER = {"shift": 3.0, "use_dynamic_shifting": False}
SHAPE = (4, 8, 8)


@pytest.fixture(scope="module")
def z_dir(tmp_path_factory):
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("z_image")
    ZImageTransformer2DModel(**TINY_Z_IMAGE).save_pretrained(path)
    return path


def test_inputs_and_shift_match_z_image_pipeline():
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

    x = torch.randn(2, 4, 6, 8)
    ours = z_image_inputs(x)
    theirs = list(x.unsqueeze(2).unbind(dim=0))  # ZImagePipeline's latent_model_input_list
    assert len(ours) == 2 and all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    hidden, mask = torch.randn(2, 5, 3), torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    caps = z_image_captions(hidden, mask)
    # its _encode_prompt: prompt_embeds[i][prompt_masks[i]] with a bool mask
    for i in range(2):
        assert torch.equal(caps[i], hidden[i][mask[i].bool()])
    # μ is computed but the scheduler ignores it: its sigmas are SD3's fixed shift 3
    mu = calculate_shift(16)
    assert torch.allclose(scheduler_sigmas(Z_SCHEDULER, 6, mu), our_sigmas(6, 3.0))
    assert default_shift("z_image", SHAPE, 10) == 3.0


def test_adapter_calls_the_transformer_as_z_image_pipeline_does(z_dir):
    torch.set_num_threads(1)
    model = load_diffusers_model(z_dir, "z_image", SHAPE)
    cond = model.encode(["a cat", "a big brown dog"])
    assert cond["encoder_hidden_states"].shape == (2, 4, 16)
    assert cond["encoder_hidden_states_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    x, sigma = torch.randn(2, *SHAPE), torch.tensor([1.0, 0.4])
    v = model(x, sigma, cond)
    assert v.shape == x.shape and torch.isfinite(v).all()
    with torch.no_grad():
        t = 1000 * sigma  # the scheduler's timesteps
        out = model.transformer(
            list(x.unsqueeze(2).unbind(dim=0)), (1000 - t) / 1000,
            [cond["encoder_hidden_states"][0, :2], cond["encoder_hidden_states"][1]],
            return_dict=False,
        )[0]  # fmt: skip
        direct = -torch.stack([o.float() for o in out], dim=0).squeeze(2)
        assert torch.allclose(v, direct, atol=1e-6)
        # captions are unpadded: what sits under the mask changes nothing
        noisy = dict(cond, encoder_hidden_states=cond["encoder_hidden_states"] + 5.0
                     * (1 - cond["encoder_hidden_states_mask"][..., None]))  # fmt: skip
        assert torch.allclose(model(x, sigma, noisy), v, atol=1e-6)
        null = model(x, sigma, model.null_cond(2))
        assert null.shape == x.shape and not torch.allclose(null, v)


def test_sde_logprob_is_the_flow_grpo_formula_and_groups_share_noise(z_dir):
    torch.set_num_threads(1)
    model = load_diffusers_model(z_dir, "z_image", SHAPE)
    check_sde_logprob(model, SHAPE, default_shift("z_image", SHAPE, 3))


def test_bad_z_image_input_names_the_key(z_dir, tmp_path):
    with pytest.raises(
        ValueError, match="ZImageTransformer2DModel takes 4 latent channels, not 16"
    ):
        load_diffusers_model(z_dir, "z_image", (16, 8, 8))
    with pytest.raises(ValueError, match="height 7 is not divisible by Z-Image's patch size 2"):
        load_diffusers_model(z_dir, "z_image", (4, 7, 8))
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "SD3Transformer2DModel"}))
    with pytest.raises(ValueError, match="holds a SD3Transformer2DModel, but diffusion.model.kind "
                       "'z_image' takes a ZImageTransformer2DModel"):  # fmt: skip
        load_diffusers_model(tmp_path, "z_image", SHAPE)


def test_one_grpo_step_and_an_exact_resume(z_dir, tmp_path):
    check_grpo_step_and_resume("z_image", z_dir, SHAPE, tmp_path)


def test_nft_awm_and_flow_dppo_train_it(z_dir, tmp_path):
    check_objectives_train("z_image", z_dir, SHAPE, tmp_path)


def test_z_image_config_shift(z_dir):
    from groupflow.config import ConfigError, config_from_dict
    from groupflow.policies.diffusion import resolve_shift

    def cfg(model=None, **diffusion):
        model = {"kind": "z_image", "path": str(z_dir), "latent_shape": [4, 8, 8], **(model or {})}
        return config_from_dict({"diffusion": {"model": model, **diffusion},
                                 "data": {"train_files": ["p.jsonl"]}})  # fmt: skip

    assert resolve_shift(cfg().diffusion) == 3.0
    assert resolve_shift(cfg(shift=2.0).diffusion) == 2.0
    with pytest.raises(ConfigError, match="guidance is for kind 'flux' or 'flux2', not 'z_image'"):
        cfg({"guidance": 5.0})
