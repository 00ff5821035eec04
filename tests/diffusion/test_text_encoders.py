"""The image kinds' text encoders (groupflow.diffusion.text_encoders) against their pipelines.

Tiny random CLIP-L + CLIP-G + T5 (SD3), CLIP + T5 (FLUX.1) and Qwen3 (Z-Image) models and word-level tokenizers are saved in
the pipelines' folder layout; each encoder's output is compared with the pipeline's own
``encode_prompt``, the pipeline object built with only those parts."""

import pytest
import torch

from groupflow.diffusion.kinds import z_image_captions
from groupflow.policies.diffusion import FlowModelSpec

pytestmark = pytest.mark.slow  # transformers' and diffusers' imports dominate; the models are tiny

WORDS = ["a", "cat", "dog", "dancing", "on", "stage", "red", "car"]
PROMPTS = ["a cat dancing", "red car on a stage dancing dog cat a cat"]  # the second truncates
# Qwen3's chat template cut down to what ZImagePipeline asks of it (enable_thinking visible)
CHAT = ("{% for m in messages %}start {{ m['role'] }} {{ m['content'] }} end {% endfor %}"
        "{% if add_generation_prompt %}start assistant{% if enable_thinking %} think{% endif %}"
        "{% endif %}")  # fmt: skip


def _tokenizer(path, specials, template, chat_template=None, max_length=None):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = specials + WORDS + ["start", "end", "user", "assistant", "think"]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials[-1]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if template:
        tok.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[(s, vocab[s]) for s in specials if s in template]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=specials[0], eos_token=specials[1], unk_token=specials[-1],
        model_max_length=max_length or 10**6, chat_template=chat_template,
    )  # fmt: skip
    fast.save_pretrained(path)
    return len(vocab)


def flux_parts(root, t5_dim=16, clip_dim=8):
    """``text_encoder/`` (CLIP), ``tokenizer/``, ``text_encoder_2/`` (T5), ``tokenizer_2/``."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    n = _tokenizer(root / "tokenizer", ["<pad>", "<eot>", "<sot>", "<unk>"], "<sot> $A <eot>",
                   max_length=6)  # CLIP's model_max_length (77 in FLUX.1) shrunk  # fmt: skip
    torch.manual_seed(0)
    CLIPTextModel(CLIPTextConfig(
        vocab_size=n, hidden_size=clip_dim, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=6, bos_token_id=2, eos_token_id=1,
        pad_token_id=0,
    )).save_pretrained(root / "text_encoder")  # fmt: skip
    n = _tokenizer(root / "tokenizer_2", ["<pad>", "</s>", "<unk>"], "$A </s>")
    T5EncoderModel(
        T5Config(vocab_size=n, d_model=t5_dim, d_kv=4, num_heads=2, num_layers=1, d_ff=16)
    ).save_pretrained(root / "text_encoder_2")
    return root / "text_encoder"


def sd3_parts(root, clip_dims=(4, 8), t5_dim=16, t5=True):
    """``text_encoder/`` (CLIP-L), ``text_encoder_2/`` (CLIP-G), both
    ``CLIPTextModelWithProjection`` with 4-wide projections, their tokenizers (CLIP-G's longer:
    the pipeline pads both to CLIP-L's length), and ``text_encoder_3/`` (T5) + ``tokenizer_3/``."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(0)
    for i, (suffix, dim) in enumerate(zip(("", "_2"), clip_dims, strict=True)):
        n = _tokenizer(root / f"tokenizer{suffix}", ["<pad>", "<eot>", "<sot>", "<unk>"],
                       "<sot> $A <eot>", max_length=6 + 4 * i)  # fmt: skip
        CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=n, hidden_size=dim, intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=10, bos_token_id=2, eos_token_id=1,
            pad_token_id=0,
            projection_dim=4,
        )).save_pretrained(root / f"text_encoder{suffix}")  # fmt: skip
    if t5:
        n = _tokenizer(root / "tokenizer_3", ["<pad>", "</s>", "<unk>"], "$A </s>")
        T5EncoderModel(
            T5Config(vocab_size=n, d_model=t5_dim, d_kv=4, num_heads=2, num_layers=1, d_ff=16)
        ).save_pretrained(root / "text_encoder_3")
    return root / "text_encoder"


def tiny_sd3(path):
    from diffusers import SD3Transformer2DModel

    from tests.diffusion.test_models import _sd3

    return SD3Transformer2DModel.from_pretrained(_sd3(path))


