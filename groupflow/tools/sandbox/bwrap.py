"""The default backend: bubblewrap (``bwrap``), an OS sandbox built from Linux namespaces.

Design decision: isolation comes from the kernel, not from checks inside the interpreter, so
what the code can reach is what is mounted, whatever language or native library it uses:

- a new mount namespace whose root holds only read-only system paths (``/usr`` and the links
  into it), the interpreter's prefix and the virtual environment, plus a writable tmpfs of
  ``max_disk_mb`` as the working directory — no home, no repository, no ``.env``, no ``/tmp``;
  ``/dev`` is read-only but for a 1 MiB ``/dev/shm`` (POSIX semaphores);
- new PID, network, IPC and UTS namespaces: no other process is visible (none can be signalled),
  and the network namespace holds a loopback device of its own, so nothing on the host or beyond
  is reachable and a socket that listens is heard by nobody;
- the supervisor (:mod:`groupflow.tools.sandbox.child`) is the namespace's first process
  (``--as-pid-1``): the code cannot signal it, ``/proc/1/cmdline`` names no host path, and when it
  ends — the code's process exited, or the trainer killed the group at the deadline — the kernel
  kills everything left in the namespace, including processes that called ``setsid`` or
  double-forked; ``--die-with-parent`` ends it with the trainer;
- no new user namespace (a seccomp filter, :mod:`groupflow.tools.sandbox.seccomp`, and
  ``--disable-userns`` where bubblewrap runs in one), so the code never holds a capability, not
  even one to mount a tmpfs of its own;
- when the trainer runs as root, the code runs as an unprivileged user of its own with no
  capabilities, so RLIMIT_NPROC caps its processes and threads (root is exempt) and nothing in
  the sandbox can raise its limits. As another user, bubblewrap makes a user namespace, in which
  the kernel counts RLIMIT_NPROC for the sandbox alone (it still exempts a trainer that is root
  on the host behind a user namespace of its own: then only a pids cgroup caps processes);
- where this process may make cgroups (:mod:`groupflow.tools.sandbox.cgroups`), each run gets
  one: all its memory — processes, tmpfs, memfds — within ``memory_mb + max_disk_mb`` (plus the
  supervisor's few MiB), and its processes within ``max_processes``; a kill for memory is
  reported as the ``memory`` limit. Without a memory cgroup, ``memfd_create`` is refused (nothing
  would bound it).

Resource limits (CPU, address space, file size, open files) are set in the child as before. A
sandbox that fails (bubblewrap's own error, a supervisor that never reported) raises
:class:`SandboxError`: it is never taken for the program's output.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from groupflow.tools.sandbox.cgroups import CgroupPlace, RunCgroup, find_cgroup
from groupflow.tools.sandbox.limits import (
    MAIN_FILE,
    MB,
    Job,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
)
from groupflow.tools.sandbox.process import Launch, child_config, child_environment, run_child
from groupflow.tools.sandbox.seccomp import seccomp_program

log = logging.getLogger(__name__)

CHILD_SCRIPT = Path(__file__).with_name("child.py")
WORKDIR = "/sandbox"  # the working directory inside; the host's folders never appear at it
CHILD_INSIDE = "/.groupflow/child.py"
# Users for the code when the trainer is root: one per run, from a range no system account uses,
# so RLIMIT_NPROC counts only that run's processes.
_UID_BASE, _UID_SPAN = 200_000, 50_000
SHM_MB = 1  # /dev/shm: room for POSIX semaphores (multiprocessing), not for data
# The supervisor's own pages in the run's memory cgroup, on top of memory_mb + max_disk_mb.
_SUPERVISOR_MB = 16
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


@dataclasses.dataclass(frozen=True)
class Setup:
    """How this machine's sandboxes are built, decided once per backend."""

    user_namespace: bool  # bubblewrap runs unprivileged, in a user namespace of its own
    disable_userns: bool  # and supports --disable-userns there
    cgroup: CgroupPlace | None
    seccomp: bool = True


def _namespace_args(setup: Setup) -> list[str]:
    args = [
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--as-pid-1",
        "--hostname",
        "sandbox",
    ]
    if setup.user_namespace:
        args.append("--unshare-user")
        if setup.disable_userns:
            args.append("--disable-userns")
    return args


