"""How the ``groupflow`` command explains a failure: one paragraph naming the culprit and the fix.

Design decision: library code raises precise exceptions (a reward's malformed output, a diverged
update, a dead worker, a full disk) and knows nothing of the command line; this module maps each
to the paragraph a user reads and an exit code, so the CLI shows no traceback for them unless
``--log-level DEBUG`` asks. Exit code 2 means "fix something, then run again" (config, data,
reward code, the machine's disk or permissions); 1 means a failure that may pass on a retry (a
worker that died or hung) or an error nobody anticipated. A failure inside a Ray worker arrives as
a ``WorkerError`` carrying the remote traceback as text; its last line names the remote
exception's class, which is classified like a local one. The exception classes are imported at
the top: the CLI imports this module only once a command has failed (``groupflow.cli.commands``),
so ``--help`` never pays for them.
"""

from __future__ import annotations

import errno
import importlib
import os
from dataclasses import dataclass

from groupflow.distributed.group import WorkerError
from groupflow.distributed.placement import PlacementError
from groupflow.envs import OpenEnvServerError
from groupflow.rewards import RewardError, RewardOutputError
from groupflow.rollout.engines.vllm_engine import VLLMUnavailableError
from groupflow.rollout.hosts import RolloutTimeoutError
from groupflow.run.checkpoint import CheckpointError
from groupflow.run.tracking import MissingBackendPackageError
from groupflow.utils.safe_state import os_error_in_text
from groupflow.workers.common import NonFiniteLossError

__all__ = ["Explained", "explain"]

# Exceptions whose own message already says what is wrong and where (config keys, data rows,
# paths): shown as they are.
_PLAIN_USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    KeyError,
)
_RESUME = "run.resume=auto then continues from the newest complete checkpoint"


@dataclass(frozen=True)
class Explained:
    message: str
    exit_code: int


def _user_error_types() -> dict[type[BaseException], str]:
    """groupflow's own user errors that are not ValueErrors, with the fix to append."""
    # Order matters: the first matching class wins (RewardOutputError is a RewardError).
    return {
        OpenEnvServerError: (
            "The OpenEnv environment's server is rollout.openenv.app (started by groupflow) or "
            "rollout.openenv.url: run it by hand (uvicorn APP --host 127.0.0.1) to see it fail, "
            "or raise rollout.openenv.startup_timeout_s for a slow start; "
            + "run.resume=auto then continues from the newest complete checkpoint"
        ),
        RewardOutputError: (
            "A reward function must return one float (or None) per completion, in the order of "
            "`completions`: fix the function named above"
        ),
        RewardError: (
            "A reward that fails on every sample of a batch stops the run (one failing on some "
            "samples only gets reward.failure_value and is counted): fix the function or its "
            "kwargs under reward.functions, or check that every row has the fields it reads"
        ),
        NonFiniteLossError: (
            "To continue from the newest checkpoint with a smaller learning rate, resume with "
            "e.g. actor.lr=<smaller> run.allow_config_changes=[actor.lr]"
        ),
        CheckpointError: "Point run.resume (or --checkpoint) at a complete checkpoint",
        PlacementError: "",
        MissingBackendPackageError: "",
        VLLMUnavailableError: "",
    }


def _join(message: str, hint: str) -> str:
    message = message.strip()
    if not hint:
        return message
    end = "" if message.endswith((".", ":", ";")) else "."
    return f"{message}{end} {hint}"


def _classify(cls: type[BaseException], message: str) -> Explained | None:
    for user_cls, hint in _user_error_types().items():
        if issubclass(cls, user_cls):
            return Explained(_join(message, hint), 2)
    if issubclass(cls, _PLAIN_USER_ERRORS):
        return Explained(message, 2)
    return None


def _causes(exc: BaseException | None):
    """``exc`` and the exceptions it was raised from or while handling, outermost first; the
    chain ends where ``raise … from None`` cut it (what was being handled there is not the
    cause: a rollout's wait that timed out is a hang, not a file error)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        if exc.__cause__ is not None:
            exc = exc.__cause__
        else:
            exc = None if exc.__suppress_context__ else exc.__context__


def _os_error(top: BaseException, err: OSError) -> Explained:
    where = err.filename or "a file of the run"
    what = err.strerror or str(err)
    context = "" if top is err else f" ({type(top).__name__}: {str(top).strip()[:200]})"
    if err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        return Explained(
            f"no space left on the disk holding {where}{context}: free space, or set "
            f"run.output_dir to a disk with room; {_RESUME} (a save the full disk cut short is "
            "ignored)",
            2,
        )
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        parent = os.path.dirname(os.fspath(where)) or "."
        return Explained(
            f"cannot write {where}: {what}{context}; choose a writable run.output_dir (or make "
            f"{parent} writable)",
            2,
        )
    return Explained(
        f"{where}: {what}{context}; check run.output_dir and the paths in the config", 2
    )


def _remote_class(traceback_text: str) -> tuple[type[BaseException] | None, str]:
    """The class and message of the exception that ends a remote traceback (class None if its
    name cannot be imported here)."""
    lines = [ln for ln in traceback_text.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    name, _, message = last.partition(": ")
    module, _, attr = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module or "builtins"), attr)
    except (ImportError, AttributeError, ValueError):
        return None, last
    ok = isinstance(cls, type) and issubclass(cls, BaseException)
    return (cls if ok else None), (message or last)


def _worker_error(exc) -> Explained:
    who = f"worker {exc.worker} rank {exc.rank} failed in {exc.method}()"
    detail = exc.detail
    if "remote traceback:" in detail:
        cls, message = _remote_class(detail.split("remote traceback:", 1)[1])
        known = _classify(cls, message) if cls is not None else None
        if known is not None:
            return Explained(f"{who}: {known.message}", known.exit_code)
        last = detail.strip().splitlines()[-1].strip()
        return Explained(
            f"{who}: it raised {last} (the remote traceback is shown with --log-level DEBUG); "
            f"{_RESUME}",
            1,
        )
    if "timeout" in detail:
        return Explained(
            f"{who}: {detail}. Raise run.worker_timeout_s if the call is legitimately that slow "
            f"(big batches on a CPU); otherwise the worker hangs; {_RESUME}",
            1,
        )
    return Explained(
        f"{who}: {detail}. A worker process that dies is most often killed for memory (see "
        "dmesg or the Ray dashboard): lower actor.micro_batch_samples or the rollout size, or "
        f"give it more memory; {_RESUME}",
        1,
    )


def _hang(message: str) -> Explained:
    return Explained(
        _join(
            message,
            "Raise run.worker_timeout_s if it is legitimately that slow (big batches on a CPU); "
            f"otherwise it hangs (a tool, environment or reward that never returns?); {_RESUME}",
        ),
        1,
    )


def explain(exc: BaseException) -> Explained | None:
    """The paragraph and exit code for ``exc``, or None when it is not anticipated (a bug: the
    CLI then lets the traceback through)."""
    if isinstance(exc, WorkerError):
        return _worker_error(exc)
    if isinstance(exc, RolloutTimeoutError):
        return _hang(str(exc))
    message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    known = _classify(type(exc), str(message))
    if known is not None:
        return known
    for cause in _causes(exc):
        if isinstance(cause, OSError):
            return _os_error(exc, cause)
        hidden = os_error_in_text(cause)  # e.g. safetensors' "… (os error 28)"
        if hidden is not None:
            return _os_error(exc, hidden)
    return None
