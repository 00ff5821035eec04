"""verifiers environments, unchanged, as agents of the agent workflow (``rollout.verifiers``).

Design decision: a verifiers (0.4.0, ``verifiers.v1``) environment runs its own rollout — its
``Env`` (``load_environment``), its taskset's tasks, its harness program (the ``null`` chat
harness by default, in verifiers' local ``subprocess`` runtime) behind its interception server,
and its tasks' ``@vf.reward`` functions — and groupflow only points the model endpoint of that
rollout at the run's OpenAI-compatible server: each episode's ``ModelContext`` names the server
and the episode's own API key, so every call the harness makes is recorded under the episode
and the ids trained are the ids sampled. The taskset is the prompt source (one row per task;
``val_taskset_args`` loads a second view of it, e.g. its eval split, as the validation rows);
the trace's weighted reward is the episode's reward and each named reward is logged
(``rollout/agent/rewards/<name>``). An episode verifiers marks failed (a harness, task or
scoring error) is a counted failure of the agent workflow; the step goes on.

On the asynchronous rollout side the adapter is built again with the trainer's tasks
(``built_tasks``, pickled; ``tasks``): its environment is loaded there (its serving resources
are the side's own), its taskset is not listed again, so the side runs exactly the trainer's rows.

The API key reaches verifiers' client through an environment variable named in its client
config (``api_key_var``: how verifiers reads keys), one variable per episode, removed after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

from groupflow.data import PromptRow
from groupflow.envs.packages import MissingEnvPackageError, require

__all__ = ["VerifiersAgent"]

_PIP = "pip install 'groupflow[verifiers]'"
_KEY_VAR = "GROUPFLOW_VF_EPISODE_KEY_{}"


def _vf():
    import verifiers.v1 as vf

    return vf


class VerifiersAgent:
    """``async (client, row) -> dict``: one verifiers episode per call (see the module doc)."""

    def __init__(self, cfg, tasks: bytes | None = None):  # cfg: the rollout.verifiers section
        require("verifiers", _PIP, "rollout.verifiers")
        vf = _vf()
        self.cfg = cfg
        # verifiers logs every rollout's start at INFO, and its interception server (aiohttp)
        # every model call: they would bury the run's console (a level set by the user is kept)
        for name in ("verifiers", "aiohttp.access"):
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
        if cfg.taskset_dir is not None:
            where = str(Path(cfg.taskset_dir).resolve())
            if where not in sys.path:
                sys.path.insert(0, where)
            # verifiers serves a task's toolsets as `python -m <module>` in child processes
            paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if where not in paths:
                os.environ["PYTHONPATH"] = os.pathsep.join([where, *filter(None, paths)])
        # verifiers' runtimes run the harness program with `uv`; the one of this environment
        # (the extra installs it) when it is not on PATH already
        here = str(Path(sys.executable).parent)
        if shutil.which("uv") is None and (Path(here) / "uv").exists():
            os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
        self.env = self._load(vf, cfg.taskset_args)  # builds the taskset; lists no task
        # given (the rollout side's adapter): the trainer's tasks, unpickled now that the
        # taskset's directory is importable; the taskset is not read again
        self.tasks = pickle.loads(tasks) if tasks is not None else self._list_tasks(vf)
        if not self.tasks["train"]:
            raise ValueError(f"rollout.verifiers: the taskset {cfg.taskset!r} has no tasks")
        self._keys = itertools.count()
        self._serving: dict[int, tuple[asyncio.AbstractEventLoop, contextlib.AsyncExitStack]] = {}

    def _list_tasks(self, vf) -> dict[str, list]:
        """The taskset's tasks (train; validation from ``val_taskset_args``' view of it)."""
        c = self.cfg
        tasks = {"train": list(self.env.taskset)[: c.max_train_tasks], "val": []}
        if c.val_taskset_args is not None:
            val_env = self._load(vf, {**c.taskset_args, **c.val_taskset_args})
            tasks["val"] = list(val_env.taskset)[: c.max_val_tasks]
        return tasks

    def built_tasks(self) -> bytes:
        """The tasks as listed here, pickled: what the rollout side's adapter runs (``tasks``)."""
        try:
            return pickle.dumps(self.tasks, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - any pickling error: the taskset's to fix
            raise ValueError(
                f"rollout.verifiers.taskset={self.cfg.taskset!r}: its tasks cannot be pickled "
                f"({type(e).__name__}: {e}), and the asynchronous rollout side "
                "(rollout.max_staleness >= 1) runs the trainer's tasks; make the task data "
                "picklable or set rollout.max_staleness: 0"
            ) from e

    def _load(self, vf, taskset_args: dict[str, Any]):
        c = self.cfg
        data = {
            "taskset": {"id": c.taskset, **taskset_args},
            "agent": {"harness": {"id": c.harness}, "runtime": {"type": "subprocess"}},
        }  # fmt: skip
        if c.env:
            data["id"] = c.env
        try:
            return vf.load_environment(vf.resolve_env_config(data))
        except ModuleNotFoundError as e:
            raise MissingEnvPackageError(
                f"rollout.verifiers.taskset={c.taskset!r}: {e}. Install the environment's "
                f"package (pip install it, or `prime env install owner/{c.taskset}` for one "
                "of the Environments Hub), or put its directory in rollout.verifiers.taskset_dir"
            ) from None

    def rows(self) -> tuple[list[PromptRow], list[PromptRow]]:
        """One prompt row per task (train, validation): the row names its task and carries the
        task data's plain fields (e.g. its ``answer``: what ``sft.target_field`` can name for a
        warm start; the reward stays verifiers')."""
        source = f"verifiers:{self.cfg.taskset}"
        train, val = (
            [PromptRow(_prompt(t.data), {**_plain_fields(t.data), "vf_split": split, "vf_task": i},
                       source, i)
             for i, t in enumerate(self.tasks[split])]
            for split in ("train", "val")
        )  # fmt: skip
        return train, val

    async def _enter_serving(self) -> None:
        """The env's serving resources (interception server, shared tools), once per loop."""
        loop = asyncio.get_running_loop()
        if id(loop) not in self._serving:
            stack = contextlib.AsyncExitStack()
            await stack.enter_async_context(self.env.serving())
            self._serving[id(loop)] = (loop, stack)

    async def __call__(self, client, row: dict) -> dict:
        vf = _vf()
        task = self.tasks[row["vf_split"]][row["vf_task"]]
        await self._enter_serving()
        var = _KEY_VAR.format(next(self._keys))
        os.environ[var] = client.api_key
        try:
            ctx = vf.ModelContext(model="policy", client=vf.EvalClientConfig(
                base_url=str(client.base_url).rstrip("/"), api_key_var=var))  # fmt: skip
            episode = await self.env.run_episode(task, ctx)
        finally:
            os.environ.pop(var, None)
        if not episode.ok or not episode.traces:
            errors = [e for e in episode.errors] + [
                e for t in episode.traces for e in (getattr(t, "errors", None) or [])
            ]
            first = errors[0] if errors else None
            raise RuntimeError(
                "the verifiers episode failed"
                + (f": {first.type}: {first.message}" if first is not None else "")
            )
        trace = episode.traces[-1]
        out: dict[str, float] = {"reward": float(trace.reward)}
        for name, r in trace.rewards.items():
            if r is not None and r.score is not None:
                out[f"rewards/{name}"] = float(r.score)
        return out

    def check(self) -> None:
        pass

    def close(self, timeout_s: float = 10.0) -> None:
        for loop, stack in self._serving.values():
            if loop.is_closed() or not loop.is_running():
                continue
            future = asyncio.run_coroutine_threadsafe(stack.aclose(), loop)
            with contextlib.suppress(Exception):  # closing: a stuck loop is let go
                future.result(timeout_s)
        self._serving.clear()


def _prompt(data) -> str | list[dict[str, Any]]:
    prompt = data.prompt
    if isinstance(prompt, str) and prompt:
        return prompt
    if prompt:
        return [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
                for m in prompt]  # fmt: skip
    return data.prompt_text or f"task {data.idx}"


def _plain_fields(data) -> dict[str, Any]:
    """A task data's string, number and list-of-string fields other than its prompt (a row field
    must survive the trip to a rollout process and the reward functions' columns)."""
    fields = data.model_dump() if hasattr(data, "model_dump") else dict(data)
    return {
        k: v for k, v in fields.items()
        if k not in ("prompt", "prompt_text") and (
            isinstance(v, (str, int, float, bool))
            or (isinstance(v, list) and v and all(isinstance(x, str) for x in v))
        )
    }  # fmt: skip
