"""FSDP2 for the diffusion transformer: 1 worker == 2 sharded Ray workers (also with LoRA on the
meta-built model, and with CPU offload), checkpoints reshard, activation checkpointing changes no
gradient. Ray workers run one torch thread each."""

import json
import math

import pytest
import torch

from groupflow.run.tracking import read_metrics
from groupflow.trainer import Trainer
from tests.diffusion.test_mmdancegrpo import _tiny_wan


def _cfg(tmp_path, model, prompts, **over):
    from groupflow.config import apply_overrides, config_from_dict

    data = {
        "run": {"name": "one", "output_dir": str(tmp_path), "seed": 0, "total_steps": 2,
                "loggers": [], "num_threads": 1},
        "diffusion": {"model": {"kind": "wan", "path": str(model), "latent_shape": [4, 3, 8, 8]},
                      "num_steps": 3, "timestep_fraction": 0.67, "eval_samples_per_prompt": 1},
        "data": {"train_files": [str(prompts)], "prompts_per_step": 2},
        "rollout": {"samples_per_prompt": 2},
        "actor": {"lr": 1e-3},
        "reward": {"functions": [{"name": "brightness"}]},
    }  # fmt: skip
    return config_from_dict(apply_overrides(data, over))


@pytest.fixture(scope="module")
def wan_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a cat", "a dog")))
    return _tiny_wan(root / "wan"), prompts


def _fit(cfg, memory=None):
    trainer = Trainer(cfg)
    try:
        trainer.fit()
        if memory is not None:
            memory.extend(trainer.policy.actor.memory_stats())
        return trainer, trainer.policy.actor.state_dict()
    finally:
        trainer.shutdown()


@pytest.mark.slow  # Ray start-up and diffusers' import dominate; the model is tiny
def test_two_sharded_workers_equal_one_worker_and_checkpoints_reshard(wan_setup, tmp_path):
    pytest.importorskip("ray")
    model, prompts = wan_setup
    mem1, mem2 = [], []
    one, s1 = _fit(_cfg(tmp_path, model, prompts), mem1)
    two_cfg = {"run.name": "two", "run.backend": "ray", "run.num_workers": 2,
               "diffusion.fsdp": True, "run.save_every": 1}  # fmt: skip
    two, s2 = _fit(_cfg(tmp_path, model, prompts, **two_cfg), mem2)
    # built on the meta device, each rank reading only its shards of the safetensors
    assert [m["meta_init"] for m in mem2] == [1.0, 1.0] and mem1[0]["meta_init"] == 0.0
    # really sharded: each rank holds about half of the parameters and of Adam's state
    for key in ("param_bytes", "optimizer_bytes"):
        assert sum(m[key] for m in mem2) == pytest.approx(mem1[0][key], rel=0.01), key
        assert max(m[key] for m in mem2) < 0.6 * mem1[0][key], key
    a, b = read_metrics(one.run_dir / "metrics.jsonl"), read_metrics(two.run_dir / "metrics.jsonl")
    for ra, rb in zip(a[1:], b[1:], strict=True):
        # same samples (per-sample seeds); batch-size-dependent CPU kernels (AVX-512 here) may
        # round the halves' images differently in the last bit, so not bit-exact
        assert rb["reward/mean"] == pytest.approx(ra["reward/mean"], rel=1e-6)
        for key in ("actor/grad_norm", "actor/pg_loss", "actor/loss"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-7), key
    for k in s1["model"]:
        # Adam turns those last-bit differences of small gradients into up to ~3e-6 (measured);
        # a wrong update would move a weight by ~lr = 1e-3
        assert torch.allclose(s1["model"][k], s2["model"][k], atol=1e-5), k
    # the sharded checkpoint holds each rank's DCP shards and no gathered model
    step1 = two.run_dir / "checkpoints" / "step_1"
    assert sorted(p.name for p in (step1 / "shards").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp",
    ]  # fmt: skip
    assert not list(step1.glob("model.*")) and list(step1.glob("actor_state.*"))
    # it resumes on 2 sharded workers and, resharded, in one local worker: step 2 as before; on
    # 2 sharded workers with a rollout pool that samples step 2 with the version each rank's
    # shard broadcast to it (the collective transport: nothing gathered, nothing via the driver)
    pool = {"placement.rollout": {"workers_per_node": 1, "cpus_per_worker": 0.5}}
    resumes = {"re2": two_cfg | {"run.save_every": 0} | pool, "re1": {}}
    for name, over in resumes.items():
        cfg = _cfg(tmp_path, model, prompts, **over | {"run.name": name, "run.resume": str(step1)})
        resumed, s3 = _fit(cfg)
        last = read_metrics(resumed.run_dir / "metrics.jsonl")[-1]
        assert last["step"] == 2, name
        if name == "re2":
            assert resumed.policy.transport.name == "collective"
            assert last["weights/bytes_via_driver"] == 0 and last["time/weight_transfer"] > 0
        for key in ("actor/grad_norm", "actor/pg_loss", "reward/mean"):
            assert last[key] == pytest.approx(a[-1][key], rel=1e-4, abs=1e-7), (name, key)
        for k in s1["model"]:
            assert torch.allclose(s1["model"][k], s3["model"][k], atol=1e-5), (name, k)


