"""diffusion.model.kind qwen_image: a QwenImageTransformer2DModel built from Qwen-Image's config
shrunk (layers, widths, rope axes), random weights, offline.

Packing, image shapes and the image-size shift are checked against QwenImagePipeline's own
functions and its scheduler; the adapter's call against the transformer called as
QwenImagePipeline calls it (text mask included); the frozen text stream of the last block; the
SDE step's log-prob against the Flow-GRPO formula; then one GRPO step and an exact resume through
the Trainer."""

import json
import math

import pytest
import torch

from groupflow.diffusion.kinds import QWEN_IMAGE_SHIFT, default_shift, qwen_image_shapes
from groupflow.diffusion.models import load_diffusers_model, pack_flux_latents, unpack_flux_latents
from groupflow.diffusion.schedule import flux_shift
from tests.diffusion.kind_checks import (
    check_grpo_step_and_resume,
    check_objectives_train,
    check_sde_logprob,
    our_sigmas,
    scheduler_sigmas,
)

pytestmark = pytest.mark.slow  # importing diffusers takes 10-20 s on a shared CPU

# Qwen/Qwen-Image's transformer config with layers and widths shrunk: 60 -> 1 dual-stream block,
# 24 heads of 128 -> 2 of 8 (rope axes [16, 56, 56] -> [2, 2, 4], summing to the head width),
# in_channels 64 (16 latent channels packed 2x2) -> 16 (4 channels), out_channels 16 -> 4, Qwen2.5-VL
# text 3584 -> 16 features; patch_size 2 and no guidance embedding as there.
TINY_QWEN_IMAGE = {
    "patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 1,
    "attention_head_dim": 8, "num_attention_heads": 2, "joint_attention_dim": 16,
    "guidance_embeds": False, "axes_dims_rope": [2, 2, 4],
}  # fmt: skip
# Qwen/Qwen-Image's scheduler_config.json (shift_terminal left out: our schedule ends at σ = 0)
QWEN_SCHEDULER = {"base_image_seq_len": 256, "max_image_seq_len": 8192, "base_shift": 0.5,
                  "max_shift": 0.9, "shift": 1.0, "use_dynamic_shifting": True,
                  "time_shift_type": "exponential"}  # fmt: skip
SHAPE = (4, 8, 8)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen_image")
    QwenImageTransformer2DModel(**TINY_QWEN_IMAGE).save_pretrained(path)
    return path


def _pipeline_pack(x):
    from diffusers import QwenImagePipeline

    b, c, h, w = x.shape
    return QwenImagePipeline._pack_latents(x, b, c, h, w)


