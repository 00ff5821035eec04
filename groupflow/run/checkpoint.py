"""Atomic, self-describing checkpoints: ``<root>/step_<N>/`` plus a ``latest`` pointer.

Design decision: a checkpoint directory either is complete or is not there. Each save writes every
component into a private temp dir ``.tmp_step_<N>_<pid>`` in the same parent (so the final
``os.rename`` stays on one filesystem and is atomic), fsyncs each file, writes ``manifest.json``
*last* (component -> file, format, byte size, plus the step), fsyncs the directory, renames it into
place, and only then swaps the ``latest`` file with ``os.replace``. A reader trusts a directory only
if its manifest exists and every listed file has the listed size, so a crash at any point leaves the
previous checkpoint as the one found. ``latest`` is authoritative when it points at a complete
checkpoint (it follows the run's own history, e.g. after resuming from an earlier step); when it is
missing, corrupt or points at a broken directory, the newest complete ``step_*`` is used instead.

Each component of the state dict gets its own file, chosen by content: a flat ``name -> tensor``
dict (a model state dict) goes to safetensors (no pickle, mmap-able, readable by other tools), a
dict that survives a JSON round trip unchanged (trainer state, data-loader position) goes to JSON
(human-readable), anything else (optimizer state, RNG state) to a safetensors file whose metadata
holds a JSON skeleton of the nesting (``groupflow.utils.safe_state``). Nothing is pickled, so
loading a checkpoint never runs code from it. Checkpoints of format version 1 stored those
components with ``torch.save``; they are still read, with torch's ``weights_only`` unpickler only:
a file that would need full unpickling is refused (:class:`UnsafeCheckpointError`, naming it).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file as _load_safetensors
from safetensors.torch import save_file as _save_safetensors

from groupflow.utils.safe_state import (
    UnsafeStateError,
    load_torch_weights_only,
    load_tree,
    os_error_in_text,
    safetensors_ready,
    save_tree,
)

__all__ = [
    "CheckpointError",
    "UnsafeCheckpointError",
    "capture_rng_state",
    "checkpoint_step",
    "find_latest_checkpoint",
    "is_complete_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "restore_rng_state",
    "save_checkpoint",
]

MANIFEST = "manifest.json"
LATEST = "latest"
# 2: non-tensor, non-JSON components are "tree" files (version 1 wrote them with torch.save).
FORMAT_VERSION = 2
_EXTENSIONS = {
    "safetensors": ".safetensors",
    "json": ".json",
    "tree": ".safetensors",
    "torch": ".pt",
}
_RESERVED = frozenset({"manifest", "latest"})
_STEP_DIR = re.compile(r"^step_(\d+)$")
_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
# Temp entries carry the writer's pid so that a later process can tell abandoned ones (writer
# dead) from a save in progress.
_TMP_DIR = re.compile(r"^\.tmp_(step|old_step|prune_step)_(\d+)_(\d+)$")
_TMP_LATEST = re.compile(r"^\.tmp_latest_(\d+)$")
_RNG_KEYS = ("python", "numpy", "torch")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or unreadable."""


class UnsafeCheckpointError(CheckpointError, ValueError):
    """A checkpoint file would run code when loaded (a pickle of arbitrary objects); refused."""


# ---------------------------------------------------------------------------------------------
# durability helpers