@pytest.mark.slow
def test_activation_checkpointing_gives_the_same_gradients(wan_setup):
    from groupflow.algorithms import compute_advantages
    from groupflow.config import ActorConfig
    from groupflow.diffusion.models import load_diffusers_model
    from groupflow.diffusion.worker import DiffusionSettings, DiffusionWorker, prompt_rows

    torch.set_num_threads(1)
    grads = []
    for ckpt in (False, True):
        flow = load_diffusers_model(wan_setup[0], "wan", (4, 3, 8, 8))
        settings = DiffusionSettings(
            num_steps=2, timestep_fraction=1.0, activation_checkpointing=ckpt
        )
        w = DiffusionWorker(flow, settings, ActorConfig(lr=1e-3, clip_eps_low=1e-4), total_steps=2)
        assert w.flow.transformer.gradient_checkpointing is ckpt
        b = w.generate(prompt_rows(["a cat", "a dog"], [[1, 2], [3, 4]], [0, 1]), 2)
        b["advantages"] = compute_advantages(b["images"].mean((1, 2, 3, 4)), b["group_ids"], "grpo")
        b["old_logprobs"] = b["rollout_logprobs"]
        seen = []

        def keep(*_, seen=seen, w=w, **__):
            seen.append([p.grad.clone() for p in w.flow.parameters()])

        w.optimizer.step = keep
        m = w.update(b.select(*[k for k in b.tensors if k not in ("images", "rollout_logprobs")]))
        assert math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0
        grads.append(seen[0])
    for g0, g1 in zip(*grads, strict=True):
        assert torch.allclose(g0, g1, atol=1e-6)


@pytest.mark.slow
def test_lora_on_a_meta_built_sharded_transformer_equals_one_worker_with_and_without_offload(
    wan_setup, tmp_path
):
    """LoRA adapters injected into the meta-built transformer (each rank reads only its rows of
    the base; the adapters get peft's init from the fixed seed) and sharded with it; the
    reference is the adapter-free sharded model. FSDP2's CPU offload on top changes no number
    (on CPU ranks it has nowhere else to put the shards: this checks the code path, not memory)."""
    pytest.importorskip("ray")
    model, prompts = wan_setup
    lora = {"diffusion.model.lora": {"rank": 2, "alpha": 4, "target_modules": ["to_q", "to_v"]},
            "actor.kl_coef": 0.1, "run.total_steps": 1}  # fmt: skip
    two = {"run.backend": "ray", "run.num_workers": 2, "diffusion.fsdp": True}
    one, s1 = _fit(_cfg(tmp_path, model, prompts, **lora))
    a = read_metrics(one.run_dir / "metrics.jsonl")[-1]
    assert a["actor/grad_norm"] > 0
    adapters = [k for k in s1["model"] if "lora_" in k]
    assert adapters
    for name, over in {"two": {}, "offload": {"diffusion.cpu_offload": True}}.items():
        memory = []
        cfg = _cfg(tmp_path, model, prompts, **lora, **two, **over, **{"run.name": name})
        run, s2 = _fit(cfg, memory)
        assert [m["meta_init"] for m in memory] == [1.0, 1.0], name  # no rank held the full base
        b = read_metrics(run.run_dir / "metrics.jsonl")[-1]
        for key in ("actor/grad_norm", "actor/pg_loss", "actor/kl_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (name, key)
        for k in s1["model"]:
            assert torch.allclose(s1["model"][k], s2["model"][k], atol=1e-6), (name, k)


@pytest.mark.slow
def test_two_sharded_workers_equal_one_worker_on_an_sd3_transformer(wan_setup, tmp_path):
    pytest.importorskip("ray")
    from tests.diffusion.test_models import _sd3

    model, prompts = _sd3(tmp_path), wan_setup[1]
    sd3 = {"diffusion.model.kind": "sd3", "diffusion.model.path": str(model),
           "diffusion.model.latent_shape": [4, 8, 8], "run.total_steps": 1,
           "actor.kl_coef": 0.1}  # fmt: skip  # the frozen reference: also meta-built, read by rows
    one, s1 = _fit(_cfg(tmp_path, model, prompts, **sd3))
    two, s2 = _fit(_cfg(tmp_path, model, prompts, **sd3, **{
        "run.name": "two", "run.backend": "ray", "run.num_workers": 2, "diffusion.fsdp": True}))  # fmt: skip
    a = read_metrics(one.run_dir / "metrics.jsonl")[-1]
    b = read_metrics(two.run_dir / "metrics.jsonl")[-1]
    assert a["actor/grad_norm"] > 0
    assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-4)
    assert b["actor/kl_loss"] == pytest.approx(a["actor/kl_loss"], rel=1e-4, abs=1e-9)
    for k in s1["model"]:
        # Adam turns those last-bit differences of small gradients into up to ~3e-6 (measured);
        # a wrong update would move a weight by ~lr = 1e-3
        assert torch.allclose(s1["model"][k], s2["model"][k], atol=1e-5), k