@pytest.mark.parametrize("t5", [True, False], ids=["clip-t5", "clip-only"])
def test_sd3_embeddings_are_the_pipelines(tmp_path, t5):
    from diffusers import StableDiffusion3Pipeline
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

    from groupflow.diffusion.text_encoders import load_text_encoder

    torch.set_num_threads(1)
    clip = sd3_parts(tmp_path, t5=t5)
    parts = {"text_encoder_path": str(clip), "max_sequence_length": 8}
    if t5:
        parts["text_encoder_3_path"] = str(tmp_path / "text_encoder_3")
    enc = load_text_encoder("sd3", parts, width=16)
    out = enc(PROMPTS)

    def part(name, cls):
        return cls.from_pretrained(tmp_path / name) if (tmp_path / name).is_dir() else None

    pipe = StableDiffusion3Pipeline(
        tiny_sd3(tmp_path), None, None,
        part("text_encoder", CLIPTextModelWithProjection), part("tokenizer", AutoTokenizer),
        part("text_encoder_2", CLIPTextModelWithProjection), part("tokenizer_2", AutoTokenizer),
        part("text_encoder_3", T5EncoderModel), part("tokenizer_3", AutoTokenizer),
    )  # fmt: skip
    with torch.no_grad():
        hidden, null, pooled, null_pooled = pipe.encode_prompt(
            PROMPTS, None, None, torch.device("cpu"), max_sequence_length=8
        )
    # 6 CLIP tokens (CLIP-L's length) then 8 of T5; CLIP-L's 4 and CLIP-G's 8 features padded
    assert out["encoder_hidden_states"].shape == (2, 6 + 8, 16) and enc.dim == 16
    assert out["pooled_projections"].shape == (2, 8) and enc.pooled_dim == 8
    assert torch.allclose(out["encoder_hidden_states"], hidden, atol=1e-6)
    assert torch.allclose(out["pooled_projections"], pooled, atol=1e-6)
    assert bool((out["encoder_hidden_states"][:, :6, 12:] == 0).all())  # the zero padding
    assert bool((out["encoder_hidden_states"][:, 6:] == 0).all()) != t5  # T5's part, or zeros
    assert torch.allclose(enc.null(2)["encoder_hidden_states"], null, atol=1e-6)
    assert torch.allclose(enc.null(2)["pooled_projections"], null_pooled, atol=1e-6)


def test_sd3_text_encoders_condition_the_flow_model_and_bad_parts_name_the_key(tmp_path):
    from tests.diffusion.test_models import _sd3

    torch.set_num_threads(1)
    sd3 = _sd3(tmp_path)  # joint_attention_dim=16, pooled_projection_dim=8
    clip = sd3_parts(tmp_path / "parts")
    parts = {"text_encoder_path": str(clip), "max_sequence_length": 8}
    for t5 in (None, str(clip.parent / "text_encoder_3")):  # without T5: its zeros
        model = FlowModelSpec("sd3", str(sd3), [4, 8, 8],
                              {**parts, "text_encoder_3_path": t5}).build()  # fmt: skip
        with torch.no_grad():
            v = model(torch.randn(2, 4, 8, 8), torch.tensor([0.5, 0.7]), model.encode(PROMPTS))
        assert v.shape == (2, 4, 8, 8) and bool(v.isfinite().all())
    wide = sd3_parts(tmp_path / "wide", t5_dim=24)
    with pytest.raises(ValueError, match="text_encoder_3_path: its embeddings have 24 features; "
                       ".* joint_attention_dim=16"):  # fmt: skip
        FlowModelSpec("sd3", str(sd3), [4, 8, 8], {"text_encoder_path": str(wide),
                      "text_encoder_3_path": str(wide.parent / "text_encoder_3")}).build()  # fmt: skip
    wide = sd3_parts(tmp_path / "wide_clip", clip_dims=(8, 12), t5=False)
    with pytest.raises(ValueError, match="text_encoder_path \\+ diffusion.model.text_encoder_2_path:"
                       " .* 20 wide together, wider than the T5 part's 16"):  # fmt: skip
        FlowModelSpec("sd3", str(sd3), [4, 8, 8], {"text_encoder_path": str(wide)}).build()


