"""HPSv3 on transformers' Qwen2-VL classes, against tiny random checkpoints built here in HPSv3's
release layout (no download).

The reference is HPSv3's own inference path re-implemented from its code (hpsv3/inference.py,
hpsv3/model/qwen2vl_trainer.py, hpsv3/dataset/data_collator_qwen.py): a
``Qwen2VLForConditionalGeneration`` with an ``rm_head`` attribute, the checkpoint loaded strictly
after its key remap, the prompt rendered with Qwen2-VL-Instruct's chat template, and its forward
— embeddings, vision features scattered into the image tokens, the language model called with
``inputs_embeds`` and no position ids, the head on every position, the row at ``<|Reward|>``.
"""

import pytest
import torch
from torch import nn

from groupflow.diffusion.hpsv3 import (
    INSTRUCTION,
    REWARD_TOKEN,
    conversation,
    module_key,
    smart_resize,
)
from groupflow.rewards import RewardConfigError, build_reward_runner

# Qwen2-VL-7B-Instruct's chat_template.json (the base HPSv3 was trained from)
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]  # fmt: skip


def test_smart_resize_hand_values():
    # a Wan frame, 480x832: rounds to 476x840 (399,840 px > 200,704), so scaled by
    # β = √(480·832/200704) = 1.4106 and floored to multiples of 28: 340.3 -> 336, 589.8 -> 588
    assert smart_resize(480, 832) == (336, 588)
    # 16x16 rounds up to 28x28 (784 px < 200,704): scaled by β = 28 and ceiled: 448x448
    assert smart_resize(16, 16) == (448, 448)
    assert smart_resize(448, 448) == (448, 448)  # already on the budget
    with pytest.raises(ValueError, match="thinner than the 1:200"):
        smart_resize(1, 201)


def test_checkpoint_keys_of_both_transformers_layouts():
    assert module_key("rm_head.5.weight") == "head.5.weight"
    assert (
        module_key("visual.blocks.0.attn.qkv.weight") == "backbone.visual.blocks.0.attn.qkv.weight"
    )
    assert module_key("model.visual.merger.ln_q.weight") == "backbone.visual.merger.ln_q.weight"
    assert module_key("model.layers.0.mlp.up_proj.weight") == (
        "backbone.language_model.layers.0.mlp.up_proj.weight"
    )
    assert module_key("model.language_model.norm.weight") == "backbone.language_model.norm.weight"
    assert module_key("lm_head.weight") is None  # a score never uses the LM head
    assert module_key("something.else") == "something.else"  # refused later as unexpected


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are made of)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    order = printable + others
    chars = printable + [256 + i for i in range(len(others))]
    return [chr(c) for _, c in sorted(zip(order, chars))]


def tiny_base(path):
    """A Qwen2-VL "base" directory as HPSv3 needs it: config.json (a 1-layer, 16-wide random
    architecture), a byte-level Qwen2 tokenizer with Qwen's special tokens and chat template, and
    the image processor's preprocessor_config.json. No weights: the checkpoint holds them all."""
    from transformers import Qwen2Tokenizer, Qwen2VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    vocab = {c: i for i, c in enumerate(_byte_chars())}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
    tok.chat_template = QWEN2_VL_TEMPLATE
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil().save_pretrained(path)
    ids = dict(zip(QWEN_SPECIALS, tok.convert_tokens_to_ids(QWEN_SPECIALS), strict=True))
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=len(tok), bos_token_id=None,
                eos_token_id=ids["<|im_end|>"], rope_parameters={"rope_type": "default",
                "mrope_section": [2, 1, 1], "rope_theta": 10000.0})  # fmt: skip
    vision = dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, mlp_ratio=2)
    Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    ).save_pretrained(path)  # fmt: skip
    return path


