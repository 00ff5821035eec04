"""OpenEnv environments, unchanged, as agents of the agent workflow (``rollout.openenv``).

Design decision: an OpenEnv environment is a server (its ``create_app``: HTTP plus the WebSocket
sessions its ``EnvClient`` speaks), so groupflow talks to it only through OpenEnv's own client
(``GenericEnvClient``: plain dicts, no environment package imported into the run) and never
imports the environment's classes. The adapter is an agent of the agent workflow
(``groupflow.workflows.agent``): each episode opens one session, ``reset`` gives the first
observation (the row's ``reset_fields`` as its arguments), the observation is the user turn,
the model's reply through the run's OpenAI-compatible server is the action (its text under
``action_field``), the next observation is the next user turn, until the environment says
``done`` or ``max_turns`` replies were sent. The episode's reward is the sum of the steps'
rewards, so the ids trained are exactly the ids the server sampled and the environment judged.

The server is started by groupflow (``app``: a FastAPI app's import path, served by uvicorn in a
child process on 127.0.0.1 and a free port, one torch thread) or given by URL (``url``). Start-up
waits for ``/health`` at most ``startup_timeout_s`` and fails with :class:`OpenEnvServerError`
(with the server's last output) when it never answers or exits; a started server that dies
during the run fails the step with the same error once its episodes have come back (their
sessions fail at once: a counted failure each), and each step's reply is bounded by
``step_timeout_s``. An environment that raises, or answers without a reward, fails that episode
only (counted by the agent workflow; the step goes on).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from typing import Any

from groupflow.envs.packages import require

__all__ = ["OpenEnvAgent", "OpenEnvServerError", "OpenEnvServer"]

_PIP = "pip install 'groupflow[openenv]'"
_TAIL_CHARS = 2000  # of the server's output, in an error


class OpenEnvServerError(RuntimeError):
    """The OpenEnv server did not start, stopped answering, or died (names it and its output)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's process before exec (Linux): SIGTERM when the run's process dies, however
    it dies, so no server outlives its run. (The signal follows the thread that started it: the
    workflow starts it from the thread that builds the workflow, which lives as long as the run.)"""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the finalizer below still stops it
        pass


def _stop(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout_s)


def _healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class OpenEnvServer:
    """A server started from an app's import path (a child process), or one at a given URL."""

    def __init__(self, app: str | None, url: str | None, app_dir: str | None,
                 startup_timeout_s: float):  # fmt: skip
        self.app, self.process, self._log = app, None, None
        if url is not None:
            self.url = url.rstrip("/")
            self._wait_healthy(startup_timeout_s, f"the OpenEnv server at {self.url}")
            return
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="openenv-", suffix=".log")
        cmd = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning"]  # fmt: skip
        if app_dir is not None:
            cmd += ["--app-dir", app_dir]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        preexec_fn=preexec)  # fmt: skip
        self._finalizer = weakref.finalize(self, _stop, self.process)  # also at interpreter exit
        try:
            self._wait_healthy(startup_timeout_s, f"the OpenEnv server {app!r}")
        except BaseException:
            self.close()
            raise

    def output(self) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        text = self._log.read()
        return text[-_TAIL_CHARS:].strip()

    def _wait_healthy(self, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise OpenEnvServerError(
                    f"{what} exited with code {self.process.returncode} before it answered "
                    f"/health; its output:\n{self.output() or '(none)'}"
                )
            if _healthy(self.url):
                return
            time.sleep(0.2)
        out = self.output()
        raise OpenEnvServerError(
            f"{what} did not answer {self.url}/health within "
            f"rollout.openenv.startup_timeout_s={timeout_s:g} s"
            + (f"; its output:\n{out}" if out else "")
        )

    def check(self) -> None:
        """Raise if the server died (a started one) or stopped answering (any)."""
        if self.process is not None and self.process.poll() is not None:
            raise OpenEnvServerError(
                f"the OpenEnv server {self.app!r} died during the run (exit code "
                f"{self.process.returncode}); its output:\n{self.output() or '(none)'}"
            )
        if not _healthy(self.url, timeout_s=5.0):
            raise OpenEnvServerError(f"the OpenEnv server at {self.url} stopped answering /health")

    def close(self, timeout_s: float = 10.0) -> None:
        if self.process is not None:
            _stop(self.process, timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None


def observation_text(observation: Any, field: str | None) -> str:
    """What the model reads of an observation: its ``field``; with none given, its only text
    field, else the observation as JSON (without OpenEnv's ``metadata``)."""
    if not isinstance(observation, dict):
        raise ValueError(f"the environment's observation is {type(observation).__name__}, "
                         "not an object")  # fmt: skip
    if field is not None:
        if field not in observation:
            raise ValueError(f"the environment's observation has no field {field!r} "
                             f"(rollout.openenv.observation_field); it has {sorted(observation)}")  # fmt: skip
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value)
    shown = {k: v for k, v in observation.items() if k != "metadata"}
    texts = [v for v in shown.values() if isinstance(v, str)]
    if len(texts) == 1:
        return texts[0]
    return json.dumps(shown, sort_keys=True)


def step_reward(reward: Any) -> float | None:
    """A step's reward: a finite number or None (OpenEnv's 'no reward'); anything else is the
    environment's malformed output."""
    if reward is None:
        return None
    if (
        isinstance(reward, bool)
        or not isinstance(reward, (int, float))
        or not math.isfinite(reward)
    ):
        raise ValueError(f"the environment returned a reward of {reward!r}")
    return float(reward)


class OpenEnvAgent:
    """``async (client, row) -> dict``: one OpenEnv session per episode (see the module doc)."""

    def __init__(self, cfg):  # cfg: the rollout.openenv section
        require("openenv", _PIP, "rollout.openenv")
        from openenv.core import GenericEnvClient

        self.cfg = cfg
        self._client_cls = GenericEnvClient
        self.server = OpenEnvServer(cfg.app, cfg.url, cfg.app_dir, cfg.startup_timeout_s)
        self._gates: dict[int, asyncio.Semaphore] = {}  # per event loop (a loop may be replaced)

    def _gate(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        key = id(loop)
        if key not in self._gates:
            self._gates = {key: asyncio.Semaphore(self.cfg.max_sessions)}
        return self._gates[key]

    async def __call__(self, client, row: dict) -> dict:
        c = self.cfg
        missing = [f for f in c.reset_fields if f not in row]
        if missing:
            raise ValueError(f"rollout.openenv.reset_fields: the row has no field(s) {missing}; "
                             f"it has {sorted(row)}")  # fmt: skip
        kwargs = {f: row[f] for f in c.reset_fields}
        async with self._gate():
            env = self._client_cls(base_url=self.server.url, connect_timeout_s=c.step_timeout_s,
                                   message_timeout_s=c.step_timeout_s)  # fmt: skip
            async with env:
                result = await env.reset(**kwargs)
                messages = [{"role": "user",
                             "content": observation_text(result.observation, c.observation_field)}]  # fmt: skip
                rewards: list[float] = []
                turns = 0
                while not result.done and turns < c.max_turns:
                    reply = await client.chat.completions.create(model="policy", messages=messages)
                    text = reply.choices[0].message.content or ""
                    messages.append({"role": "assistant", "content": text})
                    result = await env.step({c.action_field: text})
                    turns += 1
                    reward = step_reward(result.reward)
                    if reward is not None:
                        rewards.append(reward)
                    if not result.done:
                        messages.append({"role": "user", "content": observation_text(
                            result.observation, c.observation_field)})  # fmt: skip
        if not rewards:
            raise ValueError(f"the environment gave no reward in {turns} step(s)"
                             + ("" if result.done else " (not done)"))  # fmt: skip
        return {"reward": sum(rewards), "env_steps": float(turns), "env_done": float(result.done)}

    def check(self) -> None:
        self.server.check()

    def close(self) -> None:
        self.server.close()