def z_image_parts(root, dim=16):
    """``text_encoder/`` (a Qwen3 causal LM, as Z-Image-Turbo's) and ``tokenizer/``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    n = _tokenizer(root / "tokenizer", ["<pad>", "<eos>", "<unk>"], None, chat_template=CHAT)
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(
        vocab_size=n, hidden_size=dim, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8,
    )).save_pretrained(root / "text_encoder")  # fmt: skip
    return root / "text_encoder"


def qwen_image_parts(root, dim=16):
    """``text_encoder/`` (a Qwen2.5-VL, as Qwen-Image's, vision tower included) and
    ``tokenizer/``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    n = _tokenizer(root / "tokenizer", ["<pad>", "<eos>", "<unk>"], None)
    torch.manual_seed(0)
    text = {"vocab_size": n, "hidden_size": dim, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2,
            "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, dim // 8]}}  # fmt: skip
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
              "out_hidden_size": dim, "fullatt_block_indexes": [0]}  # fmt: skip
    Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    ).save_pretrained(root / "text_encoder")
    return root / "text_encoder"


# Mistral's chat template cut down to text parts (what Flux2Pipeline's format_input makes)
MISTRAL_CHAT = ("{% for m in messages %}start {{ m['role'] }} {% for c in m['content'] %}"
                "{{ c['text'] }}{% endfor %} end {% endfor %}")  # fmt: skip


def flux2_parts(root, dim=8, klein=False):
    """``text_encoder/`` (FLUX.2-dev's Mistral3 with a Pixtral tower, or klein's Qwen3 causal LM;
    31 / 28 layers so the pipeline's hidden-state indices exist) and ``tokenizer/``."""
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    n = _tokenizer(root / "tokenizer", ["<pad>", "<eos>", "<unk>"], None,
                   chat_template=CHAT if klein else MISTRAL_CHAT)  # fmt: skip
    torch.manual_seed(0)
    text = {"vocab_size": n, "hidden_size": dim, "intermediate_size": 16, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 4}  # fmt: skip
    if klein:
        model = Qwen3ForCausalLM(Qwen3Config(**text, num_hidden_layers=28))
    else:
        vision = {"model_type": "pixtral", "hidden_size": 8, "intermediate_size": 16,
                  "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 4,
                  "image_size": 16, "patch_size": 4}  # fmt: skip
        text = {**text, "model_type": "mistral", "num_hidden_layers": 30}
        model = Mistral3ForConditionalGeneration(
            Mistral3Config(text_config=text, vision_config=vision)
        )
    model.save_pretrained(root / "text_encoder")
    return root / "text_encoder"


def test_flux_embeddings_are_the_pipelines(tmp_path):
    from diffusers import FluxPipeline
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    from groupflow.diffusion.text_encoders import FluxTextEncoder

    torch.set_num_threads(1)
    clip = flux_parts(tmp_path)
    enc = FluxTextEncoder(clip, max_sequence_length=8)
    out = enc(PROMPTS)
    pipe = FluxPipeline(
        None, None, CLIPTextModel.from_pretrained(clip), AutoTokenizer.from_pretrained(tmp_path / "tokenizer"),
        T5EncoderModel.from_pretrained(tmp_path / "text_encoder_2"),
        AutoTokenizer.from_pretrained(tmp_path / "tokenizer_2"), None,
    )  # fmt: skip
    with torch.no_grad():
        hidden, pooled, _ = pipe.encode_prompt(PROMPTS, None, torch.device("cpu"),
                                               max_sequence_length=8)  # fmt: skip
        null = pipe.encode_prompt(["", ""], None, torch.device("cpu"), max_sequence_length=8)
    assert out["encoder_hidden_states"].shape == (2, 8, 16) and out["pooled_projections"].shape == (
        2,
        8,
    )
    assert torch.allclose(out["encoder_hidden_states"], hidden, atol=1e-6)
    assert torch.allclose(out["pooled_projections"], pooled, atol=1e-6)
    assert not torch.allclose(pooled[0], pooled[1])  # CLIP sees the prompts
    assert torch.allclose(enc.null(2)["encoder_hidden_states"], null[0], atol=1e-6)
    assert torch.allclose(enc.null(2)["pooled_projections"], null[1], atol=1e-6)


