"""Spotting a run started outside ``if __name__ == "__main__":`` before a child process would run
the script again, and refusing a run inside such a child. Each case is a real interpreter (a
script, ``-m``, ``-c``), with a hard timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CALL = "from groupflow.utils.main_guard import unguarded_main_call as where\n"


def _run(tmp_path, args, files):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}
    out = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.parametrize(
    "script, expected",
    [
        (CALL + "print(where())\n", "line 2"),
        (CALL + "def main():\n    print(where())\n\nx = 1\nmain()\n", "line 6"),
        (CALL + "if True:\n    print(where())\n", "line 3"),
        (CALL + "if __name__ == '__main__':\n    print(where())\n", "None"),
        (CALL + "def main():\n    print(where())\n\nif '__main__' == __name__:\n    main()\n",
         "None"),
        (CALL + "import threading\nt = threading.Thread(target=lambda: print(where()))\n"
         "t.start(); t.join()\n", "None"),  # not from the script's top level
    ],
)  # fmt: skip
def test_a_run_started_at_a_scripts_top_level_outside_the_guard_is_spotted(
    tmp_path, script, expected
):
    (line,) = _run(tmp_path, ["script.py"], {"script.py": script})
    if expected == "None":
        assert line == "None"
    else:
        assert line == f"{tmp_path / 'script.py'} {expected}"


def test_only_what_a_spawned_child_would_run_again_counts(tmp_path):
    files = {"mod.py": CALL + "print(where())\n", "pkg/__init__.py": "",
             "pkg/__main__.py": CALL + "print(where())\n"}  # fmt: skip
    assert _run(tmp_path, ["-m", "mod"], files) == [f"{tmp_path / 'mod.py'} line 2"]
    assert _run(tmp_path, ["-m", "pkg"], files) == ["None"]  # spawn skips a __main__ module
    assert _run(tmp_path, ["-c", CALL + "print(where())"], {}) == ["None"]  # no file


def test_a_spawned_child_importing_the_script_again_refuses_a_run(tmp_path):
    script = """
        import multiprocessing as mp
        from groupflow.utils import main_guard

        try:
            main_guard.refuse_run_in_child()
            print("parent may start a run" if __name__ == "__main__" else "child may")
        except RuntimeError as e:
            print("child refused:", "if __name__" in str(e))

        def target():
            print("child runs its target")
            main_guard.mark_worker_child()
            try:
                main_guard.refuse_run_in_child()
            except RuntimeError as e:
                print("worker child refused:", "worker" in str(e))

        if __name__ == "__main__":
            p = mp.get_context("spawn").Process(target=target)
            p.start()
            p.join()
        """
    assert _run(tmp_path, ["script.py"], {"script.py": script}) == [
        "parent may start a run",
        "child refused: True",
        "child runs its target",
        "worker child refused: True",
    ]