@dataclasses.dataclass(frozen=True)
class Fds:
    """Descriptors bubblewrap reads (files to place, the child script, the seccomp filter) or
    hands to the supervisor (its status pipe, the run's cgroup.procs)."""

    files: dict[str, int]
    child: int
    status: int
    seccomp: int | None = None
    cgroups: tuple[int, ...] = ()

    def all(self) -> tuple[int, ...]:
        extra = () if self.seccomp is None else (self.seccomp,)
        return (*self.files.values(), self.child, self.status, *extra, *self.cgroups)


def build_argv(
    bwrap: str, job: Job, limits: SandboxLimits, fds: Fds, uid: int | None, setup: Setup
) -> list[str]:
    """The bubblewrap command line for one run."""
    readable = [os.path.realpath(p) for p in job.readable_paths]
    for path in readable:
        if not os.path.exists(path):
            raise ValueError(f"run_python: readable_paths: {path!r} does not exist")
    trees = list(_python_trees())
    argv = [bwrap, *_namespace_args(setup), *_system_binds()]
    # The working directory first: binds below cannot be hidden by it, and it holds only what
    # is copied in (the code and its files), owned by root but writable by the code's user.
    argv += ["--perms", "1777", "--size", str(limits.max_disk_mb * MB), "--tmpfs", WORKDIR]
    for name, fd in fds.files.items():
        argv += ["--perms", "0644", "--file", str(fd), f"{WORKDIR}/{name}"]
    argv += _dirs_for([*trees, *readable, CHILD_INSIDE])
    for tree in trees:
        argv += ["--ro-bind", tree, tree]
    for path in readable:
        argv += ["--ro-bind", path, path]
    # a copy, not a bind: the mount table would show where groupflow is checked out
    argv += ["--perms", "0644", "--file", str(fds.child), CHILD_INSIDE]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--perms", "1777", "--size", str(SHM_MB * MB), "--tmpfs", "/dev/shm"]
    argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORKDIR]
    if fds.seccomp is not None:
        argv += ["--seccomp", str(fds.seccomp)]
    if uid is not None:
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    # RLIMIT_NPROC: as root, for the code's own user (only its processes); in bubblewrap's user
    # namespace, for the namespace's one user, whom the supervisor is too
    processes = limits.max_processes + (0 if uid is not None else 1)
    config = child_config(
        "isolated", job, limits, processes, status_fd=fds.status, uid=uid,
        cgroup_fds=list(fds.cgroups),
    )  # fmt: skip
    return [*argv, sys.executable, "-s", "-B", CHILD_INSIDE, json.dumps(config)]


def _sandbox_uid() -> int | None:
    """A fresh unprivileged user for this run when we are root (None otherwise)."""
    if os.geteuid() != 0:
        return None
    return _UID_BASE + int.from_bytes(os.urandom(4), "little") % _UID_SPAN