def test_z_image_captions_are_the_pipelines(tmp_path):
    from diffusers import ZImagePipeline
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from groupflow.diffusion.text_encoders import ZImageTextEncoder

    torch.set_num_threads(1)
    path = z_image_parts(tmp_path)
    enc = ZImageTextEncoder(path, max_sequence_length=12)
    out = enc(PROMPTS)
    pipe = ZImagePipeline(None, None, Qwen3ForCausalLM.from_pretrained(path),
                          AutoTokenizer.from_pretrained(tmp_path / "tokenizer"), None)  # fmt: skip
    with torch.no_grad():
        want, negative = pipe.encode_prompt(list(PROMPTS), torch.device("cpu"),
                                            max_sequence_length=12)  # fmt: skip
    mask = out["encoder_hidden_states_mask"]
    assert out["encoder_hidden_states"].shape == (2, 12, 16)
    assert mask.sum(1).tolist() == [9, 12]  # "start user a cat dancing end start assistant think"
    got = z_image_captions(out["encoder_hidden_states"], mask)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and torch.allclose(g, w, atol=1e-5)
    null = enc.null(2)
    for g, w in zip(z_image_captions(null["encoder_hidden_states"], null["encoder_hidden_states_mask"]), negative, strict=True):  # fmt: skip
        assert torch.allclose(g, w, atol=1e-5)
    assert bool((out["encoder_hidden_states"][0, 9:] == 0).all())


def test_qwen_image_embeddings_and_mask_are_the_pipelines(tmp_path):
    from diffusers import QwenImagePipeline
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from groupflow.diffusion.text_encoders import QWEN_IMAGE_DROP, QwenImageTextEncoder

    torch.set_num_threads(1)
    path = qwen_image_parts(tmp_path)
    enc = QwenImageTextEncoder(path, max_sequence_length=16)
    out = enc(PROMPTS)
    pipe = QwenImagePipeline(None, None, Qwen2_5_VLForConditionalGeneration.from_pretrained(path),
                             AutoTokenizer.from_pretrained(tmp_path / "tokenizer"), None)  # fmt: skip
    # the template's leading tokens under this tokenizer: what is left after the drop is ours
    assert len(pipe.tokenizer(pipe.prompt_template_encode.format("")).input_ids) > QWEN_IMAGE_DROP
    with torch.no_grad():
        want, want_mask = pipe.encode_prompt(list(PROMPTS), torch.device("cpu"),
                                             max_sequence_length=16)  # fmt: skip
        null, _ = pipe.encode_prompt(["", ""], torch.device("cpu"), max_sequence_length=16)
    assert out["encoder_hidden_states"].shape == (2, 16, 16)
    mask = out["encoder_hidden_states_mask"]
    assert mask.sum(1)[0] < 16 and mask.sum(1)[1] == 16  # the second prompt is truncated
    assert torch.equal(mask[:, : want.shape[1]], want_mask.long())
    assert torch.allclose(out["encoder_hidden_states"][:, : want.shape[1]], want, atol=1e-5)
    assert bool((out["encoder_hidden_states"][mask == 0] == 0).all())
    short = enc.null(2)
    n = null.shape[1]
    assert torch.allclose(short["encoder_hidden_states"][:, :n], null, atol=1e-5)
    assert int(short["encoder_hidden_states_mask"].sum()) == 2 * n


@pytest.mark.parametrize("klein", [False, True], ids=["dev-mistral3", "klein-qwen3"])
def test_flux2_embeddings_are_the_pipelines(tmp_path, klein):
    from diffusers import Flux2KleinPipeline, Flux2Pipeline
    from transformers import (
        AutoProcessor,
        Mistral3ForConditionalGeneration,
        Qwen3ForCausalLM,
    )

    from groupflow.diffusion.text_encoders import Flux2TextEncoder

    torch.set_num_threads(1)
    path = flux2_parts(tmp_path, klein=klein)
    enc = Flux2TextEncoder(path, max_sequence_length=48)
    out = enc(PROMPTS)
    cls = (Qwen3ForCausalLM if klein else Mistral3ForConditionalGeneration).from_pretrained(path)
    tokenizer = AutoProcessor.from_pretrained(tmp_path / "tokenizer")
    pipe = (Flux2KleinPipeline if klein else Flux2Pipeline)(None, None, cls, tokenizer, None)
    with torch.no_grad():
        want, _ = pipe.encode_prompt(list(PROMPTS), torch.device("cpu"), max_sequence_length=48)
        null, _ = pipe.encode_prompt(["", ""], torch.device("cpu"), max_sequence_length=48)
    assert out["encoder_hidden_states"].shape == (2, 48, 24) and enc.dim == 24
    assert torch.allclose(out["encoder_hidden_states"], want, atol=1e-5)
    assert not torch.allclose(want[0], want[1])  # the prompts are inside the 48 tokens
    assert torch.allclose(enc.null(2)["encoder_hidden_states"], null, atol=1e-5)


