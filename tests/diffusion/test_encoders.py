"""Wan's UMT5 text encoder and VAE decoder from tiny random checkpoints in the diffusers layout."""

import pytest
import torch

WORDS = ["a", "cat", "dog", "dancing", "on", "stage"]


def wan_parts(root, text_dim=16, z_dim=4):
    """``text_encoder/``, ``tokenizer/`` and ``vae/`` folders as in Wan-AI/*-Diffusers, tiny."""
    from diffusers import AutoencoderKLWan
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(root / "tokenizer")
    torch.manual_seed(0)
    cfg = UMT5Config(
        vocab_size=len(vocab), d_model=text_dim, d_kv=4, num_heads=2, num_layers=1, d_ff=16
    )
    UMT5EncoderModel(cfg).save_pretrained(root / "text_encoder")
    AutoencoderKLWan(
        base_dim=8, z_dim=z_dim, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
        latents_mean=[0.1 * i for i in range(z_dim)], latents_std=[1.0 + 0.5 * i for i in range(z_dim)],
    ).save_pretrained(root / "vae")  # fmt: skip
    return root / "text_encoder", root / "vae"


@pytest.mark.slow  # transformers' and diffusers' imports dominate; the models are tiny
def test_text_embeddings_follow_the_pipeline_and_the_vae_unnormalises(tmp_path):
    from transformers import UMT5EncoderModel

    from groupflow.diffusion.encoders import WanTextEncoder, WanVaeDecoder

    torch.set_num_threads(1)
    text, vae = wan_parts(tmp_path)
    enc = WanTextEncoder(text, max_sequence_length=8)
    out = enc(["a  cat dancing", "dog &amp; cat"])["encoder_hidden_states"]
    assert out.shape == (2, 8, 16)
    # "a cat dancing </s>": 4 tokens from the model over the padded input, then zeros
    raw = UMT5EncoderModel.from_pretrained(text)
    ids = torch.tensor([[3, 4, 6, 1, 0, 0, 0, 0]])
    ref = raw(ids, (ids > 0).long()).last_hidden_state
    assert torch.allclose(out[0, :4], ref[0, :4], atol=1e-6)
    assert bool((out[0, 4:] == 0).all()) and bool((out[1, 4:] == 0).all())  # "dog & cat" → 4 tokens
    assert torch.equal(enc.null(2)["encoder_hidden_states"][:, 1:], torch.zeros(2, 7, 16))
    dec = WanVaeDecoder(vae)
    z = torch.randn(2, 4, 3, 8, 8)
    video = dec(z)
    std = torch.tensor([1.0, 1.5, 2.0, 2.5]).view(1, 4, 1, 1, 1)
    mean = torch.tensor([0.0, 0.1, 0.2, 0.3]).view(1, 4, 1, 1, 1)
    want = dec.vae.decode(z * std + mean, return_dict=False)[0]
    assert torch.allclose(video, ((want + 1) / 2).clamp(0, 1), atol=1e-6)
    assert video.shape == (2, 3, 5, 16, 16)


@pytest.mark.slow
def test_parts_that_do_not_fit_the_transformer_name_the_key(tmp_path):
    from groupflow.diffusion.models import ModelPathError
    from groupflow.policies.diffusion import FlowModelSpec
    from tests.diffusion.test_mmdancegrpo import _tiny_wan

    text, vae = wan_parts(tmp_path / "parts", text_dim=8, z_dim=6)
    model = _tiny_wan(tmp_path / "wan")
    with pytest.raises(
        ValueError, match="text_encoder_path: its embeddings have 8 features; .* text_dim=16"
    ):
        FlowModelSpec("wan", str(model), [4, 3, 8, 8], {"text_encoder_path": str(text)}).build()
    with pytest.raises(ValueError, match="vae_path: the VAE decodes 6-channel latents; .* has 4"):
        FlowModelSpec("wan", str(model), [4, 3, 8, 8], {"vae_path": str(vae)}).build()
    with pytest.raises(
        ModelPathError, match="diffusion.model.vae_path: .* is not a local AutoencoderKLWan"
    ):
        FlowModelSpec("wan", str(model), [4, 3, 8, 8], {"vae_path": str(tmp_path)}).build()
