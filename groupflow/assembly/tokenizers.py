"""The tokenizer (a local Hugging Face one, or a character tokenizer trained on the run's data for
a tiny model) and a vision-language model's processor, and the check that a distillation
teacher's token ids mean what the student's do.

Design decision: a tiny model's vocabulary is exactly the characters of its data, saved in the
run directory on first build and reused from there on resume, so a run and its resumption (and
every worker that loads the tokenizer from that directory) see the same ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from groupflow.assembly.models import resolve_hub_models
from groupflow.config import Config, present
from groupflow.data import PromptRow, train_char_tokenizer
from groupflow.data.tokenizer import DEFAULT_ALPHABET
from groupflow.models.causal_lm import ModelLoadError
from groupflow.models.tiny_vlm import IDEFICS3_TOKENS, idefics3_processor, load_processor

__all__ = [
    "tokenizer_dir",
    "build_tokenizer",
    "is_vlm_config",
    "save_processor",
    "build_processor",
    "check_teacher",
]


def tokenizer_dir(cfg: Config, run_dir: Path) -> Path:
    """Where the tokenizer lives: the run's own (tiny models) or the model's local directory."""
    m = present(cfg.model, "model")
    if m.tiny is not None and m.tokenizer_path is None:
        return run_dir / "tokenizer"
    return Path(present(m.tokenizer_path or m.path, "model.path")).expanduser()


def build_tokenizer(cfg: Config, run_dir: Path, corpus: Sequence[PromptRow] = (),
                    extra_texts: Sequence[str] = ()):  # fmt: skip
    """Load the tokenizer from a local directory, or train a character tokenizer on ``corpus``.

    The tiny model's vocabulary is exactly the characters of the data (prompts and answers, plus
    ``extra_texts``: what a workflow's observations can contain): a small output space is what
    lets a 0.2M-parameter model learn quickly on a CPU.
    """
    from transformers import AutoTokenizer

    m = present(cfg.model, "model")
    if m.tiny is not None and m.tokenizer_path is None:
        saved = run_dir / "tokenizer"
        if saved.is_dir():  # resume: reuse the exact tokenizer the run started with
            return AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
        texts = [_prompt_text(r.prompt) for r in corpus] + [
            str(v) for r in corpus for k, v in r.fields.items() if k != "images"
        ] + list(extra_texts)  # fmt: skip
        tok = train_char_tokenizer(texts, base_alphabet="" if corpus else DEFAULT_ALPHABET)
        if m.tiny.vision is not None:  # the image processor's special tokens, saved with it
            tok.add_special_tokens({"additional_special_tokens": list(IDEFICS3_TOKENS)})
        tok.save_pretrained(str(saved))
        return tok
    key = "model.tokenizer_path" if m.tokenizer_path else "model.path"
    path = Path(present(m.tokenizer_path or m.path, "model.path")).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"{key}: tokenizer path '{path}' does not exist or is not a directory")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{key}: '{path}' holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); point "
            "it at a Hugging Face model directory, or set model.tokenizer_path"
        )
    try:
        tok = AutoTokenizer.from_pretrained(
            str(path), trust_remote_code=m.trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError) as err:  # transformers' messages do not name the directory
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelLoadError(f"{key}: cannot load the tokenizer in '{path}': {reason}") from err
    if tok.pad_token_id is None:
        # Padding is masked everywhere, so any id works; EOS is the usual choice (as TRL does).
        tok.pad_token = tok.eos_token
    return tok


def _prompt_text(prompt) -> str:
    """The characters of a prompt (image parts have none; their PIL repr must not enter a
    character vocabulary)."""
    if isinstance(prompt, str):
        return prompt
    out = []
    for m in prompt:
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out += [p.get("text", "") for p in content if p.get("type") == "text"]
    return "\n".join(out)


def is_vlm_config(cfg: Config) -> bool:
    m = present(cfg.model, "model")
    if m.tiny is not None:
        return m.tiny.vision is not None
    cfg_file = Path(present(m.path, "model.path")).expanduser() / "config.json"
    return cfg_file.is_file() and "vision_config" in json.loads(cfg_file.read_text())


def save_processor(cfg: Config, tokenizer, out: Path) -> None:
    """Write a vision-language model's processor next to its exported weights, so the export
    loads with ``AutoProcessor`` (nothing for a text model). Qwen-VL's image-only processor
    (no torchvision here) is written as its image processor and chat template, which
    ``models.tiny_vlm.load_processor`` reads back."""
    processor = build_processor(resolve_hub_models(cfg), tokenizer)
    if processor is None:
        return
    if type(processor).__name__.startswith("ImageOnly"):
        processor.image_processor.save_pretrained(str(out))
        template = processor.chat_template
        if not isinstance(template, str):
            raise ValueError(f"the image processor's chat template is not a string: {template!r}")
        (Path(out) / "chat_template.jinja").write_text(template)
    else:
        processor.save_pretrained(str(out))


def build_processor(cfg: Config, tokenizer):
    """The processor that turns prompts with images into ids and image tensors: the tiny VLM's
    (``model.tiny.vision``) or the model directory's; None for a text-only model."""
    m = present(cfg.model, "model")
    if m.tiny is not None:
        v = m.tiny.vision
        if v is None:
            return None
        return idefics3_processor(tokenizer, image_size=v.image_size, patch_size=v.patch_size,
                                  scale_factor=v.scale_factor)  # fmt: skip
    if not is_vlm_config(cfg):
        return None
    path = Path(present(m.path, "model.path")).expanduser()
    return load_processor(str(path), tokenizer, m.trust_remote_code)


# Files a Hugging Face tokenizer directory has at least one of.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def check_teacher(path: str, student_tokenizer) -> None:
    """On-policy distillation compares log-probs of the same token ids: the teacher's tokenizer
    (in ``path``) must map every token to the id the student's does, with the same special
    tokens, and the teacher's output layer must cover every id. Raises ModelLoadError naming the
    first difference."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        teacher_tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"teacher.path: cannot load a tokenizer from '{path}' ({e})") from None
    mine, theirs = student_tokenizer.get_vocab(), teacher_tok.get_vocab()
    if mine != theirs:
        differ = sorted(t for t in mine.keys() | theirs.keys() if mine.get(t) != theirs.get(t))
        shown = ", ".join(f"{t!r}: student {mine.get(t)}, teacher {theirs.get(t)}"
                          for t in differ[:3])  # fmt: skip
        raise ModelLoadError(
            f"teacher.path: the teacher's tokenizer does not match the student's ({len(mine)} vs "
            f"{len(theirs)} tokens, {len(differ)} differ: {shown}); on-policy distillation needs "
            "the same token ids (use a teacher of the student's model family, or give the "
            "student the teacher's tokenizer with model.tokenizer_path)"
        )
    for name in ("eos_token_id", "bos_token_id"):  # pad is never scored
        a, b = getattr(student_tokenizer, name), getattr(teacher_tok, name)
        if a != b:
            raise ModelLoadError(
                f"teacher.path: {name} is {b} for the teacher, {a} for the student"
            )
    vocab = getattr(AutoConfig.from_pretrained(path, local_files_only=True), "vocab_size", None)
    if vocab is not None and vocab < len(student_tokenizer):
        raise ModelLoadError(
            f"teacher.path: the teacher's vocab_size {vocab} is smaller than the student's "
            f"tokenizer ({len(student_tokenizer)} tokens)"
        )
