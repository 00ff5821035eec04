"""Spawned child processes and the script that started the run: ``if __name__ == "__main__":``.

Design decision: a ``spawn``ed child process (the asynchronous rollout's, a ``process``-backend
worker's) imports the parent's ``__main__`` script again before it runs anything. A script that
starts a run at its top level, outside ``if __name__ == "__main__":``, therefore starts a second
run in the child — which used to fail, hang the parent, or, with ``run.overwrite``, delete the
parent's run files. So the parent looks before it spawns (:func:`unguarded_main_call`: is this
call made from the top level of a script a child would re-run, outside the guard?) and chooses
another way (the rollout side in a thread, with a warning), and a child refuses to start a run
at all (:func:`refuse_run_in_child`): a run directory belongs to the process that started it.
Standard library only.
"""

from __future__ import annotations

import ast
import multiprocessing
import sys
from pathlib import Path

__all__ = ["mark_worker_child", "refuse_run_in_child", "unguarded_main_call"]

_worker_child = False  # this process is a groupflow worker's spawned child


def _is_main_guard(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    values = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and values == ["__main__"]


def _guarded(source: str, line: int) -> bool:
    """Whether ``line`` of ``source`` lies in the body of an ``if __name__ == "__main__":``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and _is_main_guard(node.test) and node.body:
            if node.body[0].lineno <= line <= (node.body[-1].end_lineno or node.body[-1].lineno):
                return True
    return False


def unguarded_main_call() -> str | None:
    """``"<script> line <n>"`` when this call comes from the top level of the ``__main__`` script
    outside ``if __name__ == "__main__":`` and a spawned child would run that script again; else
    None (a guarded script, ``python -c``, a notebook or REPL, ``python -m pkg`` whose
    ``__main__`` spawn skips, or a source that cannot be read)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None:
        return None
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None and (spec_name == "__main__" or spec_name.endswith(".__main__")):
        return None  # spawn does not import a package's __main__ again
    frame = sys._getframe(1)
    while frame is not None and not (
        frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"
    ):
        frame = frame.f_back
    if frame is None:  # not called from the script's top level (e.g. from a thread)
        return None
    try:
        if _guarded(Path(path).read_text(encoding="utf-8"), frame.f_lineno):
            return None
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    return f"{path} line {frame.f_lineno}"


def mark_worker_child() -> None:
    """Called first in a groupflow worker's child process: no run may start there."""
    global _worker_child
    _worker_child = True


def refuse_run_in_child() -> None:
    """Raise RuntimeError in a process that must not start a run (and so must not touch a run
    directory): a spawned child importing the parent's script again, or a worker's child."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            "groupflow: this is a child process importing the main script again (multiprocessing "
            "spawn), and the script starts a run at its top level; a child never starts a run "
            'nor touches the run directory. Start the run under `if __name__ == "__main__":`'
        )
    if _worker_child:
        raise RuntimeError(
            "groupflow: a run cannot be started inside a groupflow worker's child process"
        )