@pytest.mark.slow
def test_bf16_mixed_precision_is_close_to_fp32(wan_setup, tmp_path):
    """FSDP2 bf16 (params/compute) with fp32 reduce and master weights: the first update's loss
    and gradient norm are within bf16's error of the fp32 run's (not equal: bf16 really
    computes), and the weights AdamW keeps stay fp32."""
    pytest.importorskip("ray")
    model, prompts = wan_setup
    one, _ = _fit(_cfg(tmp_path, model, prompts, **{"run.total_steps": 1}))
    bf16 = {"run.name": "bf16", "run.backend": "ray", "run.num_workers": 2, "run.total_steps": 1,
            "diffusion.fsdp": True, "diffusion.bf16": True}  # fmt: skip
    two, s2 = _fit(_cfg(tmp_path, model, prompts, **bf16))
    a = read_metrics(one.run_dir / "metrics.jsonl")[-1]
    b = read_metrics(two.run_dir / "metrics.jsonl")[-1]
    assert a["actor/grad_norm"] > 0
    assert b["actor/grad_norm"] != a["actor/grad_norm"]
    assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=0.05)
    assert b["reward/mean"] == pytest.approx(a["reward/mean"], rel=0.02)
    assert b["actor/pg_loss"] == pytest.approx(
        a["actor/pg_loss"], abs=0.05 * abs(a["actor/pg_loss"]) + 1e-3
    )
    assert all(v.dtype == torch.float32 for v in s2["model"].values())


@pytest.mark.slow
@pytest.mark.parametrize(
    "objective,two_cfg",
    [
        pytest.param("awm", {"diffusion.fsdp": True}, id="awm-fsdp"),
        pytest.param("nft", {}, id="nft-replicated"),
    ],
)
def test_the_renoising_objectives_on_two_workers_equal_one_worker(
    wan_setup, tmp_path, objective, two_cfg
):
    """AWM and DiffusionNFT train on re-noised final latents: each sample's training noise is
    drawn from its own rollout seed, so 2 workers (AWM FSDP2-sharded, NFT replicated with summed
    gradients) train like one at every step, up to float reduction order (before, the noise was
    drawn per rank, and runs parted after step 1). Their "old" sampling copy — sharded like the
    model, updated shard-wise (after a forward-only sampling pass FSDP2's root still held gathered
    plain-tensor parameters, and that update crashed mixing Tensor and DTensor) — is AWM's
    updated weights exactly."""
    pytest.importorskip("ray")
    model, prompts = wan_setup
    obj = {"diffusion.objective": objective}
    one, s1 = _fit(_cfg(tmp_path, model, prompts, **obj))
    two_cfg = {"run.name": "two", "run.backend": "ray", "run.num_workers": 2, **two_cfg}
    two, s2 = _fit(_cfg(tmp_path, model, prompts, **obj, **two_cfg))
    a = {r["step"]: r for r in read_metrics(one.run_dir / "metrics.jsonl") if "actor/loss" in r}
    b = {r["step"]: r for r in read_metrics(two.run_dir / "metrics.jsonl") if "actor/loss" in r}
    assert sorted(a) == sorted(b) == [1, 2]
    for step in (1, 2):
        for key in ("reward/mean", "actor/grad_norm", "actor/pg_loss", "actor/loss"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-7), (step, key)
    for k in s1["model"]:
        # Adam turns those last-bit differences of small gradients into up to ~3e-6 (measured);
        # a wrong update would move a weight by ~lr = 1e-3
        assert torch.allclose(s1["model"][k], s2["model"][k], atol=1e-5), k
    assert s2["nft_old"].keys() == s2["model"].keys()
    for k in s2["model"]:
        old = s2["nft_old"][k]
        if objective == "awm":
            assert torch.equal(old, s2["model"][k]), k
        else:  # DiffusionNFT's EMA, shard-wise on 2 ranks as on one
            assert torch.allclose(old, s1["nft_old"][k], atol=1e-6), k