def _fsync(path: Path) -> None:
    """Flush a file's or directory's data/metadata to disk (no-op where unsupported, i.e. Windows)."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    # On Windows os.kill(pid, 0) would terminate the process; never clean up there.
    if os.name == "nt" or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _remove_tree(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except OSError as err:
        warnings.warn(f"could not remove {path}: {err}; it is ignored by readers", stacklevel=3)


# ---------------------------------------------------------------------------------------------
# components


def _is_flat_tensor_dict(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and len(value) > 0
        and all(isinstance(k, str) for k in value)
        # Exact torch.Tensor (after detach) excludes DTensor and other subclasses safetensors cannot write.
        and all(
            isinstance(v, torch.Tensor)
            and type(v.detach()) is torch.Tensor
            and v.layout == torch.strided
            for v in value.values()
        )
    )


def _json_roundtrips(value: Any) -> bool:
    if not isinstance(value, dict):
        return False
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):  # tensors, NaN, custom objects: not JSON, so torch.save
        return False
    # Tuples, int keys, etc. would come back changed; only exact round trips go to JSON.
    return json.loads(text) == value


def _component_format(value: Any) -> str:
    if _is_flat_tensor_dict(value):
        return "safetensors"
    if _json_roundtrips(value):
        return "json"
    return "tree"


def _write_component(directory: Path, name: str, value: Any) -> dict[str, Any]:
    fmt = _component_format(value)
    path = directory / f"{name}{_EXTENSIONS[fmt]}"
    try:
        if fmt == "safetensors":
            _save_safetensors(safetensors_ready(value), str(path))
        elif fmt == "json":
            path.write_text(json.dumps(value, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        else:
            save_tree(value, path, where=f"checkpoint component {name!r}")
    except Exception as exc:
        # safetensors reports a full disk as its own error with the OS error in the text only:
        # raised as the OSError it is (naming the file), so the CLI explains it as one.
        os_error = os_error_in_text(exc, str(path))
        if os_error is None:
            raise
        raise os_error from exc
    _fsync(path)
    return {"file": path.name, "format": fmt, "bytes": path.stat().st_size}


def _inventory(directory: Path, name: str) -> dict[str, Any]:
    root = directory / name
    if not root.is_dir():
        raise CheckpointError(f"writer for component {name!r} did not create {root}")
    files = {
        str(f.relative_to(root)): f.stat().st_size for f in sorted(root.rglob("*")) if f.is_file()
    }
    for f in root.rglob("*"):
        if f.is_file():
            _fsync(f)
    return {"file": name, "format": "dir", "bytes": 0, "files": files}


def _read_component(path: Path, fmt: str) -> Any:
    if fmt == "dir":
        return path  # read by the code that wrote it (e.g. torch.distributed.checkpoint)
    if fmt == "safetensors":
        return _load_safetensors(str(path), device="cpu")
    if fmt == "json":
        return json.loads(path.read_text(encoding="utf-8"))
    try:
        if fmt == "tree":
            return load_tree(path)
        if fmt == "torch":  # format version 1; never fully unpickled
            return load_torch_weights_only(path)
    except UnsafeStateError as err:
        raise UnsafeCheckpointError(str(err)) from None
    except ValueError as err:
        raise CheckpointError(f"checkpoint file {err}") from None
    raise CheckpointError(f"{path}: unknown component format {fmt!r}; known: {sorted(_EXTENSIONS)}")


# ---------------------------------------------------------------------------------------------
# completeness


def _read_manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text(encoding="utf-8"))


def _problem(path: Path, expected_step: int | None) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None if it is."""
    if not path.is_dir():
        return "does not exist"
    if not (path / MANIFEST).is_file():
        return f"has no {MANIFEST} (its save did not finish)"
    try:
        manifest = _read_manifest(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return f"has an unreadable {MANIFEST} ({err})"
    components = manifest.get("components") if isinstance(manifest, dict) else None
    if not isinstance(components, dict) or not isinstance(manifest.get("step"), int):
        return f"has a malformed {MANIFEST} (needs 'step' and 'components')"
    if expected_step is not None and manifest["step"] != expected_step:
        return f"has {MANIFEST} step {manifest['step']}, not {expected_step}"
    for name, info in components.items():
        file = info.get("file") if isinstance(info, dict) else None
        if (
            not isinstance(file, str)
            or Path(file).name != file
            or not isinstance(info.get("bytes"), int)
        ):
            return f"has a malformed {MANIFEST} entry for component {name!r}"
        if info.get("format") == "dir":
            problem = _dir_problem(path / file, info.get("files"))
            if problem:
                return problem
            continue
        if not (path / file).is_file():
            return f"is missing {file}"
        size = (path / file).stat().st_size
        if size != info["bytes"]:
            return f"has {file} of {size} bytes, but {MANIFEST} says {info['bytes']}"
    return None


def _dir_problem(root: Path, files: Any) -> str | None:
    if not isinstance(files, dict) or not root.is_dir():
        return f"is missing its {root.name}/ directory"
    for rel, size in files.items():
        f = root / rel
        if not f.is_file():
            return f"is missing {root.name}/{rel}"
        if f.stat().st_size != size:
            return f"has {root.name}/{rel} of {f.stat().st_size} bytes, but {MANIFEST} says {size}"
    return None


def _dir_step(path: Path) -> int | None:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def is_complete_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` has a manifest and every file it lists, at the listed size."""
    path = Path(path)
    return _problem(path, _dir_step(path)) is None


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The training step recorded in a checkpoint's manifest."""
    path = Path(path)
    problem = _problem(path, _dir_step(path))
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} {problem}")
    return _read_manifest(path)["step"]


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    found = [(_dir_step(p), p) for p in root.iterdir() if p.is_dir()]
    return sorted((step, p) for step, p in found if step is not None)


def list_checkpoints(ckpt_root: str | os.PathLike[str]) -> list[Path]:
    """Complete ``step_<N>`` checkpoints under ``ckpt_root``, oldest step first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    return [p for step, p in _step_dirs(root) if _problem(p, step) is None]


def _clean_stale(root: Path) -> None:
    """Remove temp entries of dead writers; put back a replaced checkpoint whose swap was cut short."""
    for entry in root.iterdir():
        tmp_dir = _TMP_DIR.match(entry.name)
        tmp_latest = _TMP_LATEST.match(entry.name)
        if tmp_dir and entry.is_dir() and not _pid_alive(int(tmp_dir.group(3))):
            kind, step = tmp_dir.group(1), int(tmp_dir.group(2))
            target = root / f"step_{step}"
            # A writer replacing step_N died between moving the old copy away and moving the new one
            # in: the old copy is the only complete step_N, so restore it.
            if kind == "old_step" and not target.exists() and _problem(entry, step) is None:
                os.rename(entry, target)
                warnings.warn(f"restored {target} from an interrupted replacement", stacklevel=3)
            else:
                _remove_tree(entry)
        elif tmp_latest and entry.is_file() and not _pid_alive(int(tmp_latest.group(1))):
            entry.unlink()


# ---------------------------------------------------------------------------------------------
# save / find / load / prune


def _check_state(state: Any) -> None:
    if not isinstance(state, Mapping) or not state:
        raise TypeError(
            f"state must be a non-empty dict of component name -> value, got {state!r:.80}"
        )
    for name in state:
        if not isinstance(name, str) or not _COMPONENT.match(name) or name in _RESERVED:
            raise ValueError(
                f"invalid checkpoint component name {name!r}: use letters, digits, '_' or '-' "
                f"(not starting with '_' or '-'), and not one of {sorted(_RESERVED)}"
            )


def _check_positive_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".tmp_latest_{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync(root)


def _install(tmp: Path, final: Path, step: int) -> None:
    """Rename the finished temp dir to ``final``; an existing ``final`` is replaced, never half-overwritten."""
    root = final.parent
    if not final.exists():
        os.rename(tmp, final)
        _fsync(root)
        return
    # os.rename cannot replace a non-empty directory: move the old one aside first. A crash between
    # the two renames is repaired by _clean_stale, which moves the old copy back.
    old = root / f".tmp_old_step_{step}_{os.getpid()}"
    os.rename(final, old)
    os.rename(tmp, final)
    _fsync(root)
    _remove_tree(old)


def save_checkpoint(
    ckpt_root: str | os.PathLike[str],
    step: int,
    state: Mapping[str, Any],
    keep_last: int | None = None,
    writers: Mapping[str, Any] | None = None,
) -> Path:
    """Atomically write ``state`` (component name -> value) to ``ckpt_root/step_<step>``.

    Components: a flat ``name -> tensor`` dict → ``<name>.safetensors``; a JSON-exact dict →
    ``<name>.json``; anything else → ``<name>.pt``. Then ``latest`` is pointed at it and, with
    ``keep_last=N``, all but the N newest complete checkpoints (always keeping this one) are
    deleted. Returns the checkpoint directory.
    """
    _check_positive_int("step", step, 0)
    if keep_last is not None:
        _check_positive_int("keep_last", keep_last, 1)
    _check_state(state)
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    _clean_stale(root)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}_{os.getpid()}"
    if tmp.exists():  # left by an earlier failed save in this same process
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        components = {name: _write_component(tmp, name, value) for name, value in state.items()}
        # Directories written by other code (e.g. every rank writing its shards with
        # torch.distributed.checkpoint) are inventoried like files: name, size, per file.
        for name, write in (writers or {}).items():
            write(tmp / name)
            components[name] = _inventory(tmp, name)
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "created_unix": time.time(),
            "components": components,
        }
        # The manifest is written last: its presence is what marks the checkpoint complete.
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
        _install(tmp, final, step)
    except BaseException:
        if tmp.exists():
            _remove_tree(tmp)
        raise
    _write_latest(root, final.name)
    if keep_last is not None:
        prune_checkpoints(root, keep_last, protect=final)
    return final


def prune_checkpoints(
    ckpt_root: str | os.PathLike[str], keep_last: int, protect: str | os.PathLike[str] | None = None
) -> list[Path]:
    """Delete complete checkpoints beyond the ``keep_last`` newest (by step); returns those removed.

    ``protect`` (the one just saved) is always kept and counts toward ``keep_last``. Incomplete
    ``step_*`` directories are left alone for inspection; readers skip them anyway.
    """
    _check_positive_int("keep_last", keep_last, 1)
    root = Path(ckpt_root)
    newest_first = list(reversed(list_checkpoints(root)))
    if protect is not None:
        protect = Path(protect)
        newest_first = [protect] + [p for p in newest_first if p != protect]
    removed = []
    for path in newest_first[keep_last:]:
        # Rename first so that a crash mid-delete leaves a temp dir, not a half-deleted step_N.
        doomed = root / f".tmp_prune_{path.name}_{os.getpid()}"
        os.rename(path, doomed)
        _remove_tree(doomed)
        removed.append(path)
    if removed:
        _fsync(root)
    return removed


def find_latest_checkpoint(ckpt_root: str | os.PathLike[str]) -> Path | None:
    """The checkpoint to resume from: ``latest``'s target if complete, else the newest complete one.

    Also removes temp directories left by dead writers. Returns None when there is no complete
    checkpoint (or no ``ckpt_root``).
    """
    root = Path(ckpt_root)
    if not root.is_dir():
        return None
    _clean_stale(root)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text(encoding="utf-8").strip()
        step = _dir_step(Path(name)) if "/" not in name and "\\" not in name else None
        if step is None:
            warnings.warn(
                f"{pointer} holds {name[:60]!r}, not a step_<N> name; scanning instead",
                stacklevel=2,
            )
        else:
            problem = _problem(root / name, step)
            if problem is None:
                return root / name
            warnings.warn(
                f"{pointer} points at {name}, which {problem}; scanning instead", stacklevel=2
            )
    for step, path in reversed(_step_dirs(root)):
        problem = _problem(path, step)
        if problem is None:
            return path
        warnings.warn(f"skipping incomplete checkpoint {path}: it {problem}", stacklevel=2)
    return None


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The components saved in checkpoint ``path`` (on CPU), as passed to :func:`save_checkpoint`."""
    path = Path(path)
    problem = _problem(path, _dir_step(path))
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} {problem}")
    manifest = _read_manifest(path)
    version = manifest.get("format_version", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {version!r}; this groupflow reads versions "
            f"up to {FORMAT_VERSION} (it was written by a newer groupflow: upgrade to load it)"
        )
    components = manifest["components"]
    return {
        name: _read_component(path / info["file"], info["format"])
        for name, info in components.items()
    }


# ---------------------------------------------------------------------------------------------
# RNG


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy (global) and torch CPU RNG states, plus CUDA's if CUDA is in use.

    Only tensors and plain Python values, so it is stored without pickle (a "tree" component).
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": str(kind),
            "keys": np.asarray(keys).tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    # Only if already initialised: querying would otherwise create a CUDA context in a CPU driver.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore states captured by :func:`capture_rng_state` (also after a save/load round trip)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"RNG state must be a dict, got {type(state).__name__}")
    valid = (*_RNG_KEYS, "cuda")
    unknown = sorted(set(state) - set(valid))
    missing = [k for k in _RNG_KEYS if k not in state]
    if unknown or missing:
        raise ValueError(
            f"RNG state has unknown keys {unknown} / missing keys {missing}; expected {list(valid)}"
        )
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(internal), gauss))
    ns = state["numpy"]
    keys = np.asarray(ns["keys"], dtype=np.uint32)
    np.random.set_state(
        (ns["bit_generator"], keys, ns["pos"], ns["has_gauss"], ns["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" not in state:
        return
    if not torch.cuda.is_available():
        warnings.warn(
            "the RNG state includes CUDA generators but CUDA is not available; not restored",
            stacklevel=2,
        )
        return
    cuda_states = list(state["cuda"])
    if len(cuda_states) != torch.cuda.device_count():
        warnings.warn(
            f"the RNG state has {len(cuda_states)} CUDA generators but {torch.cuda.device_count()} "
            "devices are visible; restoring the common prefix",
            stacklevel=2,
        )
    for index, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(cuda_state, index)
