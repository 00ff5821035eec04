"""Tests for groupflow.data.tokenizer.train_char_tokenizer."""

import pytest
from transformers import AutoTokenizer

from groupflow.data.tokenizer import DEFAULT_ALPHABET, train_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_char_tokenizer()


def test_one_id_per_character_and_exact_decode(tok):
    text = "reverse 123 ="
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)
    assert ids[7] == tok.convert_tokens_to_ids(" ") and ids[8] == tok.convert_tokens_to_ids("1")
    assert tok.decode(ids) == text
    multi = "a  b\n\n{x}: 9.5!"
    assert tok.decode(tok(multi)["input_ids"]) == multi


def test_special_tokens_and_vocab(tok):
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id] == [0, 1, 2, 3]
    assert len(tok) == 4 + len(set(DEFAULT_ALPHABET)) == 74
    ids = tok("12<eos>")["input_ids"]
    assert ids[-1] == tok.eos_token_id and len(ids) == 3
    assert tok.decode(ids, skip_special_tokens=True) == "12"
    assert tok("A")["input_ids"] == [tok.unk_token_id]  # uppercase is not in the default alphabet


def test_extra_characters_from_texts_and_deterministic_ids():
    tok = train_char_tokenizer(["Hello", "héllo"])
    assert len(tok) == 74 + 2  # "H" and "é"
    assert tok.decode(tok("Héllo")["input_ids"]) == "Héllo"
    # Ids are sorted characters, not frequencies: the same alphabet gives the same ids.
    assert train_char_tokenizer("zzzz1").get_vocab() == train_char_tokenizer().get_vocab()
    with pytest.raises(TypeError, match="texts must be strings"):
        train_char_tokenizer([1])


def test_left_padding(tok):
    batch = tok(["12", "1234"], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0]
    assert batch["attention_mask"] == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_save_and_autotokenizer_round_trip(tmp_path):
    saved = train_char_tokenizer(save_dir=tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = "reverse 482913 =\n319284"
    assert loaded(text)["input_ids"] == saved(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert loaded.padding_side == "left"
    assert (loaded.pad_token, loaded.bos_token, loaded.eos_token, loaded.unk_token) == (
        "<pad>",
        "<bos>",
        "<eos>",
        "<unk>",
    )
    messages = [{"role": "user", "content": "reverse 12 ="}]
    rendered = loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "user: reverse 12 =\nassistant:"
