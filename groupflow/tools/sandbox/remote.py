"""The ``remote`` backend: a sandbox service speaking SandboxFusion's HTTP API (as verl uses).

Design decision: on a cluster the code runs where the operators isolate it (SandboxFusion's
containers), and the trainer only speaks HTTP: ``POST {url}/run_code`` with ``code``,
``language``, ``run_timeout``, ``memory_limit_MB``, ``stdin`` and base64 ``files``; the reply's
``run_result`` (``status``, ``return_code``, ``stdout``, ``stderr``, ``execution_time``) becomes
the same :class:`SandboxResult` the local backends give, with the output caps applied here. The
HTTP client is ``requests`` with urllib3's ``Retry`` (connection errors, 429 and 5xx, with
exponential backoff); a service that still fails, or answers something that is not a result, is
a :class:`SandboxError` (a failure of that sample or tool call, never a crash of the step). An
API key, when the service wants one, comes from the environment variable named by
``api_key_env`` and is never logged.
"""

from __future__ import annotations

import ast
import base64
import os
import signal
import time
from typing import Any
from urllib.parse import urlparse

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from groupflow.tools.sandbox.limits import Job, SandboxError, SandboxLimits, SandboxResult
from groupflow.tools.sandbox.process import limit_from_exit

_ECHO_NAME = "__groupflow_value"


def echo_source(code: str) -> str:
    """``code`` with a final expression statement printed (``repr``, unless None), notebook style.

    The statement is rewritten in place, on the line where it starts, so line numbers in
    tracebacks stay those of the original; code that does not parse is returned unchanged (the
    service reports the SyntaxError).
    """
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    last = tree.body[-1]
    lines = code.splitlines(keepends=True)
    start = sum(len(line) for line in lines[: last.lineno - 1]) + last.col_offset
    segment = ast.get_source_segment(code, last.value)
    return (
        f"{code[:start]}{_ECHO_NAME} = ({segment})\n"
        f"if {_ECHO_NAME} is not None:\n    print(repr({_ECHO_NAME}))\n"
    )


def _cut(text: str, cap: int) -> tuple[str, bool]:
    data = text.encode("utf-8")
    if len(data) <= cap:
        return text, False
    return data[:cap].decode("utf-8", errors="ignore"), True


class RemoteSandbox:
    """A client of one SandboxFusion-compatible service (see the module docstring).

    Args:
        url: the service's base URL (``http://host:8080``); ``/run_code`` is appended.
        api_key_env: environment variable holding a bearer token, if the service wants one.
        retries: further attempts after a connection error, 429 or 5xx.
        backoff_s: first wait between attempts (doubling each time).
        overhead_s: seconds the service may take beyond the run's timeout before the request is
            abandoned (container start-up, queueing).
    """

    name = "remote"

    def __init__(
        self,
        url: str,
        api_key_env: str | None = None,
        retries: int = 3,
        backoff_s: float = 0.5,
        overhead_s: float = 30.0,
    ) -> None:
        parsed = urlparse(url) if isinstance(url, str) else None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"remote sandbox: url must be an http(s) URL, got {url!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"remote sandbox: retries must be an integer >= 0, got {retries!r}")
        for option, value in (("backoff_s", backoff_s), ("overhead_s", overhead_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"remote sandbox: {option} must be a number >= 0, got {value!r}")
        if api_key_env is not None and not os.environ.get(api_key_env):
            raise ValueError(
                f"remote sandbox: api_key_env names {api_key_env!r}, which is not set "
                "(put it in the environment or the run's .env)"
            )
        self.url = url.rstrip("/") + "/run_code"
        self.overhead_s = float(overhead_s)
        self.session = requests.Session()
        retry = Retry(
            total=retries,
            backoff_factor=backoff_s,
            status_forcelist=(429, 500, 502, 503, 504),
            allowed_methods=None,  # POST too: a run has no side effect outside its sandbox
            raise_on_status=False,
        )
        self.session.mount("http://", HTTPAdapter(max_retries=retry))
        self.session.mount("https://", HTTPAdapter(max_retries=retry))
        if api_key_env is not None:
            self.session.headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"

    def payload(self, job: Job, limits: SandboxLimits) -> dict[str, Any]:
        """The request body for one run."""
        if job.readable_paths:
            raise ValueError("remote sandbox: readable_paths cannot reach a remote service")
        code = echo_source(job.code) if job.echo_last_expression else job.code
        return {
            "code": code,
            "language": "python",
            "compile_timeout": limits.timeout_s,
            "run_timeout": limits.timeout_s,
            "memory_limit_MB": limits.memory_mb,
            "stdin": job.stdin.decode("utf-8", errors="replace"),
            "files": {k: base64.b64encode(v).decode() for k, v in job.files.items()},
        }

    def run(self, job: Job, limits: SandboxLimits) -> SandboxResult:
        body = self.payload(job, limits)
        started = time.monotonic()
        try:
            reply = self.session.post(
                self.url, json=body, timeout=limits.timeout_s + self.overhead_s
            )
        except requests.RequestException as exc:
            raise SandboxError(f"remote sandbox {self.url}: {type(exc).__name__}: {exc}") from None
        if reply.status_code != 200:
            raise SandboxError(
                f"remote sandbox {self.url}: HTTP {reply.status_code}: {reply.text[:200]!r}"
            )
        try:
            data = reply.json()
        except ValueError:
            raise SandboxError(
                f"remote sandbox {self.url}: the reply is not JSON: {reply.text[:200]!r}"
            ) from None
        return self._result(data, limits, time.monotonic() - started)

    def _result(self, data: Any, limits: SandboxLimits, duration: float) -> SandboxResult:
        if not isinstance(data, dict):
            raise SandboxError(f"remote sandbox {self.url}: the reply is not an object: {data!r}")
        run = data.get("run_result")
        if data.get("status") == "SandboxError" or not isinstance(run, dict):
            raise SandboxError(
                f"remote sandbox {self.url}: status {data.get('status')!r}, "
                f"message {str(data.get('message', ''))[:200]!r}, no run result"
            )
        stdout, out_cut = _cut(str(run.get("stdout") or ""), limits.max_output_bytes)
        stderr, err_cut = _cut(str(run.get("stderr") or ""), limits.max_output_bytes)
        elapsed = run.get("execution_time")
        elapsed = float(elapsed) if isinstance(elapsed, (int, float)) else duration
        if run.get("status") == "TimeLimitExceeded":
            code, limit = -signal.SIGKILL, "wall_time"
        else:
            code = run.get("return_code")
            if isinstance(code, bool) or not isinstance(code, int):
                raise SandboxError(
                    f"remote sandbox {self.url}: run status {run.get('status')!r} without an "
                    f"integer return_code ({code!r})"
                )
            limit = limit_from_exit(code, stderr, elapsed, limits)
        if out_cut or err_cut:
            limit = "output"
        return SandboxResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=code,
            limit=limit,
            killed=code < 0,
            stdout_truncated=out_cut,
            stderr_truncated=err_cut,
            duration_s=duration,
            cpu_time_s=elapsed,  # the service reports run time, not CPU time
            backend=self.name,
        )