class BwrapSandbox:
    """Runs code in a bubblewrap sandbox (see the module docstring)."""

    name = "bwrap"

    def __init__(self, bwrap: str, setup: Setup | None = None) -> None:
        self.bwrap = bwrap
        self.setup = setup or machine_setup(bwrap)
        self._cgroup_broken = False

    def run(self, job: Job, limits: SandboxLimits) -> SandboxResult:
        with tempfile.TemporaryDirectory(prefix="groupflow-sandbox-") as root:
            opened: list[int] = []
            status_read, status_write = os.pipe()
            os.set_blocking(status_read, False)
            cgroup = self._cgroup(limits)
            try:
                files = {MAIN_FILE: job.code.encode("utf-8"), **job.files}
                placed = {name: _file_fd(root, name, data, opened) for name, data in files.items()}
                fds = Fds(
                    placed,
                    _file_fd(root, "child.py", CHILD_SCRIPT.read_bytes(), opened),
                    status_write,
                    self._seccomp_fd(root, cgroup, opened),
                    tuple(cgroup.fds) if cgroup is not None else (),
                )
                stdin_path = os.path.join(root, "stdin")
                Path(stdin_path).write_bytes(job.stdin)
                argv = build_argv(self.bwrap, job, limits, fds, _sandbox_uid(), self.setup)
                launch = Launch(argv, root, child_environment(WORKDIR), stdin_path,
                                pass_fds=fds.all(), status_fd=status_read)  # fmt: skip
                result, reported = run_child(launch, limits, self.name)
                oom = cgroup is not None and cgroup.oom_killed()
            finally:
                for fd in (*opened, status_read, status_write):
                    _close_fd(fd)
                if cgroup is not None:
                    cgroup.close()
        if oom:  # the kernel killed a process for the run's memory limit
            return dataclasses.replace(result, limit="memory")
        if not reported and result.limit not in ("wall_time", "output"):
            raise SandboxError(
                f"bubblewrap failed to run the code (exit code {result.exit_code}): "
                f"{(result.stderr.strip() or '(no message)')[-500:]}"
            )
        return result

    def _cgroup(self, limits: SandboxLimits) -> RunCgroup | None:
        place = self.setup.cgroup
        if place is None or self._cgroup_broken:
            return None
        memory = (limits.memory_mb + limits.max_disk_mb + SHM_MB + _SUPERVISOR_MB) * MB
        try:
            return RunCgroup(place, memory, limits.max_processes + 1)  # + the supervisor
        except OSError as exc:
            self._cgroup_broken = True
            log.warning("code sandbox: cannot make a run cgroup (%s: %s); sandboxes keep their "
                        "per-process limits from now on", place.describe(), exc)  # fmt: skip
            return None

    def _seccomp_fd(self, root: str, cgroup: RunCgroup | None, opened: list[int]) -> int | None:
        if not self.setup.seccomp:
            return None
        bounded = cgroup is not None and "memory" in cgroup.paths
        program = seccomp_program(deny_memfd=not bounded)
        return None if program is None else _file_fd(root, "seccomp.bpf", program, opened)


def _file_fd(root: str, name: str, data: bytes, opened: list[int]) -> int:
    """A read-only descriptor of ``data`` (written to ``root/name``), recorded in ``opened``."""
    path = Path(root, name)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    opened.append(fd)
    return fd


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


@functools.cache
def machine_setup(bwrap: str) -> Setup:
    """Decided once: bubblewrap in a user namespace (when not root), ``--disable-userns`` where
    this bubblewrap has it (0.8+, not setuid), the cgroup place, if any."""
    user_ns = os.geteuid() != 0
    try:
        helped = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30)
        disable = "--disable-userns" in helped.stdout + helped.stderr
    except (OSError, subprocess.SubprocessError):
        disable = False
    setuid = bool(os.stat(bwrap).st_mode & 0o4000)
    place, why_not = find_cgroup()
    if place is None:
        log.info(
            "code sandbox: no cgroup (%s); memory and processes are limited per process", why_not
        )
    else:
        log.info("code sandbox: each run in its own %s", place.describe())
    if (
        user_ns
        and _host_root_behind_user_namespace()
        and (place is None or "pids" not in place.controllers)
    ):
        log.warning(
            "code sandbox: this process is root on the host behind a user namespace, which the "
            "kernel exempts from RLIMIT_NPROC, and no pids cgroup is writable here: max_processes "
            "does not bind (give the trainer a delegated cgroup: %s)", "GROUPFLOW_SANDBOX_CGROUP"
        )  # fmt: skip
    return Setup(user_ns, disable and user_ns and not setuid, place)


def _host_root_behind_user_namespace() -> bool:
    """Whether this process's user is root outside the user namespace it runs in."""
    try:
        lines = Path("/proc/self/uid_map").read_text().split("\n")
    except OSError:
        return False
    uid = os.geteuid()
    for line in lines:
        parts = line.split()
        if len(parts) == 3:
            inside, outside, count = map(int, parts)
            if inside <= uid < inside + count:
                return outside + (uid - inside) == 0
    return False


@functools.cache
def probe(bwrap: str) -> str | None:
    """None if bubblewrap can build this sandbox here, else why not (its own error message).

    Runs the interpreter once inside a sandbox set up like every run (without a cgroup): a bwrap
    binary may exist where the kernel or the container refuses the namespaces it needs.
    """
    try:
        result = BwrapSandbox(bwrap, dataclasses.replace(machine_setup(bwrap), cgroup=None)).run(
            Job(code="print('ok')"), SandboxLimits(timeout_s=30)
        )
    except (OSError, subprocess.SubprocessError, SandboxError) as exc:
        return str(exc)
    if result.exit_code != 0 or result.stdout != "ok\n":
        return result.stderr.strip() or f"exit code {result.exit_code}"
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
