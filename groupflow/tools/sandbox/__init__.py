"""Run model-written Python in a sandbox: :func:`run_python` -> :class:`SandboxResult`.

Design decision: a sandbox is a backend behind one small interface (``name`` and
``run(job, limits) -> SandboxResult``), chosen by a spec, so tools and rewards never know which
one runs their code:

- ``"bwrap"`` (what ``"auto"``, the default, means): an OS sandbox from Linux namespaces —
  read-only system, a size-capped tmpfs as the only writable place, no network, its own PID
  namespace torn down at the deadline, rlimits, an unprivileged user of its own
  (:mod:`~groupflow.tools.sandbox.bwrap`);
- ``{"backend": "remote", "url": ...}`` (or just the URL): a SandboxFusion-compatible service,
  for clusters (:mod:`~groupflow.tools.sandbox.remote`);
- ``"guard"``: the old in-process audit-hook guard, only by explicit opt-in: it is NOT a security
  boundary (:mod:`~groupflow.tools.sandbox.guard`).

Where no isolating backend works, resolving ``"auto"`` raises :class:`SandboxUnavailable` naming
every remedy: the code tool and the code rewards resolve their sandbox when they are built (and
nothing else does), so a run that would execute model code refuses to start rather than run it
unisolated. A run whose sandbox fails raises :class:`SandboxError` (counted here); one that fails
``MAX_CONSECUTIVE_FAILURES`` times in a row raises :class:`SandboxBroken`, which stops the run. ``GROUPFLOW_SANDBOX`` sets the
spec for a machine (``bwrap``, ``guard`` or a service URL) where a tool or reward does not.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Protocol

from groupflow.tools.sandbox.bwrap import INSTALL_HINT, bwrap_sandbox
from groupflow.tools.sandbox.guard import GuardSandbox
from groupflow.tools.sandbox.limits import (
    LIMIT_REASONS,
    MAIN_FILE,
    Job,
    SandboxBroken,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
)
from groupflow.tools.sandbox.process import child_environment
from groupflow.tools.sandbox.remote import RemoteSandbox

__all__ = [
    "LIMIT_REASONS",
    "MAIN_FILE",
    "BACKENDS",
    "Job",
    "MAX_CONSECUTIVE_FAILURES",
    "Sandbox",
    "SandboxBroken",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "child_environment",
    "resolve_sandbox",
    "run_python",
    "sandbox_failures",
]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "bwrap", "remote", "guard")
# Runs in a row whose sandbox failed (not their code) before the run stops with SandboxBroken.
MAX_CONSECUTIVE_FAILURES = 8
ENV_VAR = "GROUPFLOW_SANDBOX"
_DEFAULTS = SandboxLimits()


class Sandbox(Protocol):
    """What a backend provides."""

    name: str

    def run(self, job: Job, limits: SandboxLimits) -> SandboxResult: ...


_resolved: dict[Any, Sandbox] = {}


def resolve_sandbox(spec: Any = None) -> Sandbox:
    """The backend for ``spec`` (see the module docstring); built once per spec and process.

    ``spec``: None (``$GROUPFLOW_SANDBOX``, else ``"auto"``), a backend name, an http(s) URL (a
    remote service), a dict ``{"backend": NAME, **options}`` (``remote`` takes ``url``,
    ``api_key_env``, ``retries``, ``backoff_s``, ``overhead_s``), or a backend object.
    Raises SandboxUnavailable (nothing isolating works here) or ValueError (a bad spec).
    """
    if spec is None:
        spec = os.environ.get(ENV_VAR) or "auto"
    if hasattr(spec, "run") and hasattr(spec, "name"):
        return spec
    if isinstance(spec, str) and spec.startswith(("http://", "https://")):
        spec = {"backend": "remote", "url": spec}
    if isinstance(spec, str):
        spec = {"backend": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("backend"), str):
        raise ValueError(
            f"sandbox must be one of {list(BACKENDS)}, a service URL or "
            f"{{'backend': NAME, ...options}}; got {spec!r}"
        )
    key = tuple(sorted((k, repr(v)) for k, v in spec.items()))
    if key not in _resolved:
        _resolved[key] = _build(dict(spec))
    return _resolved[key]


def _build(spec: dict[str, Any]) -> Sandbox:
    backend = spec.pop("backend")
    if backend not in BACKENDS:
        raise ValueError(f"sandbox backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "remote":
        if "url" not in spec:
            raise ValueError("sandbox backend 'remote' needs a 'url' (the service's base URL)")
        try:
            return RemoteSandbox(**spec)
        except TypeError as exc:
            raise ValueError(f"sandbox backend 'remote': {exc}") from None
    if spec:
        raise ValueError(f"sandbox backend {backend!r} takes no options, got {sorted(spec)}")
    if backend == "guard":
        return GuardSandbox()
    try:
        return bwrap_sandbox()
    except SandboxUnavailable as exc:
        raise SandboxUnavailable(f"{exc}. {REMEDIES}") from None


# Said wherever no isolating sandbox can be built (the code tool and the code rewards refuse to
# build then): every way on, the guard last and only for the run that names it.
REMEDIES = (
    "Model-written code runs only in an isolating sandbox. Either "
    f"{INSTALL_HINT}; or run the code in a SandboxFusion service (sandbox: {{backend: remote, "
    "url: http://HOST:PORT}); or, for this run only and knowing that it is not a security "
    "boundary, opt in to the in-process guard (sandbox: guard in the kwargs of this tool or "
    "reward)"
)


class _Health:
    """Sandbox failures of this process: in a row (to stop a run whose sandbox is broken) and in
    all (what tools and rewards report)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_a_row = 0
        self.total = 0

    def ok(self) -> None:
        with self.lock:
            self.in_a_row = 0

    def failed(self, backend: str, exc: SandboxError) -> None:
        with self.lock:
            self.in_a_row += 1
            self.total += 1
            in_a_row, first = self.in_a_row, self.total == 1
        if first:
            log.warning("code sandbox (%s) failed: %s; counted as a sandbox failure, never as the "
                        "program's output; further failures are counted", backend, exc)  # fmt: skip
        if in_a_row >= MAX_CONSECUTIVE_FAILURES:
            raise SandboxBroken(
                f"the code sandbox ({backend}) failed on the last {in_a_row} runs in a row; the "
                f"last time: {exc}. Fix it (the message says what failed) or choose another "
                "sandbox backend"
            ) from exc


