"""User code referenced by import path (``"package.module:attr"``, or a file: ``"path/to/file.py:attr"``):
rewards, tools, environments, workflows.

Design decision: one resolver for every extension point that config names by import path, so a
typo gets the same kind of message everywhere — which module failed to import (and why), or which
attribute is missing, with the closest public name — and the caller only says what it was looking
for and which error type its layer raises.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

__all__ = ["resolve_import_path"]


def resolve_import_path(path: str, what: str, error: type[Exception] = ValueError) -> Any:
    """Import ``"package.module:attr"`` (``attr`` may be dotted: ``module:Class.method``).

    ``what`` names the thing in messages (e.g. "tool 'calc'"); failures raise ``error``.
    """
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise error(f"{what}: must look like 'package.module:function', got {path!r}")
    module_name, attr = path.split(":")
    if module_name.endswith(".py") and not Path(module_name).expanduser().is_file():
        raise error(
            f"{what}: file '{module_name}' does not exist (relative paths start at {Path.cwd()})"
        )
    try:
        if module_name.endswith(".py"):
            module = _import_file(Path(module_name))
        else:
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name + ".").startswith(exc.name + "."):
            raise error(
                f"{what}: cannot import module {module_name!r} ({exc}); "
                "is it installed or on PYTHONPATH?"
            ) from exc
        raise error(
            f"{what}: importing module {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    except Exception as exc:  # the module exists but its own code failed: surface that
        raise error(
            f"{what}: importing module {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    target: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(target, part):
            owner = ".".join([module_name, *attr.split(".")[:i]])
            public = sorted(n for n in dir(target) if not n.startswith("_"))
            close = difflib.get_close_matches(part, public, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise error(f"{what}: {owner!r} has no attribute {part!r} (from {path!r}){hint}")
        target = getattr(target, part)
    return target


def _import_file(path: Path):
    resolved = path.expanduser().resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    name = f"groupflow_user_{resolved.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import '{resolved}' as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
