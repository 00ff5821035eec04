"""Ulysses sequence parallelism of tiny Wan (video) and SD3 (image; also SD3.5's dual attention
and q/k norms) transformers on two gloo ranks (torch.multiprocessing, one torch thread each): the
velocity, a loss and every parameter gradient equal the single-process transformer's, with and
without activation checkpointing; the inputs it
cannot split are refused with the key named; and through the whole driver on Ray, 2 workers as one
sequence-parallel group of 2 (FSDP2-sharded, with a KL to the reference) train like 1 worker.
"""

from __future__ import annotations

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
    "wan": {"kind": "wan"},
    "wan_checkpointed": {"kind": "wan", "checkpointing": True},
    "sd3": {"kind": "sd3"},
    "sd35_dual_attention_qk_norm": {"kind": "sd3", "sd35": True},
}


def _model(kind: str, checkpointing: bool = False, sd35: bool = False):
    from diffusers import SD3Transformer2DModel, WanTransformer3DModel

    torch.manual_seed(0)
    if kind == "wan":
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=16, ffn_dim=24, num_layers=2,
            rope_max_seq_len=32,
        )  # fmt: skip
    else:
        extra = {"dual_attention_layers": (0,), "qk_norm": "rms_norm"} if sd35 else {}
        model = SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
            caption_projection_dim=16, pooled_projection_dim=8, pos_embed_max_size=8, **extra,
        )  # fmt: skip
    if checkpointing:
        model.enable_gradient_checkpointing()
    return model.train()


def _wan(checkpointing: bool = False):
    return _model("wan", checkpointing)


def _inputs(kind: str):
    """Two latents — Wan videos [4, 3, 8, 8] (3 × 4 × 4 = 48 tokens), SD3 images [4, 8, 8]
    (16 tokens) — timesteps, text embeddings (SD3: pooled ones too) and loss weights."""
    g = torch.Generator().manual_seed(1)
    shape = (2, 4, 3, 8, 8) if kind == "wan" else (2, 4, 8, 8)
    kw = {"hidden_states": torch.randn(*shape, generator=g),
          "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
          "timestep": torch.tensor([250.0, 700.0])}  # fmt: skip
    if kind == "sd3":
        kw["pooled_projections"] = torch.randn(2, 8, generator=g)
    return kw, torch.randn(*shape, generator=g)


def _step(model, kind: str) -> dict:
    kw, weights = _inputs(kind)
    return step(model, model(**kw, return_dict=False)[0], weights)


def _steps(sp: SequenceGroup | None) -> dict:
    """Each variant's step, sequence-parallel over ``sp`` (None: the single process)."""
    from groupflow.diffusion.sequence_parallel import enable_ulysses

    def build(kw):
        model = _model(**kw)
        return model if sp is None else enable_ulysses(model, sp)

    return {name: _step(build(kw), kw["kind"]) for name, kw in VARIANTS.items()}


@pytest.mark.slow  # two processes importing torch and diffusers
def test_two_sequence_parallel_ranks_equal_one_wan_and_one_sd3_transformer(tmp_path):
    check_two_ranks_equal_one(_steps, tmp_path)


def test_a_token_count_or_heads_that_do_not_split_are_refused():
    from groupflow.diffusion.sequence_parallel import enable_ulysses

    three = SequenceGroup(group=None, size=3, rank=0)  # nothing is exchanged before the checks
    with pytest.raises(ValueError, match="must divide the transformer's 2 heads"):
        enable_ulysses(_wan(), three)
    two = SequenceGroup(group=None, size=2, rank=0)
    model = enable_ulysses(_wan(), two)
    x = torch.randn(1, 4, 3, 6, 6)  # 3 × 3 × 3 = 27 tokens
    with pytest.raises(ValueError, match="27 tokens .* do not split evenly over 2 ranks"):
        model(x, timestep=torch.tensor([1.0]), encoder_hidden_states=torch.randn(1, 5, 16))
    with pytest.raises(
        ValueError, match="implemented for the Wan, SD3, FLUX.1, FLUX.2, Qwen-Image and Z-Image"
    ):
        enable_ulysses(torch.nn.Linear(2, 2), two)


@pytest.fixture(scope="module")
def wan_setup(tmp_path_factory):
    import json

    from tests.diffusion.test_mmdancegrpo import _tiny_wan

    root = tmp_path_factory.mktemp("sp")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a cat", "a dog")))
    return _tiny_wan(root / "wan"), prompts


@pytest.mark.slow  # Ray start-up and diffusers' import dominate; the model is tiny
def test_two_ray_workers_as_one_sequence_parallel_group_equal_one_worker(wan_setup, tmp_path):
    pytest.importorskip("ray")
    from tests.diffusion.test_fsdp import _cfg

    model, prompts = wan_setup
    kl = {"actor.kl_coef": 0.01}
    check_ray_group_equals_one_worker(
        _cfg(tmp_path, model, prompts, **kl), _cfg(tmp_path, model, prompts, **kl, **SP_RAY),
        atol=1e-6,
    )  # fmt: skip


def _sp_config(kind: str):
    from groupflow.config import config_from_dict

    return config_from_dict({
        "run": {"backend": "ray", "num_workers": 2}, "parallel": {"sequence_parallel": 2},
        "diffusion": {"model": {"kind": kind, "path": "m", "latent_shape": [4, 8, 8]}},
        "data": {"train_files": ["p.jsonl"]},
    })  # fmt: skip


def test_sequence_parallel_is_refused_for_the_kinds_without_it():
    from groupflow.config import ConfigError

    with pytest.raises(ConfigError, match="sequence_parallel .* not diffusion.model.kind 'tiny'"):
        _sp_config("tiny")


@pytest.mark.parametrize("kind", ["flux", "flux2", "qwen_image", "z_image"])
def test_sequence_parallel_loads_for_the_joint_attention_kinds(kind):
    assert _sp_config(kind).parallel.sequence_parallel == 2
