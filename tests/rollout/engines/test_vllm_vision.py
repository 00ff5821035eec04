"""The vLLM engine on prompts with images (runs in .venv-vllm only): a tiny random Idefics3
(SmolVLM's architecture; vLLM's CPU build takes it, while its Qwen2-VL needs torchvision) saved
with its processor, images as vLLM's multi_modal_data beside the token prompt — the expanded ids
are ours, and the sampled ids' vLLM log-probs equal the HF training forward's.

Head dim 64 (hidden 128, 2 heads): vLLM's CPU attention rejects the tests' usual head dim 16.
"""

import os

import pytest
import torch
from PIL import Image

from groupflow.rollout.engines.vllm_engine import vllm_available

pytestmark = pytest.mark.skipif(
    not vllm_available(),
    reason="vLLM is not installed here; these tests run in .venv-vllm (bash scripts/setup_vllm.sh, "
    "then .venv-vllm/bin/python -m pytest tests/rollout/engines/test_vllm_vision.py)",
)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from groupflow.data.tokenizer import train_char_tokenizer  # noqa: E402
from groupflow.models.logprobs import response_logprobs  # noqa: E402
from groupflow.models.tiny_vlm import tiny_idefics3  # noqa: E402
from groupflow.models.vision import encode_image_prompt, join_vision  # noqa: E402
from groupflow.rollout.engines.hf import SamplingParams, generate  # noqa: E402


def _picture(colour, size=(40, 30)):
    img = Image.new("RGB", size, (255, 255, 255))
    img.paste(Image.new("RGB", (12, 12), colour), (4, 6))
    return img


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from groupflow.rollout.engines.vllm_engine import VLLMEngine, VLLMOptions

    torch.set_num_threads(1)
    tok = train_char_tokenizer()
    model, proc = tiny_idefics3(tok, hidden_size=128, num_heads=2, vision_hidden=64, seed=3)
    model.eval()
    with torch.no_grad():  # sharper next-token distributions than a fresh init (no greedy ties)
        g = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if p.dim() == 2 and "vision" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.15 if "embed" in name else 0.08))
    d = tmp_path_factory.mktemp("idefics3")
    proc.save_pretrained(str(d))
    engine = VLLMEngine(
        model, tok, VLLMOptions(dtype="float32", seed=0, processor_path=str(d), max_model_len=256),
        eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id,
    )  # fmt: skip
    prompts = [
        [{"role": "user", "content": [{"type": "image", "image": _picture((255, 0, 0))},
                                      {"type": "text", "text": "colour?"}]}],
        [{"role": "user", "content": [{"type": "text", "text": "compare "},
                                      {"type": "image", "image": _picture((0, 0, 255))},
                                      {"type": "image", "image": _picture((0, 255, 0), (24, 48))}]}],
        [{"role": "user", "content": "no image"}],
    ]  # fmt: skip
    enc = [encode_image_prompt(proc, p) for p in prompts]
    ids = [e[1] for e in enc]
    vision = [e[2] if e[2].tensors else None for e in enc]
    return model, tok, engine, ids, vision


def test_image_prompts_sample_with_the_training_forwards_logprobs(setup):
    model, tok, engine, ids, vision = setup
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2)
    seeds = list(range(40, 46))
    out = engine.generate(ids, params, seeds=seeds, vision=vision)
    rows = [v for v in vision for _ in range(params.n)]
    with torch.no_grad():
        lp, _ = response_logprobs(model, out.prompt_ids, out.prompt_mask, out.responses,
                                  out.response_mask, vision=rows)  # fmt: skip
    mask = out.response_mask.bool()
    assert mask.sum() > 12
    diff = (lp[mask] - out.logprobs[mask]).abs().max().item()
    print(f"max |vLLM - training forward| log-prob with images = {diff:.2e}")
    assert diff < 1e-3
    # the expanded prompts are ours (checked by the engine) and the images matter
    assert (out.prompt_ids == model.config.image_token_id).sum() > 0
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    v = engine.generate(ids, greedy, seeds=[0, 0, 0], vision=vision)
    h = generate(model, ids, greedy, seeds=[0, 0, 0], pad_id=tok.pad_token_id,
                 eos_ids=[tok.eos_token_id], vision=vision)  # fmt: skip
    assert torch.equal(v.responses, h.responses)


def test_images_of_a_multi_turn_context_and_bad_inputs(setup):
    model, tok, engine, ids, vision = setup
    # a context whose second image came from an observation: one request, both images
    both = join_vision([vision[0], vision[1]])
    ctx = ids[0] + ids[1]
    out = engine.generate([ctx], SamplingParams(temperature=1.0, max_new_tokens=4), seeds=[7],
                          vision=[both])  # fmt: skip
    with torch.no_grad():
        lp, _ = response_logprobs(model, out.prompt_ids, out.prompt_mask, out.responses,
                                  out.response_mask, vision=[both])  # fmt: skip
    m = out.response_mask.bool()
    assert (lp[m] - out.logprobs[m]).abs().max().item() < 1e-3
    # an image the ids do not show is refused, naming the prompt
    with pytest.raises(ValueError, match="prompt 0 shows 0 image placeholder"):
        engine.generate([ids[2]], SamplingParams(max_new_tokens=2), seeds=[1],
                        vision=[vision[0]])  # fmt: skip
