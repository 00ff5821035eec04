"""Meta-device construction and sharded loading of a diffusers transformer (diffusion.sharding):
FSDP2's row split, a meta-built model reading back exactly the saved weights (rotary buffers
kept), each of 2 gloo ranks holding only its rows without ever loading the full model (also with
LoRA adapters and CPU offload, as a worker builds it), and bad checkpoints refused with the
offending file / tensor named."""

from __future__ import annotations

import pytest
import torch

from groupflow.diffusion.models import load_diffusers_model
from groupflow.diffusion.sharding import empty_parameters, materialise_shards, shard_rows
from tests.diffusion.test_mmdancegrpo import _tiny_wan

SHAPE = (4, 3, 8, 8)


@pytest.mark.parametrize(
    ("n", "world", "rows"),
    [
        (10, 4, [(0, 3), (3, 6), (6, 9), (9, 10)]),  # ⌈10/4⌉ = 3 rows each, the last one short
        (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),  # fewer rows than ranks: empty shards
        (8, 2, [(0, 4), (4, 8)]),
    ],
)
def test_shard_rows_follow_torch_chunk(n, world, rows):
    assert [shard_rows(n, r, world) for r in range(world)] == rows
    chunks = [c.shape[0] for c in torch.arange(n).chunk(world)]
    assert [b - a for a, b in rows] == chunks + [0] * (world - len(chunks))


def test_empty_parameters_keeps_buffers_and_restores_register_parameter():
    register = torch.nn.Module.register_parameter
    with empty_parameters():
        lin = torch.nn.Linear(3, 2)
        norm = torch.nn.BatchNorm1d(2)
    assert lin.weight.is_meta and lin.bias.is_meta and norm.weight.is_meta
    assert not norm.running_var.is_meta and torch.equal(norm.running_var, torch.ones(2))
    assert torch.nn.Module.register_parameter is register
    assert not torch.nn.Linear(3, 2).weight.is_meta


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return _tiny_wan(tmp_path_factory.mktemp("sharding") / "wan")


def test_a_meta_built_transformer_reads_back_the_saved_weights(wan):
    full = load_diffusers_model(wan, "wan", SHAPE)
    empty = load_diffusers_model(wan, "wan", SHAPE, empty=True)
    assert all(p.is_meta for p in empty.parameters())
    assert not any(b.is_meta for b in empty.buffers())  # Wan's rotary tables: not in the file
    materialise_shards(empty, wan, torch.device("cpu"))
    a, b = full.state_dict(), empty.state_dict()
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _resave(src, dst, edit):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = dst / "diffusion_pytorch_model.safetensors"
    weights = load_file(str(f))
    edit(weights)
    save_file(weights, str(f))
    return dst