def test_packing_shapes_and_shift_match_qwen_image_pipeline():
    from diffusers import QwenImagePipeline
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    x = torch.randn(2, 4, 6, 8)
    packed = pack_flux_latents(x)
    assert torch.equal(packed, _pipeline_pack(x))
    assert torch.equal(unpack_flux_latents(packed, 6, 8), x)
    # vae_scale_factor 1: the pipeline's pixel height is our latent height; it adds a frame axis
    assert torch.equal(QwenImagePipeline._unpack_latents(packed, 6, 8, 1)[:, :, 0], x)
    # the pipeline's img_shapes with vae_scale_factor 1
    assert qwen_image_shapes(2, 6, 8) == [[(1, 6 // 1 // 2, 8 // 1 // 2)]] * 2
    bounds = (256, 8192, 0.5, 0.9)
    for tokens in (16, 256, 1024, 4096, 8192):
        mu = calculate_shift(tokens, *bounds)
        assert flux_shift(tokens, **QWEN_IMAGE_SHIFT) == pytest.approx(math.exp(mu))
    # the scheduler's exponential time shift with that μ is our shift of the same grid
    mu = calculate_shift(16, *bounds)
    assert torch.allclose(scheduler_sigmas(QWEN_SCHEDULER, 6, mu), our_sigmas(6, math.exp(mu)))
    assert default_shift("qwen_image", (16, 128, 128), 10) == pytest.approx(
        math.exp(calculate_shift(4096, *bounds))
    )


def test_adapter_calls_the_transformer_as_qwen_image_pipeline_does(qwen_dir):
    torch.set_num_threads(1)
    model = load_diffusers_model(qwen_dir, "qwen_image", SHAPE)
    cond = model.encode(["a cat", "a big brown dog"])
    assert cond["encoder_hidden_states"].shape == (2, 4, 16)
    assert cond["encoder_hidden_states_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    x, sigma = torch.randn(2, *SHAPE), torch.tensor([1.0, 0.4])
    v = model(x, sigma, cond)
    assert v.shape == x.shape and torch.isfinite(v).all()
    with torch.no_grad():
        direct = model.transformer(
            hidden_states=_pipeline_pack(x), timestep=(1000 * sigma) / 1000,
            encoder_hidden_states=cond["encoder_hidden_states"],
            encoder_hidden_states_mask=cond["encoder_hidden_states_mask"],
            img_shapes=[[(1, 4, 4)]] * 2, return_dict=False,
        )[0]  # fmt: skip
        assert torch.allclose(v, unpack_flux_latents(direct, 8, 8), atol=1e-6)
        # the mask is used: what sits under it changes nothing
        noisy = dict(cond, encoder_hidden_states=cond["encoder_hidden_states"] + 5.0
                     * (1 - cond["encoder_hidden_states_mask"][..., None]))  # fmt: skip
        assert torch.allclose(model(x, sigma, noisy), v, atol=1e-6)


def test_the_last_blocks_unused_text_stream_is_frozen(qwen_dir):
    """Every trainable parameter gets a gradient (what DDP and FSDP2 need); the frozen ones are
    exactly those that would not."""
    from diffusers import QwenImageTransformer2DModel

    torch.set_num_threads(1)
    model = load_diffusers_model(qwen_dir, "qwen_image", SHAPE)
    x, cond = torch.randn(2, *SHAPE), model.encode(["a cat", "a dog"])
    model(x, torch.tensor([0.7, 0.3]), cond).square().mean().backward()
    frozen = {n for n, p in model.transformer.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith(("transformer_blocks.0.attn.to_add_out.",
                                        "transformer_blocks.0.txt_mlp.")) for n in frozen)  # fmt: skip
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    raw = QwenImageTransformer2DModel.from_pretrained(str(qwen_dir))
    out = raw(hidden_states=pack_flux_latents(x), timestep=torch.tensor([0.7, 0.3]),
              encoder_hidden_states=cond["encoder_hidden_states"],
              encoder_hidden_states_mask=cond["encoder_hidden_states_mask"],
              img_shapes=[[(1, 4, 4)]] * 2, return_dict=False)[0]  # fmt: skip
    out.square().mean().backward()
    assert {n for n, p in raw.named_parameters() if p.grad is None} == frozen


def test_lora_on_the_unused_text_stream_stays_frozen(qwen_dir):
    """peft makes every adapter trainable; those it puts on the last block's unused text stream
    (``to_add_out`` and ``txt_mlp`` as targets) would never get a gradient, so they stay frozen
    and every trainable adapter gets one."""
    from groupflow.diffusion.build import lora_adapters

    torch.set_num_threads(1)
    model = load_diffusers_model(qwen_dir, "qwen_image", SHAPE)
    lora_adapters(model, {"rank": 2, "alpha": 4, "target_modules": ["to_add_out", "to_out.0"]})
    last = "transformer_blocks.0.attn.to_add_out."
    adapters = {n: p for n, p in model.transformer.named_parameters() if "lora_" in n}
    assert any(n.startswith(last) for n in adapters) and any(
        not n.startswith(last) for n in adapters
    )
    assert all(p.requires_grad == (not n.startswith(last)) for n, p in adapters.items())
    x, cond = torch.randn(2, *SHAPE), model.encode(["a cat", "a dog"])
    model(x, torch.tensor([0.7, 0.3]), cond).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_sde_logprob_is_the_flow_grpo_formula_and_groups_share_noise(qwen_dir):
    torch.set_num_threads(1)
    model = load_diffusers_model(qwen_dir, "qwen_image", SHAPE)
    check_sde_logprob(model, SHAPE, default_shift("qwen_image", SHAPE, 3))


def test_bad_qwen_image_input_names_the_key(qwen_dir, tmp_path):
    with pytest.raises(ValueError, match=r"packed 2x2 patches of 4 latent channels .* not 16"):
        load_diffusers_model(qwen_dir, "qwen_image", (16, 8, 8))
    with pytest.raises(ValueError, match="width 7 is not divisible by Qwen-Image's 2x2 packing"):
        load_diffusers_model(qwen_dir, "qwen_image", (4, 8, 7))
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
    with pytest.raises(ValueError, match="holds a FluxTransformer2DModel, but diffusion.model.kind "
                       "'qwen_image' takes a QwenImageTransformer2DModel"):  # fmt: skip
        load_diffusers_model(tmp_path, "qwen_image", SHAPE)


def test_one_grpo_step_and_an_exact_resume(qwen_dir, tmp_path):
    check_grpo_step_and_resume("qwen_image", qwen_dir, SHAPE, tmp_path)


def test_nft_awm_and_flow_dppo_train_it(qwen_dir, tmp_path):
    check_objectives_train("qwen_image", qwen_dir, SHAPE, tmp_path)


def test_qwen_image_config_shift_and_guidance(qwen_dir):
    from groupflow.config import ConfigError, config_from_dict
    from groupflow.policies.diffusion import resolve_shift

    def cfg(model=None, **diffusion):
        model = {"kind": "qwen_image", "path": str(qwen_dir), "latent_shape": [4, 8, 8],
                 **(model or {})}  # fmt: skip
        return config_from_dict({"diffusion": {"model": model, **diffusion},
                                 "data": {"train_files": ["p.jsonl"]}})  # fmt: skip

    assert resolve_shift(cfg().diffusion) == pytest.approx(flux_shift(16, **QWEN_IMAGE_SHIFT))
    assert resolve_shift(cfg(shift=2.0).diffusion) == 2.0
    with pytest.raises(
        ConfigError, match="guidance is for kind 'flux' or 'flux2', not 'qwen_image'"
    ):
        cfg({"guidance": 5.0})


def test_a_pipeline_folder_loads_its_transformer(qwen_dir, tmp_path):
    """A Hub snapshot of Qwen/Qwen-Image is a whole pipeline: model_index.json and a folder per
    part; diffusion.model.path may name it, and the transformer/ folder is what loads (also the
    sharded weight reader's path, FlowModelSpec.path)."""
    import shutil

    from groupflow.policies.diffusion import FlowModelSpec

    shutil.copytree(qwen_dir, tmp_path / "transformer")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    model = load_diffusers_model(tmp_path, "qwen_image", SHAPE)
    assert type(model.transformer).__name__ == "QwenImageTransformer2DModel"
    assert FlowModelSpec("qwen_image", str(tmp_path), list(SHAPE)).path == str(
        tmp_path / "transformer"
    )