@pytest.mark.slow
def test_two_sharded_workers_equal_one_worker_on_a_flux_transformer_with_lora(wan_setup, tmp_path):
    """FLUX's two block lists are both sharded; LoRA adapters on the meta-built model start as
    a whole model's would, so 1 worker and 2 FSDP2 ranks take the same step."""
    pytest.importorskip("ray")
    from diffusers import FluxTransformer2DModel

    from tests.diffusion.test_flux import TINY_FLUX

    torch.manual_seed(0)
    model = tmp_path / "flux"
    FluxTransformer2DModel(**TINY_FLUX).save_pretrained(model)
    prompts = wan_setup[1]
    flux = {"diffusion.model.kind": "flux", "diffusion.model.path": str(model),
            "diffusion.model.latent_shape": [4, 8, 8], "run.total_steps": 1,
            "diffusion.model.lora": {"rank": 2, "target_modules": ["to_q", "to_k", "to_v"]}}  # fmt: skip
    one, s1 = _fit(_cfg(tmp_path, model, prompts, **flux))
    two, s2 = _fit(_cfg(tmp_path, model, prompts, **flux, **{
        "run.name": "two", "run.backend": "ray", "run.num_workers": 2, "diffusion.fsdp": True}))  # fmt: skip
    a = read_metrics(one.run_dir / "metrics.jsonl")[-1]
    b = read_metrics(two.run_dir / "metrics.jsonl")[-1]
    assert a["actor/grad_norm"] > 0
    assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-4)
    lora = [k for k in s1["model"] if "lora_" in k]
    assert lora and all(torch.allclose(s1["model"][k], s2["model"][k], atol=1e-5) for k in lora)


def _new_kind_dir(kind: str, path):
    """A kind's tiny random transformer, from the config its own test file shrinks."""
    import diffusers

    from tests.diffusion import test_flux2, test_qwen_image, test_z_image

    tiny, cls, shape = {
        "qwen_image": (test_qwen_image.TINY_QWEN_IMAGE, "QwenImageTransformer2DModel", [4, 8, 8]),
        "z_image": (test_z_image.TINY_Z_IMAGE, "ZImageTransformer2DModel", [4, 8, 8]),
        "flux2": (test_flux2.TINY_FLUX2, "Flux2Transformer2DModel", [16, 4, 4]),
    }[kind]
    torch.manual_seed(0)
    getattr(diffusers, cls)(**tiny).save_pretrained(path)
    return shape


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen_image", "z_image", "flux2"])
def test_two_sharded_workers_equal_one_worker_on_the_new_kinds_with_lora(kind, wan_setup, tmp_path):
    """Each kind's block lists are sharded (Z-Image's refiners and layers; Qwen-Image with its
    frozen last text stream), and 1 worker and 2 FSDP2 ranks take the same LoRA step."""
    pytest.importorskip("ray")
    model = tmp_path / kind
    shape = _new_kind_dir(kind, model)
    over = {"diffusion.model.kind": kind, "diffusion.model.path": str(model),
            "diffusion.model.latent_shape": shape, "run.total_steps": 1,
            "diffusion.model.lora": {"rank": 2, "target_modules": ["to_q", "to_k", "to_v"]}}  # fmt: skip
    one, s1 = _fit(_cfg(tmp_path, model, wan_setup[1], **over))
    two, s2 = _fit(_cfg(tmp_path, model, wan_setup[1], **over, **{
        "run.name": "two", "run.backend": "ray", "run.num_workers": 2, "diffusion.fsdp": True}))  # fmt: skip
    a = read_metrics(one.run_dir / "metrics.jsonl")[-1]
    b = read_metrics(two.run_dir / "metrics.jsonl")[-1]
    assert a["actor/grad_norm"] > 0
    assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-4)
    lora = [k for k in s1["model"] if "lora_" in k]
    assert lora and all(torch.allclose(s1["model"][k], s2["model"][k], atol=1e-5) for k in lora)
