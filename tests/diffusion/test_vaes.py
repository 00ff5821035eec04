"""The image kinds' VAE decoders (groupflow.diffusion.vaes) against their diffusers pipelines.

Each tiny random VAE is built in its class (the pipeline's VAE class, widths shrunk, SD3's and
FLUX.1's scaling/shift factors, random latents_mean/std and FLUX.2 batch-norm statistics so the
un-normalisation is visible), saved as a ``vae/`` folder, and decoded two ways on the same
policy latent: our decoder, and the pipeline object built with only that VAE — its own packing /
unpacking helpers, the lines of its ``__call__`` between the last step and ``postprocess``
(which read ``pipe.vae``), and its ``image_processor.postprocess(output_type="pt")``."""

import pytest
import torch

from groupflow.policies.diffusion import FlowModelSpec

pytestmark = pytest.mark.slow  # importing diffusers takes 10-20 s on a shared CPU

# latent channels as in the kinds' tiny transformers (tests/diffusion/test_<kind>.py): 4, and
# FLUX.2's 4 VAE channels patchified 2x2 into 16
SHAPES = {
    "sd3": (4, 8, 8),
    "flux": (4, 8, 8),
    "z_image": (4, 8, 8),
    "qwen_image": (4, 8, 8),
    "flux2": (16, 4, 4),
}
KL = {"down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2,
      "block_out_channels": [8, 8], "layers_per_block": 1, "latent_channels": 4,
      "norm_num_groups": 4}  # fmt: skip


def _save_vaes(root):
    from diffusers import AutoencoderKL, AutoencoderKLFlux2, AutoencoderKLQwenImage

    torch.manual_seed(0)
    # FLUX.1-dev's (and Z-Image's) vae/config.json factors
    AutoencoderKL(**KL, scaling_factor=0.3611, shift_factor=0.1159).save_pretrained(root / "kl")
    # SD3's (stabilityai/stable-diffusion-3.5-medium vae/config.json)
    AutoencoderKL(**KL, scaling_factor=1.5305, shift_factor=0.0609).save_pretrained(root / "sd3")
    AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
        latents_mean=[0.1 * i - 0.2 for i in range(4)], latents_std=[1.0 + 0.5 * i for i in range(4)],
    ).save_pretrained(root / "qwen")  # fmt: skip
    flux2 = AutoencoderKLFlux2(**KL)
    flux2.bn.running_mean.copy_(torch.randn(16))
    flux2.bn.running_var.copy_(torch.rand(16) + 0.5)
    flux2.save_pretrained(root / "flux2")
    return {"sd3": root / "sd3", "flux": root / "kl", "z_image": root / "kl", "qwen_image": root / "qwen",
            "flux2": root / "flux2"}  # fmt: skip


@pytest.fixture(scope="module")
def vaes(tmp_path_factory):
    return _save_vaes(tmp_path_factory.mktemp("vaes"))


def _flux_pipeline_decode(path, x):
    from diffusers import AutoencoderKL, FluxPipeline

    pipe = FluxPipeline(None, AutoencoderKL.from_pretrained(path), None, None, None, None, None)
    b, c, h, w = x.shape
    height, width = h * pipe.vae_scale_factor, w * pipe.vae_scale_factor  # pixels
    latents = pipe._pack_latents(x, b, c, h, w)  # the pipeline's sampling state
    # FluxPipeline.__call__ after the loop
    latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
    latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
    image = pipe.vae.decode(latents, return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type="pt")


def _sd3_pipeline_decode(path, x):
    from diffusers import AutoencoderKL, StableDiffusion3Pipeline

    vae = AutoencoderKL.from_pretrained(path)
    pipe = StableDiffusion3Pipeline(None, None, vae, None, None, None, None, None, None)
    latents = x  # StableDiffusion3Pipeline.__call__ after the loop
    latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
    image = pipe.vae.decode(latents, return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type="pt")


def _z_image_pipeline_decode(path, x):
    from diffusers import AutoencoderKL, ZImagePipeline

    pipe = ZImagePipeline(None, AutoencoderKL.from_pretrained(path), None, None, None)
    latents = x.to(pipe.vae.dtype)  # ZImagePipeline.__call__ after the loop
    latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
    image = pipe.vae.decode(latents, return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type="pt")


