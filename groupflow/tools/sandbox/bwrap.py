"""The default backend: bubblewrap (``bwrap``), an OS sandbox built from Linux namespaces.

Design decision: isolation comes from the kernel, not from checks inside the interpreter, so
what the code can reach is what is mounted, whatever language or native library it uses:

- a new mount namespace whose root holds only read-only system paths (``/usr`` and the links
  into it), the interpreter's prefix and the virtual environment, plus a writable tmpfs of
  ``max_disk_mb`` as the working directory — no home, no repository, no ``.env``, no ``/tmp``;
- new PID, network, IPC and UTS namespaces: no other process is visible (none can be signalled),
  and the network namespace holds a loopback device of its own, so nothing on the host or beyond
  is reachable and a socket that listens is heard by nobody;
- ``--die-with-parent`` and a kill of the whole group at the deadline: the namespace's first
  process dies, and the kernel kills everything left in the PID namespace with it, including
  processes that called ``setsid`` or double-forked;
- when the trainer runs as root (containers, CI), the code itself runs as an unprivileged user of
  its own with no capabilities, so RLIMIT_NPROC caps processes and threads (root is exempt) and
  nothing in the sandbox can raise its limits; a supervisor left behind as root reports the exit
  status (see :mod:`groupflow.tools.sandbox.child`). As another user the kernel applies
  ``max_processes`` to that user, who may have processes outside the sandbox as well.

Resource limits (CPU, address space, file size, open files) are set in the child as before.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from groupflow.tools.sandbox.limits import (
    MAIN_FILE,
    MB,
    Job,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
)
from groupflow.tools.sandbox.process import Launch, child_config, child_environment, run_child

CHILD_SCRIPT = Path(__file__).with_name("child.py")
WORKDIR = "/sandbox"  # the working directory inside; the host's folders never appear at it
CHILD_INSIDE = "/.groupflow/child.py"
# Users for the code when the trainer is root: one per run, from a range no system account uses,
# so RLIMIT_NPROC counts only that run's processes.
_UID_BASE, _UID_SPAN = 200_000, 50_000
INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install "
    "bubblewrap; Arch: pacman -S bubblewrap) where user namespaces are allowed"
)


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def _system_binds() -> list[str]:
    """Read-only binds of the system: /usr, and /bin, /lib... as links into it or as folders."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in ("/etc/localtime", "/etc/alternatives"):
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    return args


@functools.cache
def _python_trees() -> tuple[str, ...]:
    """Folders the interpreter needs: its own prefix, the virtual environment's, and the real
    location of the executable (a venv's python links into the base installation)."""
    trees = {
        os.path.realpath(p)
        for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)
    }
    trees.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    # Nested trees are covered by their parents; /usr is bound already.
    kept = sorted(t for t in trees if t != "/" and not t.startswith("/usr/") and t != "/usr")
    return tuple(t for t in kept if not any(t.startswith(o + os.sep) for o in kept if o != t))


def _dirs_for(paths: list[str]) -> list[str]:
    """``--dir`` for every ancestor of ``paths`` (mode 0755), so an unprivileged user can walk to
    them (bubblewrap would create them owner-only)."""
    args, made = [], set()
    for path in paths:
        parts = Path(path).parts[1:-1]
        for i in range(len(parts)):
            ancestor = "/" + "/".join(parts[: i + 1])
            if ancestor not in made and not ancestor.startswith("/usr"):
                made.add(ancestor)
                args += ["--perms", "0755", "--dir", ancestor]
    return args


def _namespace_args() -> list[str]:
    return [
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
    ]