def test_text_encoder_path_conditions_the_flow_model_and_bad_widths_name_the_key(tmp_path):
    from diffusers import (
        Flux2Transformer2DModel,
        FluxTransformer2DModel,
        QwenImageTransformer2DModel,
        ZImageTransformer2DModel,
    )

    from groupflow.diffusion.models import ModelPathError
    from tests.diffusion.test_flux import TINY_FLUX
    from tests.diffusion.test_flux2 import TINY_FLUX2
    from tests.diffusion.test_qwen_image import TINY_QWEN_IMAGE
    from tests.diffusion.test_z_image import TINY_Z_IMAGE

    torch.set_num_threads(1)
    torch.manual_seed(0)
    FluxTransformer2DModel(**TINY_FLUX).save_pretrained(tmp_path / "flux")
    ZImageTransformer2DModel(**TINY_Z_IMAGE).save_pretrained(tmp_path / "z_image")
    QwenImageTransformer2DModel(**TINY_QWEN_IMAGE).save_pretrained(tmp_path / "qwen_image")
    clip = flux_parts(tmp_path / "flux_parts")
    spec = FlowModelSpec(
        "flux", str(tmp_path / "flux"), [4, 8, 8], {"text_encoder_path": str(clip)}
    )
    model = spec.build()
    cond = model.encode(PROMPTS)
    with torch.no_grad():
        assert model(torch.randn(2, 4, 8, 8), torch.tensor([0.5, 0.7]), cond).shape == (2, 4, 8, 8)
    qwen3 = z_image_parts(tmp_path / "z_parts")
    parts = {"text_encoder_path": str(qwen3), "max_sequence_length": 12}
    model = FlowModelSpec("z_image", str(tmp_path / "z_image"), [4, 8, 8], parts).build()
    with torch.no_grad():
        v = model(torch.randn(2, 4, 8, 8), torch.tensor([0.5, 0.7]), model.encode(PROMPTS))
    assert v.shape == (2, 4, 8, 8)
    qwen = qwen_image_parts(tmp_path / "q_parts")
    parts = {"text_encoder_path": str(qwen), "max_sequence_length": 16}
    model = FlowModelSpec("qwen_image", str(tmp_path / "qwen_image"), [4, 8, 8], parts).build()
    cond, x, sigma = (
        model.encode(["a cat", "dog"]),
        torch.randn(2, 4, 8, 8),
        torch.tensor([0.5, 0.7]),
    )
    n = int(cond["encoder_hidden_states_mask"].sum(1).max())  # the pipeline pads to the longest
    short = {k: v[:, :n] for k, v in cond.items()}
    with torch.no_grad():
        v = model(x, sigma, cond)
        assert n < 16 and torch.allclose(v, model(x, sigma, short), atol=1e-5)  # padding is inert

    Flux2Transformer2DModel(**{**TINY_FLUX2, "joint_attention_dim": 24}).save_pretrained(
        tmp_path / "flux2"
    )  # three 8-wide hidden states per token
    parts = {
        "text_encoder_path": str(flux2_parts(tmp_path / "f2_parts")),
        "max_sequence_length": 48,
    }
    model = FlowModelSpec("flux2", str(tmp_path / "flux2"), [16, 4, 4], parts).build()
    with torch.no_grad():
        v = model(torch.randn(2, 16, 4, 4), torch.tensor([0.5, 0.7]), model.encode(PROMPTS))
    assert v.shape == (2, 16, 4, 4) and bool(v.isfinite().all())
    parts = {"text_encoder_path": str(flux2_parts(tmp_path / "f2_wide", dim=4))}
    with pytest.raises(
        ValueError, match="text_encoder_path: .* 12 features; .* joint_attention_dim=24"
    ):
        FlowModelSpec("flux2", str(tmp_path / "flux2"), [16, 4, 4], parts).build()
    with pytest.raises(
        ValueError,
        match="text_encoder_path: .* holds a T5EncoderModel \\(model_type t5\\), "
        "but diffusion.model.kind 'flux2' takes a Mistral3 \\(dev\\) or Qwen3",
    ):
        FlowModelSpec("flux2", str(tmp_path / "flux2"), [16, 4, 4],
                      {"text_encoder_path": str(clip.parent / "text_encoder_2")}).build()  # fmt: skip

    wide = flux_parts(tmp_path / "wide", clip_dim=12)
    with pytest.raises(ValueError, match="text_encoder_path: its embeddings have 12 features; .* "
                       "pooled_projection_dim=8"):  # fmt: skip
        FlowModelSpec(
            "flux", str(tmp_path / "flux"), [4, 8, 8], {"text_encoder_path": str(wide)}
        ).build()
    wide = flux_parts(tmp_path / "wide_t5", t5_dim=24)
    with pytest.raises(ValueError, match="text_encoder_2_path: its embeddings have 24 features; "
                       ".* joint_attention_dim=16"):  # fmt: skip
        FlowModelSpec(
            "flux", str(tmp_path / "flux"), [4, 8, 8], {"text_encoder_path": str(wide)}
        ).build()
    wide = z_image_parts(tmp_path / "wide_z", dim=24)
    with pytest.raises(
        ValueError, match="text_encoder_path: its embeddings have 24 .* cap_feat_dim=16"
    ):
        FlowModelSpec(
            "z_image", str(tmp_path / "z_image"), [4, 8, 8], {"text_encoder_path": str(wide)}
        ).build()
    wide = qwen_image_parts(tmp_path / "wide_q", dim=24)
    with pytest.raises(ValueError, match="text_encoder_path: .* 24 .* joint_attention_dim=16"):
        FlowModelSpec(
            "qwen_image", str(tmp_path / "qwen_image"), [4, 8, 8], {"text_encoder_path": str(wide)}
        ).build()
    parts = {"text_encoder_path": str(clip), "text_encoder_2_path": str(tmp_path)}
    with pytest.raises(
        ModelPathError, match="text_encoder_2_path: .* not a local T5EncoderModel text encoder"
    ):
        FlowModelSpec("flux", str(tmp_path / "flux"), [4, 8, 8], parts).build()