def _qwen_image_pipeline_decode(path, x):
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline

    pipe = QwenImagePipeline(None, AutoencoderKLQwenImage.from_pretrained(path), None, None, None)
    b, c, h, w = x.shape
    height, width = h * pipe.vae_scale_factor, w * pipe.vae_scale_factor
    latents = pipe._pack_latents(x, b, c, h, w)
    # QwenImagePipeline.__call__ after the loop
    latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
    latents = latents.to(pipe.vae.dtype)
    z = pipe.vae.config.z_dim
    latents_mean = torch.tensor(pipe.vae.config.latents_mean).view(1, z, 1, 1, 1)
    latents_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, z, 1, 1, 1)
    latents = latents / latents_std + latents_mean
    image = pipe.vae.decode(latents, return_dict=False)[0][:, :, 0]
    return pipe.image_processor.postprocess(image, output_type="pt")


def _flux2_pipeline_decode(path, x):
    from diffusers import AutoencoderKLFlux2, Flux2Pipeline

    pipe = Flux2Pipeline(None, AutoencoderKLFlux2.from_pretrained(path), None, None, None)
    latent_ids = pipe._prepare_latent_ids(x)
    latents = pipe._pack_latents(x)  # the sampling state: tokens of the patchified latent
    # Flux2Pipeline.__call__ after the loop
    latents = pipe._unpack_latents_with_ids(latents, latent_ids)
    latents_bn_mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
    latents_bn_std = torch.sqrt(
        pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps
    )
    latents = latents * latents_bn_std + latents_bn_mean
    latents = pipe._unpatchify_latents(latents)
    image = pipe.vae.decode(latents, return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type="pt")


PIPELINE_DECODE = {
    "sd3": _sd3_pipeline_decode,
    "flux": _flux_pipeline_decode,
    "z_image": _z_image_pipeline_decode,
    "qwen_image": _qwen_image_pipeline_decode,
    "flux2": _flux2_pipeline_decode,
}
PIXELS = 16  # the tiny VAEs upsample 2x; FLUX.2's latent is 2x2-patchified on top


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_decoders_match_the_pipelines_decode(vaes, kind):
    from groupflow.diffusion.vaes import load_vae_decoder

    torch.set_num_threads(1)
    torch.manual_seed(1)
    x = torch.randn(2, *SHAPES[kind])
    ours = load_vae_decoder(kind, vaes[kind])(x)
    with torch.no_grad():
        want = PIPELINE_DECODE[kind](vaes[kind], x)
    assert ours.shape == (2, 3, PIXELS, PIXELS)
    assert torch.allclose(ours, want, atol=1e-5), (ours - want).abs().max()
    assert float(ours.min()) >= 0 and float(ours.max()) <= 1


def _transformer_dirs(root):
    from diffusers import (
        Flux2Transformer2DModel,
        FluxTransformer2DModel,
        QwenImageTransformer2DModel,
        ZImageTransformer2DModel,
    )

    from tests.diffusion.test_flux import TINY_FLUX
    from tests.diffusion.test_flux2 import TINY_FLUX2
    from tests.diffusion.test_models import _sd3
    from tests.diffusion.test_qwen_image import TINY_QWEN_IMAGE
    from tests.diffusion.test_z_image import TINY_Z_IMAGE

    torch.manual_seed(0)
    built = {"flux": FluxTransformer2DModel(**TINY_FLUX),
             "z_image": ZImageTransformer2DModel(**TINY_Z_IMAGE),
             "qwen_image": QwenImageTransformer2DModel(**TINY_QWEN_IMAGE),
             "flux2": Flux2Transformer2DModel(**TINY_FLUX2)}  # fmt: skip
    for kind, model in built.items():
        model.save_pretrained(root / kind)
    return {"sd3": _sd3(root), **{kind: root / kind for kind in built}}