_health = _Health()


def sandbox_failures() -> int:
    """Runs of this process whose sandbox failed (:class:`SandboxError`), in all."""
    return _health.total


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
    max_disk_mb: int = _DEFAULTS.max_disk_mb,
    max_processes: int = _DEFAULTS.max_processes,
    echo_last_expression: bool = False,
    readable_paths: tuple[str, ...] = (),
    sandbox: Any = None,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh sandbox and return what happened.

    Args:
        code: the program's source.
        stdin: the program's standard input (None: empty, like ``/dev/null``).
        files: extra files to place next to ``main.py`` (plain names, no folders).
        timeout_s, cpu_time_s, memory_mb, max_output_bytes, max_file_mb, max_open_files,
            max_disk_mb, max_processes: see :class:`SandboxLimits`.
        echo_last_expression: print the repr of a final expression statement (notebook style).
        readable_paths: host files or folders the code may read (read-only).
        sandbox: the backend spec (see :func:`resolve_sandbox`).

    Never raises for anything the code does; raises ValueError for bad arguments,
    SandboxUnavailable when no backend can run here, SandboxError when the sandbox itself fails
    (bubblewrap's error, a remote service's), SandboxBroken when it has failed on
    :data:`MAX_CONSECUTIVE_FAILURES` runs in a row.
    """
    limits = SandboxLimits(
        timeout_s,
        cpu_time_s,
        memory_mb,
        max_output_bytes,
        max_file_mb,
        max_open_files,
        max_disk_mb,
        max_processes,
    )
    job = Job.checked(code, stdin, files, echo_last_expression, readable_paths)
    if not hasattr(os, "killpg") or not hasattr(os, "waitid"):
        raise RuntimeError("run_python needs a POSIX system (Linux or macOS)")
    backend = resolve_sandbox(sandbox)
    try:
        result = backend.run(job, limits)
    except SandboxError as exc:
        _health.failed(backend.name, exc)
        raise
    _health.ok()
    return result
