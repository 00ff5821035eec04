"""Run one sandbox child process on this host: deadline, output caps, kill of the whole tree.

Design decision: the two local backends (bubblewrap and the opt-in guard) differ only in the
command line they start; everything about watching the child is here, once. The child gets its
own process group (so one ``killpg`` ends what it started outside a PID namespace) and an
environment built from scratch (nothing of the trainer's, so no API keys). Output is read in
bounded chunks and never buffered past the cap, and the deadline is enforced by this parent,
whatever the child does. A backend may pass a status pipe: a trusted supervisor inside the
sandbox writes the user process's wait status and CPU time to it, which the parent prefers to
what it can see of the child (a bubblewrap process reports neither).
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass

from groupflow.tools.sandbox.limits import MAIN_FILE, MB, Job, SandboxLimits, SandboxResult

_CHUNK = 65536
# The last line of a traceback: "pkg.module.SomeError: message" (or a bare "MemoryError").
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")


def child_environment(workdir: str) -> dict[str, str]:
    """The child's whole environment, built from nothing: no variable of the parent's leaks.

    ``PYTHONHASHSEED=0`` makes set and dict-of-str iteration orders, hence printed outputs,
    reproducible across runs (``python -I`` would ignore it, which is why the child is started
    with ``-s`` and a clean environment instead). One BLAS/OpenMP thread: the CPU-time limit
    counts every thread.
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


def child_config(
    mode: str, job: Job, limits: SandboxLimits, processes: int | None, **extra
) -> dict:
    """What :mod:`groupflow.tools.sandbox.child` reads from its argument: the mode, the limits
    it sets on itself and how to run ``main.py``; ``extra``: the mode's own entries."""
    return {
        "mode": mode,
        "filename": MAIN_FILE,
        "cpu_time_s": limits.cpu_seconds,
        "memory_bytes": limits.memory_mb * MB,
        "file_bytes": limits.max_file_mb * MB,
        "open_files": limits.max_open_files,
        "processes": processes,
        "echo_last_expression": job.echo_last_expression,
        **extra,
    }


@dataclass(frozen=True)
class Launch:
    """How to start one child: its command line, working directory and environment, the file
    for fd 0, descriptors it inherits, and the read end of a status pipe (or None)."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    stdin_path: str
    pass_fds: tuple[int, ...] = ()
    status_fd: int | None = None


def run_child(launch: Launch, limits: SandboxLimits, backend: str) -> tuple[SandboxResult, bool]:
    """Start the child, watch it until it ends or a limit passes, kill its group, report; and
    whether the status pipe's supervisor reported (True without a status pipe)."""
    started = time.monotonic()
    deadline = started + limits.timeout_s
    with open(launch.stdin_path, "rb") as stdin_file:
        proc = subprocess.Popen(
            launch.argv,
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=launch.cwd,
            env=launch.env,
            start_new_session=True,  # its own process group, so one killpg ends everything
            close_fds=True,
            pass_fds=launch.pass_fds,
        )
    try:
        capture = _read_capped(proc, limits.max_output_bytes, deadline)
        if capture.reason is None and not _exits_before(proc.pid, deadline):
            capture.reason = "wall_time"
    finally:
        # Kill the group before reaping: the unreaped leader keeps the group id from being
        # reused, so the signal cannot reach an unrelated process.
        _kill_group(proc.pid)
        wait_status, usage = os.wait4(proc.pid, 0)[1:]
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    duration = time.monotonic() - started
    code, cpu = proc.returncode, usage.ru_utime + usage.ru_stime
    status = _read_status(launch.status_fd) if capture.reason is None else None
    if status is not None:
        code, cpu = status
    reported = launch.status_fd is None or status is not None
    stdout = capture.out.decode("utf-8", errors="replace")
    stderr = capture.err.decode("utf-8", errors="replace")
    result = SandboxResult(
        stdout=stdout,
        stderr=stderr,
        exit_code=code,
        limit=capture.reason or limit_from_exit(code, stderr, cpu, limits),
        killed=code < 0,
        stdout_truncated=capture.out_truncated,
        stderr_truncated=capture.err_truncated,
        duration_s=duration,
        cpu_time_s=cpu,
        backend=backend,
    )
    return result, reported


def _read_status(fd: int | None) -> tuple[int, float] | None:
    """The supervisor's report ``{"exit_code": int, "cpu_s": float}``, or None if it wrote none
    (killed with the run) or something that is not one."""
    if fd is None:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    try:
        report = json.loads(data)
        return int(report["exit_code"]), float(report["cpu_s"])
    except (ValueError, KeyError, TypeError):
        return None


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
    assert proc.stdout is not None and proc.stderr is not None  # started with both piped
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


def limit_from_exit(code: int, stderr: str, cpu: float, limits: SandboxLimits) -> str | None:
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
    if "[Errno 28]" in message:  # ENOSPC: the working directory's size cap
        return "disk"
    return None