class ReferenceHPSv3(nn.Module):
    """HPSv3's reward model as its code builds it: Qwen2VLForConditionalGeneration + rm_head."""

    def __init__(self, base, seed=0):
        from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration

        super().__init__()
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        self.tokenizer.padding_side = "right"
        self.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        self.reward_id = self.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        torch.manual_seed(seed)
        config = Qwen2VLConfig.from_pretrained(base, attn_implementation="sdpa")
        self.net = Qwen2VLForConditionalGeneration(config)
        self.net.resize_token_embeddings(len(self.tokenizer))
        hidden = config.text_config.hidden_size
        self.net.rm_head = nn.Sequential(
            nn.Linear(hidden, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16), nn.ReLU(),
            nn.Linear(16, 2),
        )  # fmt: skip
        # larger random weights than transformers' 0.02 init, so that images, prompts and
        # positions move the score well beyond float error (with the default init a 1-layer,
        # 16-wide model scores every input within ~1e-4 of the others)
        with torch.no_grad():
            for p in self.net.parameters():
                if p.dim() > 1:
                    p.normal_(0, p[0].numel() ** -0.5)  # 1/√fan-in
        self.eval()

    def release_state(self) -> dict:
        """The state dict in the released file's (transformers 4.45) key layout."""
        out = {}
        for k, v in self.net.state_dict().items():
            if k.startswith("model.visual."):
                k = k[len("model.") :]
            elif k.startswith("model.language_model."):
                k = "model." + k[len("model.language_model.") :]
            out[k] = v.detach().clone().contiguous()
        return out

    def load_release(self, state: dict) -> None:
        """HPSv3's loader: a strict load, retried with the remap to the later layout."""
        remapped = {
            ("model." + k if k.startswith("visual.") else
             "model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v
            for k, v in state.items()
        }  # fmt: skip
        self.net.load_state_dict(remapped, strict=True)

    def batch(self, images, prompts, image_processor):
        """HPSv3's prepare_batch: messages, the chat template, images resized to the budget."""
        from PIL import Image

        messages = [[{"role": "user", "content": [{"type": "image"}, {"type": "text",
                     "text": INSTRUCTION.format(text_prompt=p) + "\nPlease provide the overall "
                     "ratings of this image: <|Reward|>\n\nEND\n"}]}] for p in prompts]  # fmt: skip
        texts = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        pils = []
        for img in images:
            pil = Image.fromarray((img.permute(1, 2, 0) * 255).round().byte().numpy())
            h, w = smart_resize(pil.height, pil.width)
            pils.append(pil.resize((w, h), Image.BICUBIC))
        vision = image_processor(images=pils, return_tensors="pt")
        # what Qwen2VLProcessor does with the text: one <|image_pad|> per merged patch
        n = vision["image_grid_thw"].prod(-1) // 4
        texts = [t.replace("<|image_pad|>", "<|image_pad|>" * int(k)) for t, k in zip(texts, n)]
        return {**self.tokenizer(texts, padding=True, return_tensors="pt"), **vision}

    @torch.no_grad()
    def forward(self, input_ids, attention_mask, pixel_values, image_grid_thw):
        vl = self.net.model
        embeds = vl.language_model.embed_tokens(input_ids)
        image = vl.visual(pixel_values.type(vl.visual.dtype), grid_thw=image_grid_thw).pooler_output
        mask = (input_ids == self.net.config.image_token_id)[..., None].expand_as(embeds)
        embeds = embeds.masked_scatter(mask, image.to(embeds.dtype))
        hidden = vl(input_ids=None, inputs_embeds=embeds, attention_mask=attention_mask)[0]
        logits = self.net.rm_head(hidden.float())  # [B, L, 2]
        return logits[input_ids == self.reward_id].view(input_ids.shape[0], -1)  # μ, log σ


@pytest.fixture(scope="module")
def hpsv3(tmp_path_factory):
    """(checkpoint file, base directory, the reference model holding the same weights)."""
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("hpsv3")
    base = tiny_base(root / "Qwen2-VL-tiny")
    ref = ReferenceHPSv3(base)
    (root / "HPSv3").mkdir()
    save_file(ref.release_state(), str(root / "HPSv3" / "HPSv3.safetensors"))
    ref.load_release(ref.release_state())
    return root / "HPSv3" / "HPSv3.safetensors", base, ref


def _frames(n, seed, size=16):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, size, size, generator=g)


