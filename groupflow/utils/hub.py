"""Hugging Face Hub ids for models and datasets, resolved through the normal HF cache.

Design decision: a Hub id is turned into a local snapshot directory once, before anything is
built (``resolve_config_paths`` on the driver), so every loader below keeps taking local
directories and ``local_files_only=True``. Resolution goes through ``huggingface_hub``'s
``snapshot_download``, with the cache directory and offline mode read from the environment at
call time (``HF_HUB_CACHE`` / ``HF_HOME``, ``HF_HUB_OFFLINE``), not when the library was
imported: with offline mode on, a cached snapshot is used and nothing is downloaded; an id that
is neither cached nor reachable is a :class:`HubError` naming the config key, the id, the cache
directory searched and how to fix it. A string is a Hub id only when no such local path exists
and it has the ``owner/name`` shape, so local directories keep working unchanged.

Datasets (``data.train_files`` / ``val_files``) name a Hub dataset as ``hf://owner/name`` (query
keys ``config``, ``split``, ``revision``) or a ``{name, config, split, revision}`` mapping; the
snapshot is loaded with ``datasets.load_dataset`` on its local directory (the repository's own
data files and configs), so a cached dataset loads offline.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = [
    "HubError",
    "HubDataset",
    "hub_cache_dir",
    "offline_mode",
    "is_hub_id",
    "resolve_repo",
    "resolve_model_path",
    "parse_hub_dataset",
    "load_hub_rows",
]

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
HF_PREFIX = "hf://"


class HubError(ValueError):
    """A Hub id that cannot be resolved (not cached, unreachable, unknown, bad revision)."""


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def offline_mode() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now."""
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(
        os.environ.get("TRANSFORMERS_OFFLINE")
    )


def hub_cache_dir() -> Path:
    """The Hub cache as the environment says now: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub`` (``~/.cache`` by default)."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(key):
            return Path(os.environ[key]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def is_hub_id(value: str) -> bool:
    """``owner/name`` with no local path of that name (a local directory always wins)."""
    return bool(_ID.match(value)) and not Path(value).expanduser().exists()


def resolve_repo(
    repo_id: str,
    revision: str | None,
    key: str,
    repo_type: str = "model",
    allow_patterns: list[str] | None = None,
) -> Path:
    """The local snapshot directory of ``repo_id`` at ``revision`` (default branch when None),
    downloaded only when offline mode is off and it is not cached; ``allow_patterns`` limits a
    download to the files matching them (e.g. a model's config and tokenizer, not its weights)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache, offline = hub_cache_dir(), offline_mode()
    what = "dataset" if repo_type == "dataset" else "model"
    at = f" at revision {revision!r}" if revision else ""
    try:
        path = snapshot_download(
            repo_id, repo_type=repo_type, revision=revision, cache_dir=str(cache),
            local_files_only=offline, allow_patterns=allow_patterns,
        )  # fmt: skip
    except RevisionNotFoundError:
        raise HubError(
            f"{key}: the Hub {what} '{repo_id}' has no revision {revision!r} (a branch, tag or "
            "commit hash)"
        ) from None
    except RepositoryNotFoundError:
        raise HubError(
            f"{key}: no Hub {what} '{repo_id}' (misspelt, private or gated: log in with "
            "`hf auth login`), and no local directory of that name"
        ) from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        how = (
            "offline mode is on (HF_HUB_OFFLINE=1)"
            if offline
            else f"the Hub could not be reached ({type(err).__name__})"
        )
        raise HubError(
            f"{key}: '{repo_id}'{at} is neither a local directory nor in the Hugging Face cache "
            f"({cache}), and {how}; download it once where there is network (`hf download "
            f"{repo_id}{' --repo-type dataset' if repo_type == 'dataset' else ''}`, with HF_HOME "
            "pointing at the same cache) or give a local directory"
        ) from None
    return Path(path)


def resolve_model_path(value: str, revision: str | None, key: str) -> str:
    """``value`` unchanged when it is a local path, else its Hub snapshot directory."""
    if not is_hub_id(value):
        return value
    return str(resolve_repo(value, revision, key))


# ----- datasets ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HubDataset:
    """One split of a Hub dataset."""

    name: str
    config: str | None = None
    split: str = "train"
    revision: str | None = None

    def label(self) -> str:
        """How error messages name its rows."""
        cfg = f"/{self.config}" if self.config else ""
        return f"hf://{self.name}{cfg}[{self.split}]"


def parse_hub_dataset(spec: Any, default_split: str, key: str) -> HubDataset | None:
    """A :class:`HubDataset` from ``hf://owner/name?config=c&split=s&revision=r`` or a mapping
    ``{name, config, split, revision}``; None for a plain file path."""
    if isinstance(spec, dict):
        return HubDataset(
            spec["name"], spec.get("config"), spec.get("split") or default_split,
            spec.get("revision"),
        )  # fmt: skip
    if not isinstance(spec, str) or not spec.startswith(HF_PREFIX):
        return None
    parts = urlsplit(spec)
    name = f"{parts.netloc}{parts.path}".strip("/")
    if not _ID.match(name):
        raise HubError(
            f"{key}: '{spec}' is not a Hub dataset id; write hf://owner/name (optionally "
            "?config=NAME&split=SPLIT&revision=REV)"
        )
    query = parse_qs(parts.query)
    unknown = sorted(set(query) - {"config", "split", "revision"})
    if unknown:
        raise HubError(
            f"{key}: '{spec}': unknown query key {unknown[0]!r} (valid: config, split, revision)"
        )

    def one(k: str) -> str | None:
        return query[k][-1] if k in query else None

    return HubDataset(name, one("config"), one("split") or default_split, one("revision"))


def load_hub_rows(ds: HubDataset, key: str) -> list[dict[str, Any]]:
    """The rows of one split, read with ``datasets`` from the cached (or downloaded) snapshot."""
    try:
        import datasets
    except ImportError:
        raise HubError(
            f"{key}: Hub datasets are read with the 'datasets' package, which is not installed; "
            "install it with: pip install 'groupflow[hub]' (or pip install datasets)"
        ) from None

    root = resolve_repo(ds.name, ds.revision, key, repo_type="dataset")
    # datasets reads HF_HOME when imported; its Arrow cache follows the environment as set now
    cache = os.environ.get("HF_DATASETS_CACHE") or hub_cache_dir().parent / "datasets"
    try:
        loaded = datasets.load_dataset(str(root), ds.config, split=ds.split, cache_dir=str(cache))
    except ValueError as err:  # unknown config or split: datasets lists the valid ones
        reason = str(err).strip().splitlines()[0]
        raise HubError(f"{key}: {ds.label()}: {reason}") from None
    return loaded.to_list()
