"""What a sandbox run is asked to do and what it reports: :class:`Job`, :class:`SandboxLimits`,
:class:`SandboxResult`.

Design decision: these types are shared by every backend (bubblewrap, a remote service, the
opt-in audit-hook guard), so a tool or reward is written once against them and the backend is a
choice of configuration. Arguments are validated here, on construction, so a bad limit or file
name is a ``ValueError`` naming the parameter whatever backend would have run it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

MAIN_FILE = "main.py"
MB = 1 << 20

# "disk": the working directory's size cap (ENOSPC); "guard": the opt-in audit hook refused.
LIMIT_REASONS = ("wall_time", "cpu_time", "memory", "output", "file_size", "disk", "guard")


class SandboxUnavailable(RuntimeError):
    """No backend that isolates code can run here; the message says what to install."""


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the code in it): bubblewrap's own error, a service that
    does not answer, a malformed reply. Callers treat it as a failure of that sample or tool
    call, counted as a sandbox failure, never as the program's result."""


class SandboxBroken(RuntimeError):
    """The sandbox failed on every one of the last runs (``MAX_CONSECUTIVE_FAILURES``): the run
    stops. Not a :class:`SandboxError`, so a handler of one run's failure does not swallow it."""


@dataclass(frozen=True)
class SandboxLimits:
    """The limits of one run, validated on construction (errors name the parameter).

    Args:
        timeout_s: wall-clock seconds before the whole process tree is killed.
        cpu_time_s: CPU seconds (RLIMIT_CPU, rounded up to whole seconds); None = ``timeout_s``.
        memory_mb: address-space limit (RLIMIT_AS) in MiB; allocations beyond it raise MemoryError.
        max_output_bytes: bytes kept of stdout and of stderr each; more kills the run.
        max_file_mb: largest file the code may write (RLIMIT_FSIZE), MiB.
        max_open_files: file descriptors (RLIMIT_NOFILE).
        max_disk_mb: size of the writable working directory (an OS sandbox's tmpfs), MiB.
        max_processes: processes and threads the code may have at once (RLIMIT_NPROC for the
            sandbox's own user; an OS sandbox only).
    """

    timeout_s: float = 5.0
    cpu_time_s: float | None = None
    memory_mb: int = 512
    max_output_bytes: int = 65536
    max_file_mb: int = 16
    max_open_files: int = 64
    max_disk_mb: int = 64
    max_processes: int = 16

    def __post_init__(self) -> None:
        _positive_number("timeout_s", self.timeout_s)
        if self.cpu_time_s is not None:
            _positive_number("cpu_time_s", self.cpu_time_s)
        _int_at_least("memory_mb", self.memory_mb, 32)
        _int_at_least("max_output_bytes", self.max_output_bytes, 1)
        _int_at_least("max_file_mb", self.max_file_mb, 0)
        _int_at_least("max_open_files", self.max_open_files, 16)
        _int_at_least("max_disk_mb", self.max_disk_mb, 1)
        _int_at_least("max_processes", self.max_processes, 1)

    @property
    def cpu_seconds(self) -> int:
        """The whole CPU seconds given to RLIMIT_CPU."""
        seconds = self.timeout_s if self.cpu_time_s is None else self.cpu_time_s
        return max(1, math.ceil(seconds))

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`groupflow.tools.sandbox.run_python`."""
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


@dataclass(frozen=True)
class Job:
    """One program to run: ``code`` as ``main.py`` with ``files`` beside it and ``stdin`` on fd 0.

    ``echo_last_expression`` prints the repr of a final expression statement (notebook style);
    ``readable_paths`` are host files or folders the code may read (read-only).
    """

    code: str
    stdin: bytes = b""
    files: dict[str, bytes] = field(default_factory=dict)
    echo_last_expression: bool = False
    readable_paths: tuple[str, ...] = ()

    @classmethod
    def checked(
        cls,
        code: Any,
        stdin: Any = None,
        files: Any = None,
        echo_last_expression: bool = False,
        readable_paths: Any = (),
    ) -> Job:
        """A Job from caller arguments; ValueError names the bad one."""
        if not isinstance(code, str):
            raise ValueError(f"run_python: code must be a string, got {type(code).__name__}")
        if not isinstance(readable_paths, (tuple, list)) or not all(
            isinstance(p, str) for p in readable_paths
        ):
            raise ValueError(
                f"run_python: readable_paths must be a list of paths, got {readable_paths!r}"
            )
        return cls(
            code=code,
            stdin=_as_bytes("stdin", b"" if stdin is None else stdin),
            files=_check_files(files or {}),
            echo_last_expression=bool(echo_last_expression),
            readable_paths=tuple(readable_paths),
        )


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


@dataclass(frozen=True)
class SandboxResult:
    """What one run produced and why it ended.

    ``exit_code`` follows :mod:`subprocess`: negative means killed by that signal. ``limit`` names
    the limit that ended the run, one of :data:`LIMIT_REASONS` (``"guard"``: the opt-in audit
    hook refused something and the code did not handle the PermissionError), or None.
    ``killed``: a signal ended the process (sent by the parent or by the kernel). ``backend``
    names the sandbox that ran the code.
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
    backend: str = ""

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