@pytest.mark.slow  # transformers' Qwen2-VL import and the ~2,700-token prompts dominate
def test_scores_equal_the_reference_forward_batched_and_one_by_one(hpsv3):
    from transformers import AutoImageProcessor

    from groupflow.diffusion.hpsv3 import HPSv3Scorer

    file, base, ref = hpsv3
    scorer = HPSv3Scorer(file, processor_path=base)
    images = _frames(3, 0)
    prompts = ["a red fox", "a cat on a very long and winding road", "sky"]
    ours = scorer.inputs(images, prompts)
    theirs = ref.batch(images, prompts, AutoImageProcessor.from_pretrained(base))
    # the same tokens as Qwen2-VL's chat template gives, and the same pixels
    for key in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw"):
        assert torch.equal(ours[key], theirs[key]), key
    assert ours["image_grid_thw"].tolist() == [[1, 32, 32]] * 3  # 448x448: 256 image tokens
    assert conversation("sky").count(REWARD_TOKEN) == 1
    want = ref(**theirs)  # [3, 2]
    got = scorer(images, prompts)
    assert got.shape == (3,)
    assert torch.allclose(got, want[:, 0], atol=1e-5), (got, want)
    assert not torch.allclose(want[:, 0], want[:1, 0])  # different images, different scores
    one_by_one = torch.cat([scorer(images[i : i + 1], prompts[i : i + 1]) for i in range(3)])
    assert torch.allclose(got, one_by_one, atol=1e-5)
    # transformers' own 3-D (M-RoPE) image positions would move the scores: HPSv3 never used them
    mm = (ours["input_ids"] == scorer.model.backbone.config.image_token_id).int()
    with torch.no_grad():
        h = scorer.model.backbone(**ours, mm_token_type_ids=mm).last_hidden_state
        mrope = scorer.model.head(h[ours["input_ids"] == scorer.reward_id])[:, 0]
    assert not torch.allclose(mrope, want[:, 0], atol=1e-3)


@pytest.mark.slow
def test_the_reward_batches_frames_and_isolates_a_failing_sample(hpsv3):
    from groupflow.diffusion.hpsv3 import HPSv3Scorer
    from groupflow.diffusion.rewards import score_in_batches, select_frames

    file, base, _ = hpsv3
    spec = {"name": "image_scorer", "kwargs": {"path": str(file.parent), "kind": "hpsv3",
            "processor_path": str(base), "frames": 2, "batch_size": 4}}  # fmt: skip
    runner = build_reward_runner([spec])
    g = torch.Generator().manual_seed(1)
    videos = [torch.rand(3, 4, 16, 16, generator=g) for _ in range(3)]
    prompts = ["a red fox", "a dog", "sky"]
    scorer = HPSv3Scorer(file, processor_path=base)
    calls = []
    real = scorer.model.backbone.forward
    scorer.model.backbone.forward = lambda *a, **k: calls.append(1) or real(*a, **k)
    # frames 0 and 2 of each video, each against its own prompt, averaged
    want = [float(scorer(v[:, ::2].permute(1, 0, 2, 3), [p] * 2).mean()) for v, p in zip(videos, prompts)]  # fmt: skip
    assert runner(prompts, videos).total.tolist() == pytest.approx(want, abs=1e-5)
    calls.clear()
    chosen = [select_frames(v, 2) for v in videos]
    assert score_in_batches(scorer, chosen, prompts, 4) == pytest.approx(want, abs=1e-5)
    assert len(calls) == 2  # 6 frames, 4 per forward
    first = build_reward_runner([spec | {"kwargs": spec["kwargs"] | {"frames": "first"}}])
    want_first = scorer(torch.stack([v[:, 0] for v in videos]), prompts).tolist()
    assert first(prompts, videos).total.tolist() == pytest.approx(want_first, abs=1e-5)
    bad = videos[1].clone()
    bad[0, 0, 0, 0] = float("nan")
    result = runner(prompts, [videos[0], bad, videos[2]])
    assert result.metrics["reward/image_scorer/failures"] == 1.0
    assert result.total[0].item() == pytest.approx(want[0], abs=1e-5)
    assert result.total[2].item() == pytest.approx(want[2], abs=1e-5)


