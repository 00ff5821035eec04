"""A diffusers pipeline named by Hub id (diffusion.model.path = its snapshot in the HF cache):
its text encoders, tokenizers and VAE are named by the pipeline's own folders (``text_encoder``,
``vae``), or by Hub ids of their own, or by local paths; all resolved before anything is built
(``assembly.models.resolve_hub_models``), offline, against a cache the test builds."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from groupflow.assembly.models import resolve_hub_models
from groupflow.config import load_config
from groupflow.policies.diffusion import FlowModelSpec, parts_of
from tests.diffusion.test_flux import SHAPE, TINY_FLUX
from tests.diffusion.test_text_encoders import flux_parts
from tests.utils.test_hub import MAIN, V2, _snapshot

pytestmark = pytest.mark.slow  # imports diffusers and transformers


def _flux_pipeline(snap):
    """A FLUX.1 pipeline snapshot: model_index.json, transformer/, the CLIP and T5 encoders with
    their tokenizers (text_encoder/, tokenizer/, text_encoder_2/, tokenizer_2/)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    FluxTransformer2DModel(**TINY_FLUX).save_pretrained(snap / "transformer")
    flux_parts(snap)
    (snap / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))


def _cfg(tmp_path, **model):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a cat"}) + "\n")
    return load_config(None, {
        "run": {"name": "t", "output_dir": str(tmp_path), "total_steps": 1, "loggers": []},
        "diffusion": {"model": {"kind": "flux", "latent_shape": list(SHAPE), **model}},
        "data": {"train_files": [str(prompts)], "prompts_per_step": 1},
        "reward": {"functions": [{"name": "brightness"}]},
    })  # fmt: skip


def test_a_hub_pipelines_parts_are_its_folders_or_hub_ids_of_their_own(hf_home, tmp_path):
    snap = _snapshot(hf_home, "acme/flux-pipe", MAIN)
    _flux_pipeline(snap)
    t5_repo = _snapshot(hf_home, "acme/t5", V2)  # a T5 of its own repository
    flux_parts(tmp_path / "other")
    shutil.copytree(tmp_path / "other" / "text_encoder_2", t5_repo, dirs_exist_ok=True)
    cfg = _cfg(tmp_path, path="acme/flux-pipe", text_encoder_path="text_encoder",
               text_encoder_2_path="acme/t5", tokenizer_2_path="tokenizer_2")  # fmt: skip
    built = resolve_hub_models(cfg)
    m = built.diffusion.model
    assert m.path == str(snap) and cfg.diffusion.model.path == "acme/flux-pipe"
    assert m.text_encoder_path == str(snap / "text_encoder")
    assert m.text_encoder_2_path == str(t5_repo)  # its own repository, its own snapshot
    assert m.tokenizer_2_path == str(snap / "tokenizer_2")
    assert cfg.diffusion.model.text_encoder_path == "text_encoder"  # the logged config keeps it
    # and they load: the pipeline's CLIP and this repository's T5 encode a prompt
    spec = FlowModelSpec("flux", m.path, list(SHAPE), parts_of(m))
    cond = spec.build().encode(["a cat"])
    assert cond["encoder_hidden_states"].shape[-1] == 16 and cond["pooled_projections"].shape == (
        1,
        8,
    )


def test_a_local_path_wins_and_an_unknown_part_is_named(hf_home, tmp_path, monkeypatch):
    snap = _snapshot(hf_home, "acme/flux-pipe", MAIN)
    _flux_pipeline(snap)
    mine = flux_parts(tmp_path / "mine")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text_encoder").mkdir()  # a local folder of the pipeline's part name wins
    built = resolve_hub_models(_cfg(tmp_path, path="acme/flux-pipe", text_encoder_path=str(mine),
                                    vae_path="text_encoder"))  # fmt: skip
    assert built.diffusion.model.text_encoder_path == str(mine)
    assert built.diffusion.model.vae_path == "text_encoder"
    with pytest.raises(
        ValueError,
        match="diffusion.model.vae_path: 'acme/no-vae' is neither a "
        "local directory nor in the Hugging Face cache",
    ):
        resolve_hub_models(_cfg(tmp_path, path="acme/flux-pipe", vae_path="acme/no-vae"))
    # a name that is no local folder, no folder of the pipeline (it has no vae/) and no Hub id
    with pytest.raises(ValueError, match=(
        "diffusion.model.vae_path: 'vae' is neither a local directory nor a folder of the "
        f"pipeline at '{snap}' nor a Hub id")):  # fmt: skip
        resolve_hub_models(_cfg(tmp_path, path="acme/flux-pipe", vae_path="vae"))
