"""Training state on disk without pickle: nested containers as JSON, tensors as safetensors.

Design decision: a checkpoint is data, and loading it must never run code from the file. Python's
pickle (what ``torch.save`` writes) rebuilds objects by calling whatever the file names, so a
crafted checkpoint can run ``os.system`` on resume. Everything groupflow saves is therefore stored
as a *tree*: the nested dicts / lists / tuples / numbers / strings of a state dict (an optimizer's
``state`` keyed by int, ``betas`` tuples, Python's RNG state tuple) are encoded as a JSON skeleton
in which each tensor is a reference into one safetensors file, and the skeleton is stored in that
file's metadata. One file per component, readable by any safetensors tool, and decoding builds
only the containers and tensors it lists. Types with no such encoding (arbitrary objects, DTensor
shards) are refused when *saving*, naming the path inside the component.

Two readers remain for files that are pickles by nature, each refusing anything that would need
code to run: :func:`load_torch_weights_only` (``.pt`` components of checkpoints written before the
tree format: torch's ``weights_only`` unpickler, never the full one) and
:func:`check_dcp_metadata` (``torch.distributed.checkpoint`` writes its ``.metadata`` index with
plain pickle and reads it back with plain pickle; we unpickle it first with an allowlist of the
classes DCP itself writes, so a crafted index is refused before DCP touches it).
"""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "UnsafeStateError",
    "check_dcp_metadata",
    "decode_tree",
    "encode_tree",
    "load_torch_weights_only",
    "load_tree",
    "os_error_in_text",
    "safetensors_ready",
    "save_tree",
]

TREE_METADATA_KEY = "groupflow.tree"
# Tag keys of the JSON skeleton; a user dict that looks like a tag is stored in the pair form.
_TAGS = ("__tensor__", "__tuple__", "__dict__", "__float__", "__bytes__")
_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class UnsafeStateError(ValueError):
    """A state file would need code to run (unpickling arbitrary objects) to be loaded."""


# How Rust's std::io::Error prints the OS error it wraps (safetensors' SafetensorError is no
# OSError: "Error while serializing: I/O error: No space left on device (os error 28)").
_OS_ERROR_TEXT = re.compile(r"\(os error (\d+)\)")


def os_error_in_text(exc: BaseException, filename: str | None = None) -> OSError | None:
    """The OS error that a native library's exception carries only in its message, as an
    :class:`OSError` (``errno``, ``strerror``, ``filename``), or None when it names none."""
    if isinstance(exc, OSError):
        return None
    match = _OS_ERROR_TEXT.search(str(exc))
    if match is None:
        return None
    code = int(match.group(1))
    return OSError(code, os.strerror(code), filename)


# ---------------------------------------------------------------------------------------------
# the tree encoding


def _plain_tensor(value: torch.Tensor) -> bool:
    # Exact torch.Tensor after detach excludes DTensor and other subclasses safetensors cannot write.
    return type(value.detach()) is torch.Tensor and value.layout == torch.strided


