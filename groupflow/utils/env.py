"""Secrets from the environment or a git-ignored ``.env`` file, and redaction before anything is written.

Design decision: API keys never live in configs. They come from the process environment, optionally
filled from a ``.env`` file by a ~40-line parser (no python-dotenv dependency) that never overrides a
variable already set, so an explicit ``export`` always wins. Everything groupflow writes (config.yaml,
tracker configs sent to W&B/MLflow) passes through :func:`redact_secrets`, which masks values by key
name (``*_KEY``, ``*_TOKEN``, ``*_SECRET``, ``*PASSWORD``) and, as a second net, any string that
contains the value of a secret environment variable. A short allow-list keeps well-known non-secret
names (``pad_token``, ``prompt_key``, ...) readable, because config.yaml must stay a faithful record.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "REDACTED",
    "DotenvError",
    "MissingSecretError",
    "is_secret_name",
    "load_dotenv_file",
    "parse_dotenv",
    "redact_secrets",
    "require_env",
    "scrub_text",
    "secret_values_from_env",
]

REDACTED = "<redacted>"

_SECRET_SUFFIXES = ("_KEY", "_TOKEN", "_SECRET", "PASSWORD")
_SECRET_EXACT = frozenset({"TOKEN", "SECRET", "APIKEY"})
# Names that end like a secret but are ordinary config: tokenizer special tokens and dataset
# column selectors. Redacting them would make config.yaml unusable for reproducing a run.
_NOT_SECRET = frozenset(
    {
        "pad_token", "eos_token", "bos_token", "unk_token", "sep_token", "cls_token", "mask_token",
        "prompt_key", "answer_key", "response_key", "completion_key", "image_key", "video_key",
        "label_key", "reward_key", "ground_truth_key", "data_source_key", "messages_key",
        "text_key", "input_key", "output_key", "group_key", "sort_key", "cache_key",
    }
)  # fmt: skip
# Values shorter than this are not used for substring scrubbing: a 3-character "secret" would
# mangle ordinary text.
_MIN_SCRUB_LEN = 8
_DOTENV_LINE = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*)$")


class DotenvError(ValueError):
    """A ``.env`` file has a line that is not ``KEY=VALUE``."""


class MissingSecretError(KeyError):
    """A required environment variable (API key) is not set."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def _unquote(raw: str, where: str) -> str:
    raw = raw.strip()
    if raw[:1] in ("'", '"'):
        quote = raw[0]
        end = raw.find(quote, 1)
        if end == -1:
            raise DotenvError(f"{where}: unterminated {quote} quote in value {raw!r}")
        rest = raw[end + 1 :].strip()
        if rest and not rest.startswith("#"):
            raise DotenvError(f"{where}: unexpected text {rest!r} after the closing quote")
        value = raw[1:end]
        # Double quotes interpret the usual escapes (as shells and python-dotenv do); single quotes are literal.
        if quote == '"':
            value = value.replace("\\n", "\n").replace("\\t", "\t").replace('\\"', '"')
        return value
    # Unquoted: an inline comment starts at " #" so that "a#b" stays a value.
    comment = re.search(r"\s#", raw)
    return (raw[: comment.start()] if comment else raw).strip()


def parse_dotenv(text: str, source: str = "<.env>") -> dict[str, str]:
    """Parse ``.env`` text: ``KEY=VALUE`` lines, optional ``export``, quotes, ``#`` comments."""
    values: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        match = _DOTENV_LINE.match(stripped)
        where = f"{source}:{lineno}"
        if match is None:
            raise DotenvError(f"{where}: expected KEY=VALUE, got {stripped[:40]!r}")
        values[match.group(1)] = _unquote(match.group(2), where)
    return values


def load_dotenv_file(path: str | os.PathLike[str] = ".env") -> dict[str, str]:
    """Load ``path`` into ``os.environ`` without overriding variables that are already set.

    A missing file is normal (the ``.env`` is optional) and returns ``{}``. Returns the variables
    that were actually set by this call.
    """
    path = Path(path)
    if not path.exists():
        return {}
    if not path.is_file():
        raise DotenvError(f"{path} is not a file")
    applied: dict[str, str] = {}
    for key, value in parse_dotenv(path.read_text(encoding="utf-8"), str(path)).items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    return applied


def require_env(name: str, purpose: str = "") -> str:
    """The value of environment variable ``name``, or an error that says how to provide it."""
    value = os.environ.get(name)
    if not value:
        why = f" (needed for {purpose})" if purpose else ""
        raise MissingSecretError(
            f"environment variable {name} is not set{why}; export it or add '{name}=...' to a "
            "git-ignored .env file in the working directory"
        )
    return value


def is_secret_name(name: str) -> bool:
    """Whether a config/env key name denotes a secret (``openai_api_key``, ``HF_TOKEN``, ...)."""
    last = str(name).rsplit(".", 1)[-1]
    if last.lower() in _NOT_SECRET:
        return False
    upper = last.upper()
    return upper in _SECRET_EXACT or upper.endswith(_SECRET_SUFFIXES)


def secret_values_from_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of secret-named environment variables long enough to scrub safely, longest first."""
    environ = os.environ if environ is None else environ
    values = {v for k, v in environ.items() if is_secret_name(k) and len(v) >= _MIN_SCRUB_LEN}
    # Longest first, so a secret that contains another is replaced whole.
    return sorted(values, key=len, reverse=True)


def scrub_text(text: str, secrets: Iterable[str] | None = None) -> str:
    """Replace every occurrence of a secret value in ``text`` by ``<redacted>``."""
    for secret in secret_values_from_env() if secrets is None else secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return text


def redact_secrets(obj: Any, secrets: Iterable[str] | None = None) -> Any:
    """A copy of a nested config (dicts/lists) with secret values replaced by ``<redacted>``.

    Keys are judged by :func:`is_secret_name`; a secret key whose value is ``None`` or empty stays as
    is (nothing to hide, and "not set" is useful to see). String values anywhere are also scrubbed of
    the values of secret environment variables.
    """
    secret_list = secret_values_from_env() if secrets is None else list(secrets)
    return _redact(obj, secret_list)


def _redact(obj: Any, secrets: list[str]) -> Any:
    if isinstance(obj, Mapping):
        out = {}
        for key, value in obj.items():
            hide = isinstance(key, str) and is_secret_name(key) and value not in (None, "")
            out[key] = REDACTED if hide else _redact(value, secrets)
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(_redact(v, secrets) for v in obj)
    if isinstance(obj, str):
        return scrub_text(obj, secrets)
    return obj