@pytest.mark.slow
def test_a_pickled_state_dict_in_the_later_layout_scores_alike(hpsv3, tmp_path):
    """What HPSv3's trainer saves (torch.save of the model's state dict, here under "model" and
    with transformers' later key names) loads into the same scorer and gives the same scores."""
    from groupflow.diffusion.hpsv3 import HPSv3Scorer

    file, base, ref = hpsv3
    torch.save({"model": ref.net.state_dict()}, tmp_path / "final_model.pth")
    images, prompts = _frames(2, 3), ["a", "b"]
    a = HPSv3Scorer(file, processor_path=base)(images, prompts)
    b = HPSv3Scorer(tmp_path / "final_model.pth", processor_path=base)(images, prompts)
    assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.slow
def test_a_bad_checkpoint_is_refused_naming_file_and_key(hpsv3, tmp_path):
    from safetensors.torch import load_file, save_file

    from groupflow.diffusion.hpsv3 import HPSv3Scorer

    file, base, _ = hpsv3
    state = load_file(str(file))

    def write(name, tensors):
        save_file(tensors, str(tmp_path / name))
        return tmp_path / name

    no_head = write("no_head.safetensors", {k: v for k, v in state.items() if "rm_head" not in k})
    with pytest.raises(RewardConfigError, match=r"no_head\.safetensors' has no tensor for 'head\.0\.weight'"):  # fmt: skip
        HPSv3Scorer(no_head, processor_path=base)
    wrong = write("wrong.safetensors", state | {"rm_head.5.weight": torch.zeros(3, 16)})
    with pytest.raises(RewardConfigError, match=r"wrong\.safetensors': tensor 'head\.5\.weight' has shape \[3, 16\].*expects \[2, 16\]"):  # fmt: skip
        HPSv3Scorer(wrong, processor_path=base)
    extra = write("extra.safetensors", state | {"rm_head.9.weight": torch.zeros(2)})
    with pytest.raises(RewardConfigError, match=r"extra\.safetensors' has a tensor 'head\.9\.weight'"):  # fmt: skip
        HPSv3Scorer(extra, processor_path=base)
    (tmp_path / "two").mkdir()
    for name in ("a.safetensors", "b.pth"):
        (tmp_path / "two" / name).write_bytes(b"")
    with pytest.raises(RewardConfigError, match="holds 2 checkpoint files"):
        HPSv3Scorer(tmp_path / "two", processor_path=base)
    with pytest.raises(RewardConfigError, match=r"kwargs\.processor_path \(the Qwen2-VL base\)"):
        HPSv3Scorer(file)
    scorer = HPSv3Scorer(file, processor_path=base)
    with pytest.raises(ValueError, match=r"prompt 1 gives 2 <\|Reward\|> tokens, not 1"):
        scorer(_frames(2, 0), ["fine", f"a {REWARD_TOKEN} in the prompt"])
    with pytest.raises(RewardConfigError, match="processor_path .* does not exist"):
        build_reward_runner([{"name": "image_scorer", "kwargs": {
            "kind": "hpsv3", "path": str(file), "processor_path": str(tmp_path / "nope")}}])  # fmt: skip


