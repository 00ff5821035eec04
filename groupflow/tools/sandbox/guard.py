"""The opt-in ``guard`` backend: a plain subprocess with rlimits and a Python audit hook.

Design decision: kept for machines where no OS sandbox runs (macOS, a container that forbids
namespaces) and only by explicit choice (``sandbox="guard"``), because it is NOT a security
boundary: the checks run inside the interpreter that runs the code, so native code, standard
library modules written in C (``readline``, ``sqlite3``) and introspection reach around them.
It stops accidents (loops, memory blow-ups, floods, a stray ``rm``) and little else; an
independent review escaped it with plain standard-library calls. The first use in a process logs
a warning that says so.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

from groupflow.tools.sandbox.limits import MAIN_FILE, Job, SandboxLimits, SandboxResult
from groupflow.tools.sandbox.process import Launch, child_config, child_environment, run_child

log = logging.getLogger(__name__)

CHILD_SCRIPT = Path(__file__).with_name("child.py")

# Besides the working directory and the interpreter's library folders, Python code may read these.
_SYSTEM_READABLE = (
    "/dev/null",
    "/dev/zero",
    "/dev/random",
    "/dev/urandom",
    "/etc/localtime",
    "/usr/share/zoneinfo",
    "/proc/cpuinfo",
    "/proc/meminfo",
)


@functools.cache
def python_roots() -> tuple[str, ...]:
    """The interpreter's standard library and site-packages folders."""
    paths = sysconfig.get_paths()
    keys = ("stdlib", "platstdlib", "purelib", "platlib")
    return tuple(sorted({os.path.realpath(paths[k]) for k in keys if k in paths}))


@functools.cache
def _warn_once() -> None:
    log.warning(
        "code sandbox: using the in-process audit-hook guard (sandbox='guard'), which is NOT a "
        "security boundary: model-written code can escape it. Install bubblewrap for OS isolation."
    )


class GuardSandbox:
    """Runs code under :mod:`groupflow.tools.sandbox.child`'s audit hook (see the module doc)."""

    name = "guard"

    def run(self, job: Job, limits: SandboxLimits) -> SandboxResult:
        _warn_once()
        with tempfile.TemporaryDirectory(prefix="groupflow-sandbox-") as root:
            # The working directory is a subfolder so that stdin's file stays outside what the
            # code may read (it gets the content through fd 0, not by name).
            workdir = os.path.join(root, "work")
            os.mkdir(workdir, 0o700)
            Path(workdir, MAIN_FILE).write_text(job.code, encoding="utf-8")
            for name, content in job.files.items():
                Path(workdir, name).write_bytes(content)
            stdin_path = os.path.join(root, "stdin")
            Path(stdin_path).write_bytes(job.stdin)
            readable = [*python_roots(), *_SYSTEM_READABLE, *job.readable_paths]
            # RLIMIT_NPROC 0 binds non-root users only; the hook holds for root
            config = child_config("guard", job, limits, 0, readable=readable)
            argv = [sys.executable, "-s", "-B", str(CHILD_SCRIPT), json.dumps(config)]
            launch = Launch(argv, workdir, child_environment(workdir), stdin_path)
            return run_child(launch, limits, self.name)[0]
