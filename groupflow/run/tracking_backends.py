"""Logger backends for third-party trackers (TensorBoard, W&B, MLflow), and the protocol they meet.

Design decision: each backend is a small class behind the two-method ``LoggerBackend`` protocol,
built by a factory that first checks that its package is installed (``find_spec``, no import), so
the heavy packages are imported only when a user asks for them and a missing one is reported with
its install line. The registry of factories lives in ``tracking``; this module knows no tracker.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, TextIO, runtime_checkable

from groupflow.run.files import atomic_write_text
from groupflow.utils.metric_names import MLFLOW, WANDB, NameMap

__all__ = [
    "BackendContext",
    "BackendSetupError",
    "LoggerBackend",
    "MissingBackendPackageError",
    "MlflowBackend",
    "TensorBoardBackend",
    "WandbBackend",
    "make_mlflow",
    "make_tensorboard",
    "make_wandb",
]

# MLflow rejects longer parameter values (MAX_PARAM_VAL_LENGTH since 2.x).
_MLFLOW_MAX_PARAM_LEN = 6000


class MissingBackendPackageError(ImportError):
    """A logger backend was requested whose third-party package is not installed."""


class BackendSetupError(ValueError):
    """A logger backend's settings (its environment variables) cannot work as given."""


@runtime_checkable
class LoggerBackend(Protocol):
    """Where metrics go. ``metrics`` values are floats (possibly NaN); ``step`` is a non-negative int."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class BackendContext:
    """Everything a backend factory may use; ``config`` is already plain and redacted."""

    run_dir: Path
    project: str
    run_name: str
    config: dict[str, Any]
    console_every: int = 10
    total_steps: int | None = None
    resume_step: int | None = None
    console_file: TextIO | None = None


class TensorBoardBackend:
    """Scalars into ``run_dir/tensorboard`` via ``torch.utils.tensorboard.SummaryWriter`` (tags are
    stored as they are: TensorBoard restricts no characters)."""

    def __init__(self, log_dir: Path, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides events a crashed run wrote after the checkpoint (or all of an old run).
        purge = 0 if resume_step is None else resume_step + 1
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge, flush_secs=10)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class WandbBackend:
    """A W&B run in ``run_dir/wandb``; the mode comes from ``WANDB_MODE`` (``offline`` needs no network)."""

    ID_FILE = "wandb_run_id.txt"

    def __init__(self, ctx: BackendContext) -> None:
        import wandb

        id_file = ctx.run_dir / self.ID_FILE
        resume: dict[str, Any] = {}
        if ctx.resume_step is not None and id_file.exists():
            resume = {"id": id_file.read_text(encoding="utf-8").strip(), "resume": "allow"}
        self._run = wandb.init(
            project=ctx.project,
            name=ctx.run_name,
            dir=str(ctx.run_dir),
            config=ctx.config,
            **resume,
        )
        atomic_write_text(id_file, self._run.id)
        self._names = NameMap(WANDB)  # names its UI can sort and filter

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(self._names.translate(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


class MlflowBackend:
    """An MLflow run: local file store ``run_dir/mlruns`` unless ``MLFLOW_TRACKING_URI`` is set."""

    ID_FILE = "mlflow_run_id.txt"

    def __init__(self, ctx: BackendContext) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (ctx.run_dir / "mlruns").resolve().as_uri()
            # MLflow 3 refuses file stores unless opted in; a local, dependency-free store is the
            # point of this default (a sqlite store would need SQLAlchemy, i.e. full mlflow).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric

        self._metric_cls = Metric
        self._names = NameMap(MLFLOW)  # MLflow rejects a batch with one name it does not accept
        try:
            self._start(ctx, uri)
        except Exception as exc:
            # MLflow >= 3.17 refuses a file store the user named unless opted in; its exception
            # (a long traceback through the store registry) says so only in passing.
            if "MLFLOW_ALLOW_FILE_STORE" not in str(exc):
                raise
            raise BackendSetupError(
                f"MLFLOW_TRACKING_URI={uri!r} is a file store, which this MLflow refuses unless "
                "MLFLOW_ALLOW_FILE_STORE=true is set: set it (the file store still works, in "
                "maintenance mode), or point MLFLOW_TRACKING_URI at a database "
                "(e.g. sqlite:///mlflow.db) or a tracking server; unset, groupflow logs to "
                "<run dir>/mlruns"
            ) from None

    def _start(self, ctx: BackendContext, uri: str) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)
        id_file = ctx.run_dir / self.ID_FILE
        if ctx.resume_step is not None and id_file.exists():
            self._run_id = id_file.read_text(encoding="utf-8").strip()
            self._client.update_run(self._run_id, status="RUNNING")
            return
        experiment = self._client.get_experiment_by_name(ctx.project)
        exp_id = (
            experiment.experiment_id if experiment else self._client.create_experiment(ctx.project)
        )
        self._run_id = self._client.create_run(exp_id, run_name=ctx.run_name).info.run_id
        keys = NameMap(MLFLOW)
        params = [
            Param(keys(k), str(v)[:_MLFLOW_MAX_PARAM_LEN]) for k, v in _flatten(ctx.config).items()
        ]
        for i in range(0, len(params), 100):  # MLflow caps a batch at 100 params
            self._client.log_batch(self._run_id, params=params[i : i + 100])
        atomic_write_text(id_file, self._run_id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        stamp = int(time.time() * 1000)
        batch = [self._metric_cls(self._names(k), v, stamp, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow caps a batch at 1000 metrics
            self._client.log_batch(self._run_id, metrics=batch[i : i + 1000])

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def _require(backend: str, module: str, pip_name: str) -> None:
    # find_spec only looks the package up, so a missing optional dependency is reported before
    # any partial import, with the install line.
    if importlib.util.find_spec(module) is None:
        raise MissingBackendPackageError(
            f"logger backend '{backend}' needs the '{module}' package, which is not installed; "
            f"install it with: pip install 'groupflow[loggers]'  (or: pip install {pip_name})"
        )


def make_tensorboard(ctx: BackendContext) -> LoggerBackend:
    _require("tensorboard", "tensorboard", "tensorboard")
    return TensorBoardBackend(ctx.run_dir / "tensorboard", ctx.resume_step)


def make_wandb(ctx: BackendContext) -> LoggerBackend:
    _require("wandb", "wandb", "wandb")
    return WandbBackend(ctx)


def make_mlflow(ctx: BackendContext) -> LoggerBackend:
    _require("mlflow", "mlflow", "mlflow-skinny")
    return MlflowBackend(ctx)
