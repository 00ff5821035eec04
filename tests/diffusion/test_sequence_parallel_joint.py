"""Ulysses sequence parallelism of the tiny random-weight FLUX.1, FLUX.2, Qwen-Image and Z-Image
transformers the kinds' tests build (one double- and one single-stream block for the FLUX
kinds; Qwen-Image with a padded text mask; Z-Image with captions of 40 and 5 tokens, so padded
to 64 and 32 and masked per sample in its unified sequence, and its image tokens padded to 32
or not), called as groupflow calls them
(``groupflow.diffusion.kinds.KIND_CALLS``), on two gloo ranks (torch.multiprocessing, one torch
thread each): the velocity, a loss and every parameter gradient equal the single-process
transformer's, with and without activation checkpointing; token counts and heads the group does
not divide are refused with the key named; a copy of a sequence-parallel model (the worker's
reference and NFT old copies) runs alike; and through the whole driver on Ray, 2 workers as one
sequence-parallel group of 2 (FSDP2-sharded, LoRA, a KL to the reference) train like 1 worker.
"""

from __future__ import annotations

import copy

import pytest
import torch

from groupflow.distributed.ulysses import SequenceGroup
from tests.diffusion.sp_checks import (
    SP_RAY,
    check_ray_group_equals_one_worker,
    check_two_ranks_equal_one,
    step,
)

pytest.importorskip("diffusers")

VARIANTS = {
    "flux": {"kind": "flux"},
    "flux_checkpointed": {"kind": "flux", "checkpointing": True},
    "flux2": {"kind": "flux2"},
    "flux2_checkpointed": {"kind": "flux2", "checkpointing": True},
    "flux2_copied": {"kind": "flux2", "copied": True},  # the worker copies it (reference, old)
    "qwen_image": {"kind": "qwen_image"},
    "qwen_image_checkpointed": {"kind": "qwen_image", "checkpointing": True},
    "z_image": {"kind": "z_image"},  # 16 image tokens, padded to 32
    "z_image_checkpointed": {"kind": "z_image", "checkpointing": True},
    "z_image_unpadded": {"kind": "z_image", "shape": (4, 8, 16)},  # 32 image tokens
    "z_image_copied": {"kind": "z_image", "copied": True},
}
# latents of 16 image tokens: FLUX.1 and Qwen-Image pack 2x2 patches of [4, 8, 8], FLUX.2's
# latent is already patchified
SHAPES = {"flux": (4, 8, 8), "flux2": (16, 4, 4), "qwen_image": (4, 8, 8), "z_image": (4, 8, 8)}


def _model(kind: str, checkpointing: bool = False, copied: bool = False, shape=None, **config):
    from diffusers import (
        Flux2Transformer2DModel,
        FluxTransformer2DModel,
        QwenImageTransformer2DModel,
        ZImageTransformer2DModel,
    )

    from tests.diffusion.test_flux import TINY_FLUX
    from tests.diffusion.test_flux2 import TINY_FLUX2
    from tests.diffusion.test_qwen_image import TINY_QWEN_IMAGE
    from tests.diffusion.test_z_image import TINY_Z_IMAGE

    torch.manual_seed(0)
    build = {"flux": (FluxTransformer2DModel, TINY_FLUX),
             "flux2": (Flux2Transformer2DModel, TINY_FLUX2),
             "qwen_image": (QwenImageTransformer2DModel, TINY_QWEN_IMAGE),
             "z_image": (ZImageTransformer2DModel, TINY_Z_IMAGE)}[kind]  # fmt: skip
    model = build[0](**{**build[1], **config})
    if checkpointing:
        model.enable_gradient_checkpointing()
    return model.train()


def _inputs(kind: str, shape=None, text: int = 5):
    """Two latents, σ, the text condition (FLUX.1: pooled too; Qwen-Image: a mask with the
    second prompt padded; Z-Image: captions of 40 and 5 tokens) and loss weights."""
    g = torch.Generator().manual_seed(1)
    shape = shape or SHAPES[kind]
    text = 40 if kind == "z_image" else text
    cond = {"encoder_hidden_states": torch.randn(2, text, 16, generator=g)}
    if kind == "flux":
        cond["pooled_projections"] = torch.randn(2, 8, generator=g)
    if kind == "qwen_image":
        cond["encoder_hidden_states_mask"] = torch.tensor([[1] * text, [1] * (text - 2) + [0, 0]])
    if kind == "z_image":  # padded to 64 and 32: a per-sample mask over the unified sequence
        cond["encoder_hidden_states_mask"] = torch.tensor([[1] * text, [1] * 5 + [0] * (text - 5)])
    x = torch.randn(2, *shape, generator=g)
    return x, torch.tensor([0.25, 0.7]), cond, torch.randn(2, *shape, generator=g)


def _velocity(model, kind: str, x, sigma, cond):
    from groupflow.diffusion.kinds import KIND_CALLS

    return KIND_CALLS[kind](model, x, sigma, cond, 3.5)


