"""Optional packages an environment adapter needs, checked before anything starts.

Design decision: a missing package is the user's to install, so it is a ``ValueError`` subclass
(the CLI shows it without a traceback, exit 2) naming the config key that asked for it and the
pip command that brings it.
"""

from __future__ import annotations

import importlib.util

__all__ = ["MissingEnvPackageError", "require"]


class MissingEnvPackageError(ValueError):
    """An environment's package is not installed (names the pip command)."""


def require(module: str, pip: str, key: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise MissingEnvPackageError(
            f"{key} needs the {module!r} package, which is not installed: {pip}"
        )