def build_argv(
    bwrap: str,
    job: Job,
    limits: SandboxLimits,
    file_fds: dict[str, int],
    status_fd: int,
    uid: int | None,
) -> list[str]:
    """The bubblewrap command line for one run (``file_fds``: name -> readable descriptor)."""
    readable = [os.path.realpath(p) for p in job.readable_paths]
    for path in readable:
        if not os.path.exists(path):
            raise ValueError(f"run_python: readable_paths: {path!r} does not exist")
    trees = list(_python_trees())
    argv = [bwrap, *_namespace_args(), *_system_binds()]
    # The working directory first: binds below cannot be hidden by it, and it holds only what
    # is copied in (the code and its files), owned by root but writable by the code's user.
    argv += ["--perms", "1777", "--size", str(limits.max_disk_mb * MB), "--tmpfs", WORKDIR]
    for name, fd in file_fds.items():
        argv += ["--perms", "0644", "--file", str(fd), f"{WORKDIR}/{name}"]
    argv += _dirs_for([*trees, *readable, CHILD_INSIDE])
    for tree in trees:
        argv += ["--ro-bind", tree, tree]
    for path in readable:
        argv += ["--ro-bind", path, path]
    argv += ["--ro-bind", str(CHILD_SCRIPT), CHILD_INSIDE]
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/", "--chdir", WORKDIR]
    if uid is not None:
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    processes = limits.max_processes if uid is not None else None
    config = child_config("isolated", job, limits, processes, status_fd=status_fd, uid=uid)
    return [*argv, sys.executable, "-s", "-B", CHILD_INSIDE, json.dumps(config)]


def _sandbox_uid() -> int | None:
    """A fresh unprivileged user for this run when we are root (None otherwise)."""
    if os.geteuid() != 0:
        return None
    return _UID_BASE + int.from_bytes(os.urandom(4), "little") % _UID_SPAN


class BwrapSandbox:
    """Runs code in a bubblewrap sandbox (see the module docstring)."""

    name = "bwrap"

    def __init__(self, bwrap: str) -> None:
        self.bwrap = bwrap

    def run(self, job: Job, limits: SandboxLimits) -> SandboxResult:
        with tempfile.TemporaryDirectory(prefix="groupflow-sandbox-") as root:
            files = {MAIN_FILE: job.code.encode("utf-8"), **job.files}
            fds: dict[str, int] = {}
            status_read, status_write = os.pipe()
            os.set_blocking(status_read, False)
            try:
                for name, content in files.items():
                    path = Path(root, name)
                    path.write_bytes(content)
                    fds[name] = os.open(path, os.O_RDONLY)
                stdin_path = os.path.join(root, "stdin")
                Path(stdin_path).write_bytes(job.stdin)
                argv = build_argv(self.bwrap, job, limits, fds, status_write, _sandbox_uid())
                launch = Launch(
                    argv,
                    root,
                    child_environment(WORKDIR),
                    stdin_path,
                    pass_fds=(*fds.values(), status_write),
                    status_fd=status_read,
                )
                return run_child(launch, limits, self.name)
            finally:
                _close(fds)
                for fd in (status_read, status_write):
                    _close_fd(fd)


def _close(fds: dict[str, int]) -> None:
    for name in list(fds):
        _close_fd(fds.pop(name))


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


@functools.cache
def probe(bwrap: str) -> str | None:
    """None if bubblewrap can build this sandbox here, else why not (its own error message).

    Runs the interpreter once inside a minimal sandbox: a bwrap binary may exist where the kernel
    or the container refuses the namespaces it needs.
    """
    job = Job(code="print('ok')")
    try:
        with tempfile.TemporaryDirectory(prefix="groupflow-sandbox-probe-") as root:
            path = Path(root, MAIN_FILE)
            path.write_bytes(job.code.encode())
            fd = os.open(path, os.O_RDONLY)
            status_read, status_write = os.pipe()
            try:
                argv = build_argv(
                    bwrap, job, SandboxLimits(), {MAIN_FILE: fd}, status_write, _sandbox_uid()
                )
                done = subprocess.run(
                    argv,
                    cwd=root,
                    env=child_environment(WORKDIR),
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    timeout=30,
                    pass_fds=(fd, status_write),
                )
            finally:
                for descriptor in (fd, status_read, status_write):
                    _close_fd(descriptor)
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    if done.returncode != 0 or done.stdout != b"ok\n":
        return done.stderr.decode(errors="replace").strip() or f"exit code {done.returncode}"
    return None


def bwrap_sandbox() -> BwrapSandbox:
    """The bubblewrap backend, or SandboxUnavailable saying what to install or what failed."""
    path = bwrap_path()
    if path is None:
        raise SandboxUnavailable("the code sandbox needs bubblewrap (bwrap), which is not on PATH")
    problem = probe(path)
    if problem is not None:
        raise SandboxUnavailable(
            f"bubblewrap ({path}) cannot create a sandbox on this machine: {problem} (it needs "
            "user or mount namespaces: in a container, allow them, e.g. with --security-opt "
            "seccomp=unconfined, or run it privileged)"
        )
    return BwrapSandbox(path)