def _step(model, kind: str, shape=None) -> dict:
    x, sigma, cond, weights = _inputs(kind, shape)
    return step(model, _velocity(model, kind, x, sigma, cond), weights)


def _steps(sp: SequenceGroup | None) -> dict:
    """Each variant's step, sequence-parallel over ``sp`` (None: the single process); a copied
    variant steps a deep copy of the (sequence-parallel) model."""
    from groupflow.diffusion.sequence_parallel import enable_ulysses

    results = {}
    for name, kw in VARIANTS.items():
        model = _model(**kw)
        model = model if sp is None else enable_ulysses(model, sp)
        model = copy.deepcopy(model) if kw.get("copied") and sp is not None else model
        results[name] = _step(model, kw["kind"], kw.get("shape"))
    return results


@pytest.mark.slow  # two processes importing torch and diffusers
def test_two_sequence_parallel_ranks_equal_one_flux_flux2_qwen_image_and_z_image_transformer(
    tmp_path,
):
    torch.set_num_threads(1)
    check_two_ranks_equal_one(_steps, tmp_path)


@pytest.mark.slow  # importing diffusers
@pytest.mark.parametrize("kind", ["flux", "flux2", "qwen_image"])
def test_a_token_count_or_heads_that_do_not_split_are_refused(kind):
    from groupflow.diffusion.sequence_parallel import enable_ulysses

    torch.set_num_threads(1)
    three = SequenceGroup(group=None, size=3, rank=0)  # nothing is exchanged before the checks
    with pytest.raises(
        ValueError, match="sequence_parallel=3 must divide the transformer's 2 heads"
    ):
        enable_ulysses(_model(kind), three)
    model = enable_ulysses(_model(kind), SequenceGroup(group=None, size=2, rank=0))
    shape = {"flux2": (16, 3, 3)}.get(kind, (4, 6, 6))  # 3 x 3 = 9 image tokens
    x, sigma, cond, _ = _inputs(kind, shape)
    with pytest.raises(
        ValueError, match=r"sequence_parallel=2: the .* image part has 9 tokens.* 2 ranks"
    ):
        _velocity(model, kind, x, sigma, cond)


@pytest.mark.slow  # Ray start-up and diffusers' import dominate; the models are tiny
@pytest.mark.parametrize("kind", ["flux", "flux2", "qwen_image", "z_image"])
def test_two_ray_workers_as_one_sequence_parallel_group_equal_one_worker(kind, tmp_path):
    """Through the whole driver: FSDP2-sharded, LoRA, a KL to the reference copy; 2 workers as
    one group of 2 take the same steps as 1 worker."""
    pytest.importorskip("ray")
    import json

    from tests.diffusion.test_fsdp import _cfg

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a cat", "a dog")))
    model = tmp_path / kind
    _model(kind).save_pretrained(model)
    over = {"diffusion.model.kind": kind, "diffusion.model.path": str(model),
            "diffusion.model.latent_shape": list(SHAPES[kind]), "actor.kl_coef": 0.01,
            "diffusion.model.lora": {"rank": 2, "target_modules": ["to_q", "to_k", "to_v"]}}  # fmt: skip
    check_ray_group_equals_one_worker(
        _cfg(tmp_path, model, prompts, **over), _cfg(tmp_path, model, prompts, **over, **SP_RAY),
        atol=1e-5, only="lora_",
    )  # fmt: skip


@pytest.mark.slow  # importing diffusers
def test_z_image_heads_image_tokens_omni_mode_and_controlnet_that_do_not_split_are_refused():
    from groupflow.diffusion.sequence_parallel import enable_ulysses

    torch.set_num_threads(1)
    three = SequenceGroup(group=None, size=3, rank=0)  # nothing is exchanged before the checks
    with pytest.raises(
        ValueError, match="sequence_parallel=3 must divide the transformer's 2 heads"
    ):
        enable_ulysses(_model("z_image"), three)
    # 3 heads (of 8 dims: the rotary axes'), 16 image tokens padded to 32
    model = enable_ulysses(_model("z_image", dim=24, n_heads=3, n_kv_heads=3), three)
    x, sigma, cond, _ = _inputs("z_image")
    with pytest.raises(ValueError, match=r"sequence_parallel=3: the z_image .* 32 image tokens"):
        _velocity(model, "z_image", x, sigma, cond)
    model = enable_ulysses(_model("z_image"), SequenceGroup(group=None, size=2, rank=0))
    caption = [torch.randn(5, 16)]
    with pytest.raises(ValueError, match="sequence_parallel: Z-Image's omni mode"):
        model([[x[0, :, None]]], sigma[:1], [caption], return_dict=False)
    with pytest.raises(ValueError, match="sequence_parallel: Z-Image's ControlNet"):
        model([x[0, :, None]], sigma[:1], caption, controlnet_block_samples={0: x})
