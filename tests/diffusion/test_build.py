"""What a diffusion worker holds (diffusion.build): LoRA adapters on a meta-built transformer get
exactly peft's init, as on a real model, and survive loading the base weights; CPU offload's
policy and refusals. The 2-worker sharded runs are in test_fsdp.py."""

from __future__ import annotations

import pytest
import torch

from groupflow.diffusion import build
from groupflow.diffusion.models import load_diffusers_model
from groupflow.diffusion.settings import DiffusionSettings
from groupflow.diffusion.sharding import materialise_shards
from tests.diffusion.test_mmdancegrpo import _tiny_wan

SHAPE = (4, 3, 8, 8)
LORA = {"rank": 2, "alpha": 4, "target_modules": ["to_q", "to_v"]}


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return _tiny_wan(tmp_path_factory.mktemp("build") / "wan")


def _adapters(model):
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def test_lora_on_a_meta_built_transformer_gets_peft_s_own_init(wan):
    real = load_diffusers_model(wan, "wan", SHAPE)
    meta = load_diffusers_model(wan, "wan", SHAPE, empty=True)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    build.lora_adapters(real, LORA)
    build.lora_adapters(meta, LORA)
    assert torch.equal(torch.random.get_rng_state(), state)  # the fixed seed ran on a fork
    a, b = _adapters(real), _adapters(meta)
    # to_q and to_v of both attentions of the one block, A and B each
    assert a.keys() == b.keys() and len(a) == 8
    for name in a:
        assert not b[name].is_meta and b[name].requires_grad, name
        assert torch.equal(a[name], b[name]), name
    assert all(p.abs().sum() > 0 for n, p in a.items() if "lora_A" in n)  # A random, B zero
    assert all(not p.any() for n, p in a.items() if "lora_B" in n)
    base = [p for n, p in meta.named_parameters() if "lora_" not in n]
    assert base and all(p.is_meta and not p.requires_grad for p in base)
    # loading the base weights reads every meta tensor and keeps the adapters: the real model
    materialise_shards(meta, wan, torch.device("cpu"))
    want, got = real.state_dict(), meta.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_an_adapter_layer_the_replay_does_not_know_is_refused(wan, monkeypatch):
    """An adapter the replay leaves on the meta device (here: the replay sees no LoRA layer at
    all, as it would for a peft layer type it does not handle) is an error, not a silent hole."""
    import peft.tuners.lora

    monkeypatch.setattr(peft.tuners.lora, "LoraLayer", type("Other", (), {}))
    meta = load_diffusers_model(wan, "wan", SHAPE, empty=True)
    with pytest.raises(RuntimeError, match="adapter .*lora_A.* is still on the meta device"):
        build.lora_adapters(meta, LORA)


def test_offload_policy_and_its_refusal_without_shards(wan):
    from torch.distributed.fsdp import CPUOffloadPolicy

    assert build.offload_policy(DiffusionSettings()) is None
    policy = build.offload_policy(DiffusionSettings(fsdp=True, cpu_offload=True))
    assert isinstance(policy, CPUOffloadPolicy)
    assert policy.pin_memory is torch.cuda.is_available()  # pinned only where a GPU copies it
    model = load_diffusers_model(wan, "wan", SHAPE)
    with pytest.raises(ValueError, match="cpu_offload need diffusion.fsdp on >1 rank"):
        build.build_worker_models(
            model, DiffusionSettings(fsdp=True, cpu_offload=True), kl_coef=0.0,
            device=torch.device("cpu"),
        )  # fmt: skip