def encode_tree(value: Any, where: str = "state") -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON-able skeleton, tensors by key) for a nested state; raises TypeError naming the path
    (``where`` and the keys below it) of a value that has no pickle-free encoding."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(v: Any, path: str) -> Any:
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            if math.isfinite(v):
                return float(v)
            return {"__float__": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if isinstance(v, torch.Tensor):
            if not _plain_tensor(v):
                raise TypeError(
                    f"{path}: a {type(v).__name__} ({v.layout}) cannot be stored as a plain "
                    "tensor; gather it to a full, strided torch.Tensor first"
                )
            key = f"t{len(tensors)}"
            tensors[key] = v
            return {"__tensor__": key}
        if isinstance(v, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(v)).decode("ascii")}
        if isinstance(v, tuple):
            return {"__tuple__": [enc(x, f"{path}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [enc(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, Mapping):
            items = list(v.items())
            plain = all(isinstance(k, str) for k, _ in items) and not (
                len(items) == 1 and items[0][0] in _TAGS
            )
            if plain:
                return {k: enc(x, f"{path}.{k}") for k, x in items}
            return {
                "__dict__": [
                    [enc(k, f"{path} key {k!r}"), enc(x, f"{path}[{k!r}]")] for k, x in items
                ]
            }
        raise TypeError(
            f"{path}: a {type(v).__module__}.{type(v).__qualname__} cannot be stored without "
            "pickle; checkpoints hold tensors, numbers, strings, bytes, None and lists / tuples / "
            "dicts of them"
        )

    return enc(value, where), tensors


def decode_tree(skeleton: Any, tensors: Mapping[str, torch.Tensor], where: str = "state") -> Any:
    """The inverse of :func:`encode_tree`; raises ValueError naming ``where`` for a malformed skeleton."""

    def dec(v: Any) -> Any:
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            return v
        if len(v) == 1:
            ((tag, arg),) = v.items()
            if tag == "__tensor__":
                if arg not in tensors:
                    raise ValueError(
                        f"{where}: the skeleton names tensor {arg!r}, which the file lacks"
                    )
                return tensors[arg]
            if tag == "__tuple__":
                return tuple(dec(x) for x in arg)
            if tag == "__dict__":
                return {_hashable(dec(k)): dec(x) for k, x in arg}
            if tag == "__float__":
                return _FLOATS[arg]
            if tag == "__bytes__":
                return base64.b64decode(arg)
        return {k: dec(x) for k, x in v.items()}

    try:
        return dec(skeleton)
    except (TypeError, KeyError, ValueError) as err:
        raise ValueError(f"{where}: malformed state skeleton ({err})") from None


def _hashable(key: Any) -> Any:
    # Tuples of ints are the usual non-str keys; a list can only come from a malformed file.
    if isinstance(key, list):
        raise TypeError(f"dict key {key!r} is not hashable")
    return key


def safetensors_ready(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors with no two sharing storage (safetensors refuses shared memory).

    Tied weights (embedding = lm_head) are stored twice; loading them back into a tied model copies
    the same values into the shared parameter, so nothing is lost.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        t = tensor.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[name] = t
    return out


def save_tree(value: Any, path: Path, where: str = "state") -> None:
    """Write ``value`` as one safetensors file whose metadata holds the JSON skeleton."""
    skeleton, tensors = encode_tree(value, where)
    text = json.dumps(skeleton, allow_nan=False, separators=(",", ":"))
    save_file(safetensors_ready(tensors), str(path), metadata={TREE_METADATA_KEY: text})


def load_tree(path: Path) -> Any:
    """Read a file written by :func:`save_tree` (no code from the file runs)."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        metadata = f.metadata() or {}
        if TREE_METADATA_KEY not in metadata:
            raise ValueError(
                f"{path}: not a groupflow state file (no '{TREE_METADATA_KEY}' metadata)"
            )
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
    try:
        skeleton = json.loads(metadata[TREE_METADATA_KEY])
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: unreadable state skeleton ({err})") from None
    return decode_tree(skeleton, tensors, str(path))


# ---------------------------------------------------------------------------------------------
# readers for pickles written by others


def load_torch_weights_only(path: Path) -> Any:
    """``torch.load`` with the ``weights_only`` unpickler (tensors and plain containers only).

    A file that needs more — any class or function the restricted unpickler does not allow — is
    refused with :class:`UnsafeStateError` naming the file and what it asked for; there is no
    fallback to full unpickling, which would run code from the file.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message is long; its "WeightsUnpickler error" line names the refused global.
        lines = [ln.strip() for ln in str(err).splitlines() if "WeightsUnpickler" in ln]
        reason = (lines[0] if lines else str(err).splitlines()[0])[:300]
        raise UnsafeStateError(
            f"{path}: refusing to load it: it is a pickle that would need to run code to be "
            f"loaded ({reason}). groupflow never unpickles such files; a checkpoint written by "
            "groupflow never contains one, so this file was crafted or written by other code"
        ) from None


def _dcp_allowed(module: str, name: str) -> bool:
    """The globals torch.distributed.checkpoint's own ``.metadata`` index refers to."""
    import torch.distributed.checkpoint.metadata as dcp_metadata

    if module == "torch.distributed.checkpoint.metadata":
        return isinstance(getattr(dcp_metadata, name, None), type)  # its dataclasses and enums
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    return (module, name) in {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }


class _DCPMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if _dcp_allowed(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a torch.distributed.checkpoint type")


def check_dcp_metadata(directory: str | Path) -> None:
    """Refuse a sharded checkpoint whose DCP ``.metadata`` index would run code when unpickled.

    DCP reads the index with plain ``pickle.load``; this reads every ``*.metadata`` file of
    ``directory`` first with an unpickler that only builds DCP's own metadata types, and raises
    :class:`UnsafeStateError` naming the file otherwise.
    """
    for path in sorted(Path(directory).iterdir()):
        if not (path.is_file() and path.name.endswith(".metadata")):
            continue
        try:
            with open(path, "rb") as f:
                _DCPMetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as err:
            raise UnsafeStateError(
                f"{path}: refusing to load this sharded checkpoint: its index is not plain "
                f"torch.distributed.checkpoint metadata ({type(err).__name__}: {err}); unpickling "
                "it could run code from the file"
            ) from None
