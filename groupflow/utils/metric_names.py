"""Metric names per logger backend: each gets names it accepts and can query; JSONL keeps ours.

Design decision: groupflow names metrics for people (``val/sampled/mean@4``,
``reward/<data source>/mean``), and some backends restrict names. MLflow rejects a name with a
character outside letters, digits, ``_ - . /`` and space (``:`` too, except on Windows) or one
that is not a normalised path (``a//b``, ``./a``, a trailing ``/``), and longer than 250
characters — and one bad name fails the whole batch; its file store (the default here) also keeps
each metric in a file named by its path, so ``val/greedy/acc`` and ``val/greedy/acc/<source>``
cannot both exist (the longer one becomes ``val/greedy/acc.<source>``). W&B accepts any name but sorts and filters
only names of letters, digits and ``_`` that do not start with a digit (``/`` separates its panel
sections). TensorBoard (torch's ``SummaryWriter``) stores any tag unchanged, so it needs nothing.
A restricting backend logs through a :class:`NameMap`: ``@`` reads ``_at_``, any other refused
character becomes ``_``, empty or dot-only path parts go; each name is translated once, and two
names that would meet get ``_2``, ``_3``, ... (with one warning) instead of overwriting each other.
``metrics.jsonl``, the console and the plots keep the original names.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

__all__ = ["MLFLOW", "WANDB", "NameMap", "NameRule", "backend_name"]


@dataclass(frozen=True)
class NameRule:
    backend: str
    refused: re.Pattern[str]  # one character a name may not contain
    max_length: int | None = None
    letter_first: bool = False  # the name may not start with a digit
    paths_are_files: bool = False  # a name may not be the parent "directory" of another


# mlflow.utils.validation: "^[/\w.\- ]*$" on every OS (":" is refused on Windows, so never used)
MLFLOW = NameRule("mlflow", re.compile(r"[^\w\-. /]"), max_length=250, paths_are_files=True)
# W&B's documented GraphQL rule ^[_a-zA-Z][_a-zA-Z0-9]*$, per "/"-separated section
WANDB = NameRule("wandb", re.compile(r"[^A-Za-z0-9_/]"), letter_first=True)


def backend_name(name: str, rule: NameRule) -> str:
    """``name`` as ``rule``'s backend accepts it (unchanged when it already does)."""
    text = rule.refused.sub("_", name.replace("@", "_at_"))
    # a normalised relative path: no empty parts (a//b, leading or trailing /), no . or .. parts
    parts = [p if p.strip(".") else "_" for p in text.split("/") if p]
    text = "/".join(parts) or "_"
    if rule.letter_first and text[0].isdigit():
        text = "_" + text
    if rule.max_length is not None:
        text = text[: rule.max_length].rstrip("/")
    return text


class NameMap:
    """Translates metric names for one backend, keeping distinct names distinct."""

    def __init__(self, rule: NameRule) -> None:
        self.rule = rule
        self._names: dict[str, str] = {}
        self._taken: set[str] = set()
        self._dirs: set[str] = set()  # proper path prefixes of the names taken

    def _beside_files(self, text: str) -> str:
        """Join the parts below an already logged name with "." (that name is a file there)."""
        parts = text.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in self._taken:
                return "/".join(parts[:i]) + "." + ".".join(parts[i:])
        return text

    def _clashes(self, text: str) -> bool:
        return text in self._taken or (self.rule.paths_are_files and text in self._dirs)

    def __call__(self, name: str) -> str:
        found = self._names.get(name)
        if found is not None:
            return found
        base = backend_name(name, self.rule)
        if self.rule.paths_are_files:
            base = self._beside_files(base)
        translated, n = base, 1
        while self._clashes(translated):
            n += 1
            suffix = f"_{n}"
            limit = self.rule.max_length
            translated = (base if limit is None else base[: limit - len(suffix)]) + suffix
        if translated != base:
            warnings.warn(
                f"{self.rule.backend}: metric {name!r} would be logged as {base!r}, which another "
                f"metric's name takes there; logging it as {translated!r}",
                stacklevel=3,
            )
        self._names[name] = translated
        self._taken.add(translated)
        parts = translated.split("/")
        self._dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        return translated

    def translate(self, metrics: dict[str, float]) -> dict[str, float]:
        return {self(k): v for k, v in metrics.items()}