def test_bad_checkpoints_are_refused_naming_the_tensor(wan, tmp_path):
    key = "blocks.0.attn1.to_q.weight"
    missing = _resave(wan, tmp_path / "missing", lambda w: w.pop(key))
    with pytest.raises(KeyError, match=key):
        materialise_shards(load_diffusers_model(missing, "wan", SHAPE, empty=True), missing, "cpu")
    wrong = _resave(wan, tmp_path / "wrong", lambda w: w.update({key: w[key][:, :4].clone()}))
    with pytest.raises(ValueError, match=rf"diffusion_pytorch_model.safetensors:{key} has shape"):
        materialise_shards(load_diffusers_model(wrong, "wan", SHAPE, empty=True), wrong, "cpu")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((wan / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        materialise_shards(load_diffusers_model(pickled, "wan", SHAPE, empty=True), pickled, "cpu")


def _rank(rank: int, world: int, store_path: str, model: str) -> None:
    import faulthandler

    faulthandler.enable()  # rank 1 once died natively ("double free or corruption"): say where
    import diffusers
    import torch.distributed as dist
    from safetensors.torch import load_file

    from groupflow.diffusion.sharding import flow_layers
    from groupflow.distributed.parallel import full_model_state, shard
    from groupflow.policies.diffusion import FlowModelSpec

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world
    )
    try:
        from groupflow.diffusion.build import lora_adapters

        lora = {"rank": 2, "alpha": 4, "target_modules": ["to_q", "to_v"]}
        whole = FlowModelSpec(
            "wan", model, list(SHAPE)
        ).build()  # before from_pretrained is refused
        lora_adapters(whole, lora)
        want_lora = {k: v.clone() for k, v in whole.state_dict().items()}

        def refuse(*_, **__):
            raise AssertionError("a rank loaded the full transformer")

        diffusers.WanTransformer3DModel.from_pretrained = refuse
        flow = FlowModelSpec("wan", model, list(SHAPE)).build(empty=True)
        shard(flow, flow_layers(flow))
        materialise_shards(flow, model, torch.device("cpu"))
        saved = load_file(f"{model}/diffusion_pytorch_model.safetensors")
        held = 0
        for name, p in flow.named_parameters():
            full = saved[name.removeprefix("transformer.")]
            start, stop = shard_rows(full.shape[0], rank, world)
            local = p.to_local()
            assert torch.equal(local, full[start:stop]), name
            held += local.numel()
        assert held < 0.6 * sum(t.numel() for t in saved.values())
        gathered = full_model_state(flow)  # the shards all-gather into the saved model
        for name, t in gathered.items():
            key = name.removeprefix("transformer.")
            if key in saved:
                assert torch.equal(t, saved[key]), name
        _lora_and_offload(model, lora, want_lora)
        dist.barrier()  # neither rank tears gloo down while its peer still talks (SIGABRT in CI)
    finally:
        dist.destroy_process_group()


def _lora_and_offload(model: str, lora: dict, want: dict) -> None:
    """A meta-built transformer with LoRA and CPU offload, as a worker builds it: every FSDP2
    parameter marked for offload, and the shards all-gather into the whole model with peft's
    adapters (``want``)."""
    from groupflow.diffusion.build import build_worker_models
    from groupflow.diffusion.settings import DiffusionSettings
    from groupflow.distributed.parallel import full_model_state
    from groupflow.policies.diffusion import FlowModelSpec

    flow = FlowModelSpec("wan", model, list(SHAPE)).build(empty=True)
    settings = DiffusionSettings(fsdp=True, cpu_offload=True, lora=lora)
    held = build_worker_models(
        flow, settings, kl_coef=0.1, device=torch.device("cpu"), weights=model
    )
    assert held.sharded and held.peft is not None and held.ref is None
    # FSDP2's own record of the policy (private state, read only here to see the switch land)
    groups = [
        m._get_fsdp_state()._fsdp_param_group
        for m in flow.modules()
        if hasattr(m, "_get_fsdp_state")
    ]
    params = [fp for g in groups if g is not None for fp in g.fsdp_params]
    assert params and all(fp.offload_to_cpu and not fp.pin_memory for fp in params)
    got = full_model_state(flow)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.slow  # two processes importing torch and diffusers
def test_two_gloo_ranks_each_read_only_their_rows(wan, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, str(tmp_path / "store"), str(wan)), nprocs=2, join=True)


def _tiny_policy(seed: int):
    from groupflow.diffusion.models import TinyFlowModel

    torch.manual_seed(seed)
    model = TinyFlowModel(["red", "blue"], width=8, blocks=1, emb_dim=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(
        torch.randn(2, 3, 16, 16), torch.rand(2), {"labels": torch.tensor([0, 1])}
    ).sum().backward()
    opt.step()
    return model, opt


def test_dcp_shards_round_trip_and_a_crafted_index_is_refused(tmp_path):
    """save_sharded_state / load_sharded_state with an extra model in one process (DCP without a process group): model, AdamW
    state and the extra (NFT old) model come back exactly; a pickle index that would run code is
    refused before DCP unpickles it."""
    import pickle

    from groupflow.distributed.parallel import load_sharded_state, save_sharded_state
    from groupflow.utils.safe_state import UnsafeStateError

    model, opt = _tiny_policy(0)
    old = _tiny_policy(1)[0]
    save_sharded_state(model, opt, tmp_path / "shards", {"nft_old": old})
    model2, opt2 = _tiny_policy(2)
    old2 = _tiny_policy(3)[0]
    load_sharded_state(model2, opt2, tmp_path / "shards", {"nft_old": old2})
    for a, b in ((model, model2), (old, old2)):
        for (k, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            assert torch.equal(x, y), k
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])

    class Boom:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "shards" / ".metadata").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(UnsafeStateError, match="refusing to load this sharded checkpoint"):
        load_sharded_state(model2, opt2, tmp_path / "shards", {"nft_old": old2})
