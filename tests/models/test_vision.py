"""Vision-language models (groupflow.models.vision) on tiny random Idefics3 (SmolVLM) and Qwen2-VL /
Qwen2.5-VL configs: image prompts through generation and the training forward, token-in/token-out."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from groupflow.data.tokenizer import train_char_tokenizer
from groupflow.models.logprobs import response_logprobs
from groupflow.models.tiny_vlm import tiny_idefics3, tiny_qwen2_vl
from groupflow.models.vision import (
    encode_image_prompt,
    freeze_vision_tower,
    is_vision_model,
    vision_tower_modules,
)
from groupflow.rollout.engines.hf import SamplingParams, generate

ARCHS = ["idefics3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def build(arch: str, seed: int = 0):
    tok = train_char_tokenizer()
    if arch == "idefics3":
        model, proc = tiny_idefics3(tok, seed=seed)
    else:
        model, proc = tiny_qwen2_vl(
            tok, seed=seed, qwen25=arch == "qwen2_5_vl", qwen3=arch == "qwen3_vl"
        )
    return model.eval(), proc, tok


def image(color, size=(40, 30)):
    img = Image.new("RGB", size, (255, 255, 255))
    img.paste(Image.new("RGB", (12, 12), color), (4, 6))
    return img


def msg(text, *images):
    return [{"role": "user", "content": [{"type": "image", "image": im} for im in images]
             + [{"type": "text", "text": text}]}]  # fmt: skip


@pytest.fixture(scope="module", params=ARCHS)
def vlm(request):
    return (request.param, *build(request.param))


def test_prompts_carry_expanded_placeholders_and_their_image_tensors(vlm):
    arch, model, proc, tok = vlm
    assert is_vision_model(model)
    text, ids, vis = encode_image_prompt(proc, msg("count 3", image((255, 0, 0))))
    placeholder = model.config.image_token_id
    n_place = ids.count(placeholder)
    assert n_place > 1 and vis.num_images == 1
    if arch == "idefics3":
        assert n_place == 4 and vis.tensors["pixel_values"].shape[:2] == (1, 1)
    else:  # 40x30 -> 56x28 after Qwen's rounding to 28: 4x2 patches, 2x2 merged -> 2 tokens
        assert n_place == int(vis.tensors["image_grid_thw"].prod()) // 4
    t2, ids2, vis2 = encode_image_prompt(proc, [{"role": "user", "content": "plain"}])
    assert vis2.tensors == {} and placeholder not in ids2 and t2 == "<user>plain<assistant>"


def test_sampling_logprobs_equal_the_training_forward_per_sample(vlm):
    """Token-in/token-out: generation (shared prefill, left padding, two images in one prompt,
    a text prompt beside them) and the one-pass training forward give the same log-probs."""
    arch, model, proc, tok = vlm
    prompts = [
        msg("which colour?", image((255, 0, 0))),
        msg("two: compare them", image((0, 0, 255)), image((0, 255, 0), size=(28, 56))),
        [{"role": "user", "content": "no image here at all"}],
    ]
    enc = [encode_image_prompt(proc, p) for p in prompts]
    ids = [e[1] for e in enc]
    vision = [e[2] if e[2].tensors else None for e in enc]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=3)
    seeds = list(range(100, 109))
    out = generate(model, ids, params, seeds=seeds, pad_id=tok.pad_token_id,
                   eos_ids=[tok.eos_token_id], vision=vision)  # fmt: skip
    rows = [v for v in vision for _ in range(params.n)]
    with torch.no_grad():
        lp, _ = response_logprobs(model, out.prompt_ids, out.prompt_mask, out.responses,
                                  out.response_mask, vision=rows)  # fmt: skip
    mask = out.response_mask.bool()
    assert mask.sum() > 9
    torch.testing.assert_close(lp[mask], out.logprobs[mask], atol=2e-5, rtol=0)
    # the placeholders are prompt tokens only: the loss (response_mask) never covers them
    assert (out.prompt_ids == model.config.image_token_id).sum() > 0

    # each sample depends on its prompt and seed only: one prompt alone gives the same tokens
    alone = generate(model, [ids[1]], params, seeds=seeds[3:6], pad_id=tok.pad_token_id,
                     eos_ids=[tok.eos_token_id], vision=[vision[1]])  # fmt: skip
    assert torch.equal(alone.responses, out.responses[3:6])
    torch.testing.assert_close(alone.logprobs, out.logprobs[3:6], atol=2e-5, rtol=0)


def test_the_image_changes_the_logprobs(vlm):
    arch, model, proc, tok = vlm
    a = encode_image_prompt(proc, msg("colour?", image((255, 0, 0))))
    b = encode_image_prompt(proc, msg("colour?", image((0, 0, 255))))
    assert a[1] == b[1]  # same tokens: only the pixels differ
    ids = torch.tensor([a[1]])
    mask = torch.ones_like(ids)
    resp = torch.tensor([[5, 6, 7]])
    rm = torch.ones_like(resp)
    with torch.no_grad():
        la, _ = response_logprobs(model, ids, mask, resp, rm, vision=[a[2]])
        lb, _ = response_logprobs(model, ids, mask, resp, rm, vision=[b[2]])
    assert (la - lb).abs().max() > 1e-4


def test_freeze_vision_freezes_the_tower_and_projector_only():
    for arch in ARCHS:
        model, _, _ = build(arch)
        towers = vision_tower_modules(model)
        tower_params = sum(p.numel() for m in towers for p in m.parameters())
        assert towers and freeze_vision_tower(model) == tower_params > 0
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trainable and all("vision" not in n and "visual" not in n for n in trainable)
        assert any("embed_tokens" in n or "lm_head" in n for n in trainable)


# ----- the actor worker: rollout, log-probs, update, LoRA, state -------------------------------


def _worker(arch, **cfg):
    from groupflow.config import ActorConfig
    from groupflow.workers.actor import ActorRolloutWorker

    model, proc, tok = build(arch)
    freeze_vision_tower(model)
    worker = ActorRolloutWorker(model, tok, ActorConfig(**{"lr": 1e-2, "grad_clip": None, **cfg}),
                                total_steps=4, pad_id=tok.pad_token_id,
                                eos_ids=[tok.eos_token_id])  # fmt: skip
    return worker, proc


def _rollout(worker, proc, n=2):
    from groupflow.rollout.engines.batching import prompts_batch

    enc = [encode_image_prompt(proc, msg("red?", image((255, 0, 0)))),
           encode_image_prompt(proc, msg("blue or green?", image((0, 0, 255))))]  # fmt: skip
    prompts = prompts_batch([e[1] for e in enc], [[1, 2], [3, 4]], [0, 1], [e[2] for e in enc])
    batch = worker.generate(prompts, SamplingParams(max_new_tokens=5, n=n))
    assert list(batch["vision"]) == [enc[0][2], enc[0][2], enc[1][2], enc[1][2]]
    return batch


@pytest.mark.parametrize("arch,lora", [("idefics3", False), ("qwen2_vl", True)])
def test_the_worker_generates_scores_and_updates_image_prompts(arch, lora):
    from groupflow.config.training import LoraConfig

    extra = {"lora": LoraConfig(rank=4, target_modules="all-linear")} if lora else {}
    worker, proc = _worker(arch, **extra)
    tower = {n: p.detach().clone() for m in vision_tower_modules(worker.model)
             for n, p in m.named_parameters()}  # fmt: skip
    if lora:  # adapters on the language model only (actor.lora.vision_tower: false)
        names = [n for n, _ in worker.model.named_parameters() if "lora_" in n]
        assert names and not any("visual" in n or "vision" in n for n in names)
    batch = _rollout(worker, proc)
    lp = worker.compute_logprobs(batch, temperature=1.0)["logprobs"]
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(lp[mask], batch["rollout_logprobs"][mask], atol=2e-5, rtol=0)
    batch["advantages"] = torch.tensor([1.0, -1.0, 1.0, -1.0])
    batch["old_logprobs"] = lp
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters() if p.requires_grad}
    metrics = worker.update(batch, temperature=1.0)
    assert torch.isfinite(torch.tensor(metrics["actor/loss"]))
    changed = [n for n, p in worker.model.named_parameters()
               if n in before and not torch.equal(p, before[n])]  # fmt: skip
    assert changed
    after = {n: p for m in vision_tower_modules(worker.model) for n, p in m.named_parameters()}
    assert all(torch.equal(after[n], tower[n]) for n in tower)  # model.freeze_vision

    # state round trip: a fresh worker loaded with the state generates the same samples
    state = worker.state_dict()
    again, _ = _worker(arch, **extra)
    again.load_state_dict(state)
    b1, b2 = _rollout(worker, proc), _rollout(again, proc)
    assert torch.equal(b1["responses"], b2["responses"])
    torch.testing.assert_close(b1["rollout_logprobs"], b2["rollout_logprobs"], atol=1e-6, rtol=0)


def test_idefics3_rows_with_differently_padded_images_collate():
    from groupflow.models.vision import VisionInputs, collate_vision

    a = VisionInputs(
        {
            "pixel_values": torch.ones(1, 1, 3, 32, 24),
            "pixel_attention_mask": torch.ones(1, 1, 32, 24, dtype=torch.long),
        },
        1,
    )
    b = VisionInputs({"pixel_values": torch.ones(1, 2, 3, 24, 32),
                      "pixel_attention_mask": torch.ones(1, 2, 24, 32, dtype=torch.long)}, 2)  # fmt: skip
    out = collate_vision([a, None, b])
    assert out["pixel_values"].shape == (1, 3, 3, 32, 32)
    assert out["pixel_attention_mask"].shape == (1, 3, 32, 32)
    assert out["pixel_attention_mask"][0, 0].sum() == 32 * 24  # padding stays masked out
    assert out["pixel_values"][0, 0, :, :, 24:].abs().sum() == 0


def test_collapsing_an_idefics3_prompt_needs_the_image_token_id():
    from types import SimpleNamespace

    from groupflow.models.vision import collapse_placeholders

    config = SimpleNamespace(model_type="idefics3")  # no image_token_id
    with pytest.raises(ValueError, match="idefics3 model config without image_token_id"):
        collapse_placeholders([1, 2, 3], config, tokenizer=None)