@pytest.mark.parametrize(
    "keys,message",
    [
        ({"kind": "tiny", "text_encoder_path": "t"}, "text_encoder_path is for kinds sd3, wan, flux, qwen_image, z_image, flux2 .*not 'tiny'"),
        ({"kind": "wan", "text_encoder_2_path": "t", "text_encoder_path": "c"}, "text_encoder_2_path is SD3's CLIP-G .* or FLUX.1's T5 .*not 'wan'"),
        ({"kind": "flux", "tokenizer_2_path": "t"}, "tokenizer_2_path needs diffusion.model.text_encoder_path"),
        ({"kind": "flux", "text_encoder_3_path": "t", "text_encoder_path": "c"}, "text_encoder_3_path is SD3's T5 .*not 'flux'"),
        ({"kind": "sd3", "text_encoder_3_path": "t"}, "text_encoder_3_path needs diffusion.model.text_encoder_path"),
        ({"kind": "tiny", "vae_path": "v"}, "vae_path is for kinds sd3, wan, flux, qwen_image, z_image, flux2 .*not 'tiny'"),
    ],
)  # fmt: skip
def test_part_keys_of_another_kind_are_refused_naming_them(keys, message):
    from groupflow.config.diffusion import DiffusionModelConfig

    with pytest.raises(ValueError, match=message):
        DiffusionModelConfig(path="m", latent_shape=[4, 8, 8], **keys)


def test_the_configs_kind_lists_are_the_wired_ones():
    from groupflow.config.diffusion import TEXT_ENCODER_KINDS, VAE_KINDS
    from groupflow.diffusion import text_encoders, vaes

    assert TEXT_ENCODER_KINDS == text_encoders.TEXT_ENCODER_KINDS
    assert set(VAE_KINDS) == set(vaes.VAE_CLASSES)
    with pytest.raises(ValueError, match="text_encoder_path: kind 'tiny' has no text encoder"):
        text_encoders.load_text_encoder("tiny", {"text_encoder_path": "t"})


