"""A tiny character-level tokenizer, built locally, for the CPU demo and the tests.

Design decision: one token per character, as a `tokenizers` WordLevel model behind a pre-tokenizer
that isolates every character (spaces and newlines included) and a `Fuse` decoder, so
`decode(encode(text)) == text` exactly. The vocabulary is the special tokens followed by the
sorted characters of a fixed base alphabet plus any extra characters seen in the given texts —
sorted rather than frequency-ordered, so token ids do not depend on which corpus the tokenizer
was built from. Encoding adds no special tokens (the caller decides where BOS/EOS go), padding is
on the left because generation pads prompts on the left, and a plain-text chat template
(`role: content` lines, then `assistant:`) uses only in-vocabulary characters, so chat-message
prompts work end to end. It is wrapped in `transformers.PreTrainedTokenizerFast`, so
`save_pretrained` / `AutoTokenizer.from_pretrained` round-trip like any HF tokenizer.
"""

from __future__ import annotations

import os
import string
from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

# Digits, lowercase letters, ASCII punctuation, space and newline: enough for the synthetic tasks
# and the chat template, small enough that the embedding table stays negligible.
DEFAULT_ALPHABET = string.digits + string.ascii_lowercase + string.punctuation + " \n"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def char_vocab(texts: str | Iterable[str] = (), base_alphabet: str = DEFAULT_ALPHABET) -> list[str]:
    """Special tokens, then the sorted set of characters in `base_alphabet` and `texts`.

    A single string counts as an alphabet (each character is added).
    """
    chars = set(base_alphabet)
    for text in [texts] if isinstance(texts, str) else texts:
        if not isinstance(text, str):
            raise TypeError(f"texts must be strings, got {type(text).__name__}")
        chars.update(text)
    return list(SPECIAL_TOKENS) + sorted(chars)


def train_char_tokenizer(
    texts: str | Iterable[str] = (),
    save_dir: str | os.PathLike | None = None,
    *,
    base_alphabet: str = DEFAULT_ALPHABET,
) -> PreTrainedTokenizerFast:
    """Build the character tokenizer over `base_alphabet` plus every character of `texts`
    (an iterable of strings, or one string used as an alphabet); save it if `save_dir` is given.

    Characters outside the vocabulary encode to `<unk>`.
    """
    vocab = char_vocab(texts, base_alphabet)
    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab)}, unk_token=UNK))
    # `[\s\S]` matches every character including newline (`.` would skip "\n").
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    # Registered as special so that "<eos>" in text is one token and skip_special_tokens works.
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if save_dir is not None:
        tokenizer.save_pretrained(os.fspath(save_dir))
    return tokenizer