@pytest.mark.slow
def test_hub_ids_resolve_through_the_cache_and_the_base_defaults_to_qwen2_vl(
    hpsv3, tmp_path, monkeypatch
):
    """``path: MizzenAI/HPSv3`` and no processor_path (HPSv3's base, Qwen/Qwen2-VL-7B-Instruct)
    resolve through an offline HF cache built here; not cached, the error names the key, the id
    and the download command."""
    import shutil

    from groupflow.diffusion.hpsv3 import HPSv3Scorer
    from groupflow.diffusion.rewards import make_image_scorer_reward
    from groupflow.utils.hub import HubError
    from tests.utils.test_hub import _snapshot

    file, base, _ = hpsv3
    home = tmp_path / "hf_home"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match=r"kwargs\.path: 'MizzenAI/HPSv3' is neither .*hf download MizzenAI/HPSv3"):  # fmt: skip
        make_image_scorer_reward(path="MizzenAI/HPSv3", kind="hpsv3")
    shutil.copy(file, _snapshot(home, "MizzenAI/HPSv3", "a" * 40) / file.name)
    with pytest.raises(HubError, match=r"processor_path: 'Qwen/Qwen2-VL-7B-Instruct' is neither"):
        make_image_scorer_reward(path="MizzenAI/HPSv3", kind="hpsv3")
    shutil.copytree(
        base, _snapshot(home, "Qwen/Qwen2-VL-7B-Instruct", "b" * 40), dirs_exist_ok=True
    )
    reward = make_image_scorer_reward(path="MizzenAI/HPSv3", kind="hpsv3")
    images = list(_frames(2, 5))
    want = HPSv3Scorer(file, processor_path=base)(torch.stack(images), ["a", "b"])
    assert reward(["a", "b"], images) == pytest.approx(want.tolist(), abs=1e-6)


@pytest.mark.slow
def test_bf16_rotary_tables_are_those_of_the_reference_after_model_to_bf16(hpsv3, tmp_path):
    """HPSv3 runs on transformers 4.45 after model.to(torch.bfloat16): its rotary inv_freq buffers
    are bf16. The language model then computes its angles in fp32 from the rounded frequencies;
    the vision tower computes torch.outer(arange(n, dtype=bf16), inv_freq) and its cos/sin in
    bf16 (transformers 4.45.2, qwen2_vl: Qwen2VLRotaryEmbedding, VisionRotaryEmbedding and
    apply_rotary_pos_emb_vision)."""
    from safetensors.torch import save_file

    from groupflow.diffusion.hpsv3 import HPSv3Scorer

    file, base, ref = hpsv3
    bf16 = torch.bfloat16
    state = {k: v.to(bf16) for k, v in ref.release_state().items()}
    save_file(state, str(tmp_path / "HPSv3.safetensors"))
    scorer = HPSv3Scorer(tmp_path / "HPSv3.safetensors", processor_path=base)
    backbone, config = scorer.model.backbone, scorer.model.backbone.config

    def inverse(dim):  # a fresh model's fp32 inv_freq (rope_theta 10000)
        return 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))

    # language model: positions 0..2999 on all three M-RoPE axes, as the scorer passes them
    inv = inverse(config.text_config.hidden_size // config.text_config.num_attention_heads)
    pos = torch.arange(3000)[None]

    def lm_tables(inv_freq):
        freqs = pos[..., None].float() * inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(bf16), emb.sin().to(bf16)

    cos, sin = backbone.language_model.rotary_emb(torch.zeros(1, dtype=bf16), pos)
    want_cos, want_sin = lm_tables(inv.to(bf16))
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert not torch.equal(cos, lm_tables(inv)[0])  # fp32 frequencies: other tables

    # vision tower: (h, w) patch positions, beyond 256 where bf16 rounds the positions too
    v = config.vision_config
    vinv = inverse(v.embed_dim // v.num_heads // 2)
    hw = torch.stack([torch.arange(300), torch.arange(300).flip(0)], dim=-1)  # [N, 2]

    def vision_tables(inv_freq, dtype):  # 4.45: rot_pos_emb, then apply_rotary_pos_emb_vision
        full = torch.outer(torch.arange(300, dtype=dtype), inv_freq.to(dtype))
        freqs = full[hw].flatten(1)
        return freqs.cos().repeat(1, 2).float(), freqs.sin().repeat(1, 2).float()

    cos, sin = backbone.visual.rotary_pos_emb(torch.zeros(1), hw)
    want_cos, want_sin = vision_tables(vinv, bf16)
    assert torch.equal(cos.float(), want_cos) and torch.equal(sin.float(), want_sin)
    assert not torch.equal(cos.float(), vision_tables(vinv, torch.float32)[0])
    # and the scorer runs on them
    assert torch.isfinite(scorer(_frames(2, 3), ["a red fox", "sky"])).all()