@pytest.fixture(scope="module")
def transformers_(tmp_path_factory):
    return _transformer_dirs(tmp_path_factory.mktemp("transformers"))


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_vae_path_gives_the_flow_model_its_decoder(vaes, transformers_, kind):
    torch.set_num_threads(1)
    parts = {"vae_path": str(vaes[kind])}
    model = FlowModelSpec(kind, str(transformers_[kind]), list(SHAPES[kind]), parts).build()
    x = torch.randn(1, *SHAPES[kind])
    with torch.no_grad():
        assert torch.allclose(model.decode(x), PIPELINE_DECODE[kind](vaes[kind], x), atol=1e-5)


def test_a_vae_of_another_class_or_width_names_the_key(vaes, transformers_, tmp_path):
    from diffusers import AutoencoderKL

    from groupflow.diffusion.models import ModelPathError

    def build(kind, vae):
        parts = {"vae_path": str(vae)}
        FlowModelSpec(kind, str(transformers_[kind]), list(SHAPES[kind]), parts).build()

    with pytest.raises(ValueError, match="vae_path: .* holds a AutoencoderKLQwenImage, but "
                       "diffusion.model.kind 'flux' decodes with a AutoencoderKL"):  # fmt: skip
        build("flux", vaes["qwen_image"])
    with pytest.raises(ValueError, match="holds a AutoencoderKL, but .*'flux2' decodes with a "
                       "AutoencoderKLFlux2"):  # fmt: skip
        build("flux2", vaes["flux"])
    AutoencoderKL(**{**KL, "latent_channels": 8}).save_pretrained(tmp_path / "wide")
    with pytest.raises(ValueError, match="vae_path: the VAE decodes 8-channel latents; .* has 4"):
        build("z_image", tmp_path / "wide")
    with pytest.raises(
        ModelPathError, match="diffusion.model.vae_path: .* is not a local AutoencoderKLFlux2"
    ):
        build("flux2", tmp_path / "missing")


def _trainer_config(tmp_path, kind, model_dir, vae):
    from tests.diffusion.kind_checks import diffusion_config

    return diffusion_config(kind, model_dir, SHAPES[kind], tmp_path, name="vae", steps=1,
                            model={"vae_path": str(vae)})  # fmt: skip


def test_a_grpo_step_scores_the_decoded_images_and_a_wrong_vae_fails_before_the_workers(
    vaes, transformers_, tmp_path
):
    import math

    from groupflow.run.tracking import read_metrics
    from groupflow.trainer import Trainer

    torch.set_num_threads(1)
    with pytest.raises(ValueError, match="holds a AutoencoderKLQwenImage, but .*'flux' decodes"):
        Trainer(
            _trainer_config(tmp_path / "bad", "flux", transformers_["flux"], vaes["qwen_image"])
        )
    trainer = Trainer(_trainer_config(tmp_path, "flux", transformers_["flux"], vaes["flux"]))
    trainer.fit()
    rows = [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if "actor/loss" in r]
    assert len(rows) == 1 and math.isfinite(rows[0]["actor/loss"])
    assert 0 < rows[0]["reward/mean"] < 1  # the brightness of decoded [0, 1] images


def test_an_sd3_grpo_step_conditions_on_its_text_encoders_and_scores_decoded_images(
    vaes, transformers_, tmp_path
):
    import math

    from groupflow.run.tracking import read_metrics
    from groupflow.trainer import Trainer
    from tests.diffusion.kind_checks import diffusion_config
    from tests.diffusion.test_text_encoders import sd3_parts

    torch.set_num_threads(1)
    clip = sd3_parts(tmp_path / "parts")
    model = {"vae_path": str(vaes["sd3"]), "text_encoder_path": str(clip),
             "text_encoder_3_path": str(clip.parent / "text_encoder_3"),
             "max_sequence_length": 8}  # fmt: skip
    cfg = diffusion_config("sd3", transformers_["sd3"], SHAPES["sd3"], tmp_path, name="sd3",
                           steps=1, model=model)  # fmt: skip
    trainer = Trainer(cfg)
    trainer.fit()
    rows = [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if "actor/loss" in r]
    assert len(rows) == 1 and math.isfinite(rows[0]["actor/loss"])
    assert rows[0]["actor/grad_norm"] > 0 and 0 < rows[0]["reward/mean"] < 1
