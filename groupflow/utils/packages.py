"""Finding data files that PyPI packages ship, without importing the packages.

Design decision: some packages are used only as carriers of files (a GGUF model, TOML problem
sets) and their ``__init__`` imports things we do not install; ``importlib.util.find_spec`` finds
their directories without running any of their code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["find_package_file"]


def find_package_file(
    module: str, relative: str, *, package: str, install_hint: str, error: type[Exception]
) -> Path:
    """``relative`` (a file or directory) inside the installed ``module``; ``error`` names what to install."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise error(
            f"the PyPI package '{package}' is not installed; install it with: {install_hint}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / relative
        if path.exists():
            return path
    raise error(
        f"package '{package}' is installed at {list(spec.submodule_search_locations)} but contains no "
        f"{relative}; reinstall it with: {install_hint}"
    )
