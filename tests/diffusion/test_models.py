import pytest
import torch

from groupflow.diffusion.models import (
    DiffusersFlowModel,
    HashPromptEncoder,
    ModelPathError,
    TinyFlowModel,
    UnknownPromptError,
    load_diffusers_model,
    load_tiny_model,
    save_tiny_model,
)
from groupflow.diffusion.samplers import sample_trajectory
from groupflow.diffusion.schedule import sigma_schedule


def _tiny(**kw):
    torch.manual_seed(0)
    return TinyFlowModel(["red", "blue"], image_size=8, width=8, **kw)


def test_tiny_model_velocity_shape_and_conditions():
    m = _tiny()
    cond = m.encode(["blue", "red", "blue"])
    assert cond["labels"].tolist() == [1, 0, 1]
    assert m.null_cond(2)["labels"].tolist() == [2, 2]
    v = m(torch.randn(3, 3, 8, 8), torch.rand(3), cond)
    assert v.shape == (3, 3, 8, 8) and torch.isfinite(v).all()
    # the label matters (otherwise CFG and prompts would be meaningless)
    x, s = torch.randn(1, 3, 8, 8), torch.rand(1)
    assert not torch.allclose(m(x, s, m.encode(["red"])), m(x, s, m.encode(["blue"])))


def test_tiny_model_bad_input():
    m = _tiny()
    with pytest.raises(
        UnknownPromptError, match=r"no label 'green'; its labels are \['red', 'blue'\]"
    ):
        m.encode(["red", "green"])
    with pytest.raises(
        ValueError, match=r"latent shape mismatch: expected \[B, 3, 8, 8\], got \[2, 3, 16, 16\]"
    ):
        m(torch.randn(2, 3, 16, 16), torch.rand(2), m.encode(["red", "red"]))


def test_tiny_model_save_load_round_trip(tmp_path):
    m = _tiny()
    save_tiny_model(m, tmp_path / "m")
    back = load_tiny_model(tmp_path / "m")
    assert back.labels == m.labels and back.latent_shape == m.latent_shape
    x, s, c = torch.randn(2, 3, 8, 8), torch.rand(2), m.encode(["red", "blue"])
    assert torch.equal(back(x, s, c), m(x, s, c))
    with pytest.raises(ModelPathError, match="groupflow pretrain-diffusion"):
        load_tiny_model(tmp_path / "missing")


def _sd3(tmp_path):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    t = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
        caption_projection_dim=16, pooled_projection_dim=8, pos_embed_max_size=8,
    )  # fmt: skip
    t.save_pretrained(tmp_path / "sd3")
    return tmp_path / "sd3"


def _wan(tmp_path):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    t = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=16, num_layers=1, rope_max_seq_len=32,
    )  # fmt: skip
    t.save_pretrained(tmp_path / "wan")
    return tmp_path / "wan"


# Slow only because importing diffusers takes 10-20 s on a shared CPU; the models are tiny.
@pytest.mark.slow
@pytest.mark.parametrize("kind,make,shape", [("sd3", _sd3, (4, 8, 8)), ("wan", _wan, (4, 3, 8, 8))])
def test_diffusers_adapters_sample_with_logprobs(tmp_path, kind, make, shape):
    torch.set_num_threads(1)
    model = load_diffusers_model(make(tmp_path), kind, shape)
    assert isinstance(model, DiffusersFlowModel)
    cond = model.encode(["a cat", "a dog"])
    x = torch.randn(2, *shape)
    v = model(x, torch.tensor([1.0, 0.5]), cond)
    assert v.shape == x.shape and torch.isfinite(v).all()
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    traj = sample_trajectory(
        lambda x, s: model(x, s, cond), x, sigma_schedule(2), "flow_sde", generators=gens
    )
    assert traj.latents.shape == (2, 2, *shape) and torch.isfinite(traj.logprobs).all()
    image = model.decode(traj.final)
    assert image.shape == (2, 3, *shape[1:]) and 0 <= image.min() and image.max() <= 1
    with pytest.raises(ValueError, match="latent shape mismatch"):
        model(torch.randn(2, 4, 2, 8, 8), torch.rand(2), cond)


def test_diffusers_adapter_bad_input(tmp_path):
    with pytest.raises(ModelPathError, match="has no config.json"):
        load_diffusers_model(tmp_path / "nothing", "sd3", (4, 8, 8))
    with pytest.raises(
        ValueError,
        match=r"unknown diffusers model kind 'hunyuan'; valid kinds: \['flux', 'flux2', "
        r"'qwen_image', 'sd3', 'wan', 'z_image'\]",
    ):
        load_diffusers_model(tmp_path, "hunyuan", (4, 8, 8))
    with pytest.raises(ValueError, match=r"a 'wan' latent is \(C, F, H, W\)"):
        DiffusersFlowModel(torch.nn.Identity(), "wan", (4, 8, 8), HashPromptEncoder(4))


def test_hash_prompt_encoder_is_deterministic_and_prompt_specific():
    enc = HashPromptEncoder(6, seq_len=2, pooled_dim=3)
    a, b = enc(["x", "y", "x"]), HashPromptEncoder(6, seq_len=2, pooled_dim=3)(["x"])
    assert a["encoder_hidden_states"].shape == (3, 2, 6) and a["pooled_projections"].shape == (3, 3)
    assert torch.equal(a["encoder_hidden_states"][0], b["encoder_hidden_states"][0])
    assert not torch.equal(a["encoder_hidden_states"][0], a["encoder_hidden_states"][1])
    assert bool((enc.null(2)["encoder_hidden_states"] == 0).all())


@pytest.mark.slow
def test_worker_trains_a_video_transformer(tmp_path):
    from groupflow.algorithms import compute_advantages
    from groupflow.config import ActorConfig
    from groupflow.diffusion.worker import DiffusionSettings, DiffusionWorker, prompt_rows
    from groupflow.workflows.diffusion import save_image_grid

    torch.set_num_threads(1)
    model = load_diffusers_model(_wan(tmp_path), "wan", (4, 3, 8, 8))
    settings = DiffusionSettings(num_steps=2, timestep_fraction=1.0, cfg_scale=2.0)
    w = DiffusionWorker(model, settings, ActorConfig(lr=1e-3, clip_eps_low=1e-4), total_steps=2)
    b = w.generate(prompt_rows(["a cat", "a dog"], [[1, 2], [3, 4]], [0, 1]), 2)
    assert b["latents"].shape == (4, 2, 4, 3, 8, 8) and b["images"].shape == (4, 3, 3, 8, 8)
    b["advantages"] = compute_advantages(b["images"].mean((1, 2, 3, 4)), b["group_ids"], "grpo")
    b["old_logprobs"] = b["rollout_logprobs"]
    inputs = b.select(*[k for k in b.tensors if k not in ("images", "rollout_logprobs")])
    assert torch.equal(w.compute_logprobs(inputs)["logprobs"], b["rollout_logprobs"])
    m = w.update(inputs)
    assert m["actor/ratio_max"] == 1.0 and m["actor/grad_norm"] > 0
    assert save_image_grid(b["images"], 2, tmp_path / "grid.png").is_file()  # first frames
