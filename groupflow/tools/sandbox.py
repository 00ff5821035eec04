"""Run model-written Python in a limited subprocess: :func:`run_python` -> :class:`SandboxResult`.

Design decision: one fresh interpreter per run, in a fresh temporary directory that is deleted
afterwards, with an environment built from scratch (nothing of the trainer's, so no API keys), and
limits enforced at three levels: the kernel (``setrlimit``: CPU seconds, address space, file size,
open files, no core dumps, no new processes for non-root users), an audit hook installed before
the code runs (no new processes even as root, no network, no writes outside the working directory,
no reads outside it and Python's own files: see :mod:`groupflow.tools.sandbox_child`), and this
parent (wall-clock deadline and output cap, both enforced by killing the child's whole process
group; output is read in bounded chunks, never buffered past the cap).

What this is: a guard against accidents (infinite loops, memory blow-ups, output floods, a stray
``rm``) and against the reward hacking a small policy stumbles into. What it is not: a security
boundary. Code that loads native code (an installed C extension) bypasses the audit hook, and
Python offers introspection tricks a determined attacker can use. Untrusted code from people
belongs in a container or a kernel-level sandbox (nsjail, gVisor, Firecracker) — run the trainer
inside one, or point a reward at a service such as SandboxFusion.
"""

from __future__ import annotations

import functools
import math
import os
import re
import selectors
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CHILD_SCRIPT = Path(__file__).with_name("sandbox_child.py")
MAIN_FILE = "main.py"
_CHUNK = 65536
_MB = 1 << 20

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

# The last line of a traceback: "pkg.module.SomeError: message" (or a bare "MemoryError").
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")

LIMIT_REASONS = ("wall_time", "cpu_time", "memory", "output", "file_size", "guard")