def test_the_text_encoder_and_vae_load_on_the_device_given(tmp_path):
    from diffusers import AutoencoderKL

    from tests.diffusion.test_models import _sd3
    from tests.diffusion.test_vaes import KL

    torch.set_num_threads(1)
    clip = sd3_parts(tmp_path / "parts")
    AutoencoderKL(**KL).save_pretrained(tmp_path / "vae")
    parts = {"text_encoder_path": str(clip), "vae_path": str(tmp_path / "vae"),
             "text_encoder_3_path": str(clip.parent / "text_encoder_3")}  # fmt: skip
    for device in ("meta", "cpu"):  # meta: no accelerator needed to see where they went
        model = FlowModelSpec("sd3", str(_sd3(tmp_path)), [4, 8, 8], parts).build(device=device)
        enc, vae = model.prompt_encoder, model.decoder.vae
        parts_on = {m.device.type for m in (*enc.clips, enc.t5, vae)}
        assert parts_on == {device} and enc.device == device
        # the flow model's own parameters are placed by the worker, not here
        assert next(model.parameters()).device.type == "cpu"


def test_the_worker_builds_the_parts_on_its_own_device(monkeypatch):
    from groupflow.config import ActorConfig
    from groupflow.diffusion import worker
    from groupflow.diffusion.models import TinyFlowModel
    from groupflow.diffusion.worker import DiffusionSettings, DiffusionWorker

    built = []

    class Spec:
        path, kind = "unused", "tiny"

        def build(self, empty=False, **kwargs):
            built.append(kwargs.get("device"))
            return TinyFlowModel(["red", "blue"], image_size=8, width=8)

    ours = torch.device("cpu")  # what worker_device returns on this machine, made visible
    monkeypatch.setattr(worker, "worker_device", lambda rank: ours)
    settings, cfg = DiffusionSettings(num_steps=2), ActorConfig(lr=1e-3)
    for role in ("rollout", "actor"):
        DiffusionWorker.create(0, 1, spec=Spec(), settings=settings, cfg=cfg, total_steps=1,
                               role=role)  # fmt: skip
    assert len(built) == 2 and all(d is ours for d in built)


def test_text_encoder_folders_of_another_class_or_width_name_the_key_folder_and_both(tmp_path):
    from groupflow.diffusion.encoder_checks import check_text_encoder_folders
    from tests.diffusion.test_models import _sd3

    sd3 = _sd3(tmp_path)  # joint_attention_dim=16, pooled_projection_dim=8
    clip = sd3_parts(tmp_path / "sd3_parts")
    flux_clip = flux_parts(tmp_path / "flux_parts")  # a CLIPTextModel and a T5
    t5 = str(clip.parent / "text_encoder_3")
    check_text_encoder_folders("sd3", {"text_encoder_path": str(clip), "text_encoder_3_path": t5},
                               sd3)  # fmt: skip
    cases = [
        ({"text_encoder_path": str(flux_clip)}, "text_encoder_path: '.*flux_parts/text_encoder' "
         "holds a CLIPTextModel \\(model_type clip_text_model\\), but diffusion.model.kind 'sd3' "
         "takes a CLIPTextModelWithProjection"),
        ({"text_encoder_path": str(clip), "text_encoder_3_path": str(clip)},
         "text_encoder_3_path: '.*sd3_parts/text_encoder' holds a CLIPTextModelWithProjection .* "
         "takes a T5EncoderModel"),
        ({"text_encoder_path": str(clip), "text_encoder_2_path": str(tmp_path / "sd3")},
         "text_encoder_2_path: '.*sd3' holds no text encoder's config"),
    ]  # fmt: skip
    for parts, message in cases:
        with pytest.raises(ValueError, match=message):
            check_text_encoder_folders("sd3", parts, sd3)
    wide = sd3_parts(tmp_path / "wide", t5_dim=24)
    with pytest.raises(ValueError, match="text_encoder_3_path: its embeddings have 24 features; "
                       "the transformer at '.*sd3' takes joint_attention_dim=16 \\(text encoder: "
                       "'.*wide/text_encoder_3'\\)"):  # fmt: skip
        check_text_encoder_folders("sd3", {"text_encoder_path": str(wide),
                                   "text_encoder_3_path": str(wide.parent / "text_encoder_3")},
                                   sd3)  # fmt: skip
    with pytest.raises(ValueError, match="text_encoder_path: '.*flux_parts/text_encoder_2' holds "
                       "a T5EncoderModel .*kind 'flux' takes a CLIPTextModel"):  # fmt: skip
        check_text_encoder_folders("flux", {"text_encoder_path": str(flux_clip.parent /
                                   "text_encoder_2")}, sd3)  # fmt: skip