@dataclass(frozen=True)
class SandboxLimits:
    """The limits of one run, validated on construction (errors name the parameter).

    Args:
        timeout_s: wall-clock seconds before the whole process group is killed.
        cpu_time_s: CPU seconds (RLIMIT_CPU, rounded up to whole seconds); None = ``timeout_s``.
        memory_mb: address-space limit (RLIMIT_AS) in MiB; allocations beyond it raise MemoryError.
        max_output_bytes: bytes kept of stdout and of stderr each; more kills the run.
        max_file_mb: largest file the code may write (RLIMIT_FSIZE), MiB.
        max_open_files: file descriptors (RLIMIT_NOFILE).
    """

    timeout_s: float = 5.0
    cpu_time_s: float | None = None
    memory_mb: int = 512
    max_output_bytes: int = 65536
    max_file_mb: int = 16
    max_open_files: int = 64

    def __post_init__(self) -> None:
        _positive_number("timeout_s", self.timeout_s)
        if self.cpu_time_s is not None:
            _positive_number("cpu_time_s", self.cpu_time_s)
        _int_at_least("memory_mb", self.memory_mb, 32)
        _int_at_least("max_output_bytes", self.max_output_bytes, 1)
        _int_at_least("max_file_mb", self.max_file_mb, 0)
        _int_at_least("max_open_files", self.max_open_files, 16)

    @property
    def cpu_seconds(self) -> int:
        """The whole CPU seconds given to RLIMIT_CPU."""
        seconds = self.timeout_s if self.cpu_time_s is None else self.cpu_time_s
        return max(1, math.ceil(seconds))

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`run_python`."""
        return asdict(self)


def _positive_number(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"sandbox limit {name} must be a positive number of seconds, got {value!r}"
        )


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"sandbox limit {name} must be an integer >= {low}, got {value!r}")


_DEFAULTS = SandboxLimits()


@dataclass(frozen=True)
class SandboxResult:
    """What one run produced and why it ended.

    ``exit_code`` follows :mod:`subprocess`: negative means killed by that signal. ``limit`` names
    the limit that ended the run, one of :data:`LIMIT_REASONS` (``"guard"``: the code attempted
    something the sandbox refuses and did not handle the PermissionError), or None.
    ``killed``: a signal ended the process (sent by the parent or by the kernel).
    """

    stdout: str
    stderr: str
    exit_code: int
    limit: str | None
    killed: bool
    stdout_truncated: bool
    stderr_truncated: bool
    duration_s: float
    cpu_time_s: float

    @property
    def timed_out(self) -> bool:
        """The wall-clock deadline passed and the run was killed."""
        return self.limit == "wall_time"

    @property
    def ok(self) -> bool:
        """Exited with status 0 within every limit."""
        return self.exit_code == 0 and self.limit is None

    @property
    def error_line(self) -> str:
        """The last non-empty line of stderr (for a traceback: the exception and its message)."""
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""


def run_python(
    code: str,
    *,
    stdin: str | bytes | None = None,
    files: dict[str, str | bytes] | None = None,
    timeout_s: float = _DEFAULTS.timeout_s,
    cpu_time_s: float | None = _DEFAULTS.cpu_time_s,
    memory_mb: int = _DEFAULTS.memory_mb,
    max_output_bytes: int = _DEFAULTS.max_output_bytes,
    max_file_mb: int = _DEFAULTS.max_file_mb,
    max_open_files: int = _DEFAULTS.max_open_files,
    echo_last_expression: bool = False,
    readable_paths: tuple[str, ...] = (),
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh sandboxed interpreter and return what happened.

    Args:
        code: the program's source.
        stdin: the program's standard input (None: empty, like ``/dev/null``).
        files: extra files to place next to ``main.py`` (plain names, no folders).
        timeout_s, cpu_time_s, memory_mb, max_output_bytes, max_file_mb, max_open_files:
            see :class:`SandboxLimits`.
        echo_last_expression: print the repr of a final expression statement (notebook style).
        readable_paths: further files or folders the code may read.

    Never raises for anything the code does; raises ValueError for bad arguments.
    """
    limits = SandboxLimits(
        timeout_s, cpu_time_s, memory_mb, max_output_bytes, max_file_mb, max_open_files
    )
    if not isinstance(code, str):
        raise ValueError(f"run_python: code must be a string, got {type(code).__name__}")
    stdin_bytes = _as_bytes("stdin", b"" if stdin is None else stdin)
    extra_files = _check_files(files or {})
    if not isinstance(readable_paths, (tuple, list)) or not all(
        isinstance(p, str) for p in readable_paths
    ):
        raise ValueError(
            f"run_python: readable_paths must be a list of paths, got {readable_paths!r}"
        )
    if not hasattr(os, "killpg") or not hasattr(os, "waitid"):
        raise RuntimeError("run_python needs a POSIX system (Linux or macOS)")
    with tempfile.TemporaryDirectory(prefix="groupflow-sandbox-") as root:
        # The working directory is a subfolder so that stdin's file stays outside what the code
        # may read (it gets the content through fd 0, not by name).
        workdir = os.path.join(root, "work")
        os.mkdir(workdir, 0o700)
        Path(workdir, MAIN_FILE).write_text(code, encoding="utf-8")
        for name, content in extra_files.items():
            Path(workdir, name).write_bytes(content)
        stdin_path = os.path.join(root, "stdin")
        Path(stdin_path).write_bytes(stdin_bytes)
        config = {
            "filename": MAIN_FILE,
            "cpu_time_s": limits.cpu_seconds,
            "memory_bytes": limits.memory_mb * _MB,
            "file_bytes": limits.max_file_mb * _MB,
            "open_files": limits.max_open_files,
            "echo_last_expression": bool(echo_last_expression),
            "readable": [*_python_roots(), *_SYSTEM_READABLE, *readable_paths],
        }
        return _execute(config, workdir, stdin_path, limits)


def _as_bytes(name: str, value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytes):
        return value
    raise ValueError(f"run_python: {name} must be str or bytes, got {type(value).__name__}")


def _check_files(files: Any) -> dict[str, bytes]:
    if not isinstance(files, dict):
        raise ValueError(f"run_python: files must be a dict of name -> content, got {files!r}")
    checked = {}
    for name, content in files.items():
        if (
            not isinstance(name, str)
            or not name
            or name in (".", "..", MAIN_FILE)
            or "/" in name
            or "\\" in name
            or "\0" in name
        ):
            raise ValueError(
                f"run_python: files: {name!r} is not a plain file name (no folders, not {MAIN_FILE})"
            )
        checked[name] = _as_bytes(f"files[{name!r}]", content)
    return checked


@functools.cache
def _python_roots() -> tuple[str, ...]:
    """The interpreter's standard library and site-packages folders (readable by the code)."""
    paths = sysconfig.get_paths()
    keys = ("stdlib", "platstdlib", "purelib", "platlib")
    return tuple(sorted({os.path.realpath(paths[k]) for k in keys if k in paths}))


def child_environment(workdir: str) -> dict[str, str]:
    """The child's whole environment, built from nothing: no variable of the parent's leaks.

    ``PYTHONHASHSEED=0`` makes set and dict-of-str iteration orders, hence printed outputs,
    reproducible across runs (``python -I`` would ignore it, which is why the child is started
    with ``-s`` and a clean environment instead). One BLAS/OpenMP thread: the CPU-time limit
    counts every thread, and the process may not create more for non-root users anyway.
    """
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONNOUSERSITE": "1",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _execute(
    config: dict[str, Any], workdir: str, stdin_path: str, limits: SandboxLimits
) -> SandboxResult:
    import json

    argv = [sys.executable, "-s", "-B", str(CHILD_SCRIPT), json.dumps(config)]
    started = time.monotonic()
    deadline = started + limits.timeout_s
    with open(stdin_path, "rb") as stdin_file:
        proc = subprocess.Popen(
            argv,
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=child_environment(workdir),
            start_new_session=True,  # its own process group, so one killpg ends everything
            close_fds=True,
        )
    try:
        capture = _read_capped(proc, limits.max_output_bytes, deadline)
        if capture.reason is None and not _exits_before(proc.pid, deadline):
            capture.reason = "wall_time"
    finally:
        # Kill the group before reaping: the unreaped leader keeps the group id from being
        # reused, so the signal cannot reach an unrelated process.
        _kill_group(proc.pid)
        status, usage = os.wait4(proc.pid, 0)[1:]
        proc.returncode = os.waitstatus_to_exitcode(status)
        proc.stdout.close()
        proc.stderr.close()
    duration = time.monotonic() - started
    cpu = usage.ru_utime + usage.ru_stime
    stdout = capture.out.decode("utf-8", errors="replace")
    stderr = capture.err.decode("utf-8", errors="replace")
    code = proc.returncode
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        exit_code=code,
        limit=capture.reason or _limit_from_exit(code, stderr, cpu, limits),
        killed=code < 0,
        stdout_truncated=capture.out_truncated,
        stderr_truncated=capture.err_truncated,
        duration_s=duration,
        cpu_time_s=cpu,
    )


@dataclass
class _Capture:
    out: bytearray
    err: bytearray
    out_truncated: bool = False
    err_truncated: bool = False
    reason: str | None = None  # "output" or "wall_time" when the parent ended the run


def _read_capped(proc: subprocess.Popen, cap: int, deadline: float) -> _Capture:
    """Read stdout and stderr until both close, the deadline passes, or one exceeds ``cap``.

    Reads at most ``cap + 1`` bytes per stream in total (in chunks of 64 KiB), so a flood costs
    the parent ``O(cap)`` memory however fast the child writes.
    """
    capture = _Capture(bytearray(), bytearray())
    buffers = {proc.stdout.fileno(): "out", proc.stderr.fileno(): "err"}
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                capture.reason = "wall_time"
                return capture
            for key, _ in selector.select(remaining):
                name = buffers[key.fd]
                buffer = getattr(capture, name)
                chunk = os.read(key.fd, min(_CHUNK, cap + 1 - len(buffer)))
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer += chunk
                if len(buffer) > cap:
                    del buffer[cap:]
                    setattr(capture, f"{name}_truncated", True)
                    capture.reason = "output"
                    return capture
    return capture


def _exits_before(pid: int, deadline: float) -> bool:
    """Wait (without reaping) for ``pid`` to exit; False if the deadline passes first."""
    delay = 0.001
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.02)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass


def _limit_from_exit(code: int, stderr: str, cpu: float, limits: SandboxLimits) -> str | None:
    """Which limit (if any) ended a run that the parent did not kill."""
    if code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu >= limits.cpu_seconds):
        return "cpu_time"
    if code == 0:
        return None
    lines = [line for line in stderr.splitlines() if line.strip()]
    match = _EXCEPTION_LINE.match(lines[-1]) if lines else None
    if match is None:
        return None
    exception, message = match.group(1), match.group(2) or ""
    if exception.endswith("MemoryError"):  # also numpy's _ArrayMemoryError
        return "memory"
    if message.startswith("sandbox: "):
        return "guard"
    if "[Errno 27]" in message:  # EFBIG: RLIMIT_FSIZE (Python ignores SIGXFSZ)
        return "file_size"
    return None
