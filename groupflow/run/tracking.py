"""Metrics tracking: one ``Tracker`` composed of small logger backends, writing into the run directory.

Design decision: a ``Tracker`` owns nothing but a list of backends that satisfy the two-method
``LoggerBackend`` protocol (``log(metrics, step)``, ``close()``), built by name from a registry of
factory functions (style principle 7: composition, small Protocols, one registry line per backend).
``metrics.jsonl`` is always written — it is the run's source of truth for ``groupflow plot`` and
for comparing runs — and the heavy third-party backends (TensorBoard, W&B, MLflow) are imported
only when asked for, so a CPU user never needs them. Only rank 0 builds backends; other ranks get
a tracker whose calls do nothing, so the driver never branches on rank.

Values are normalised once, in the tracker: tensors/NumPy scalars become floats, NaN/inf stay NaN
for the backends but are written as ``null`` in JSONL (so every line is valid JSON), and a
non-numeric value is skipped with one warning per key. On resume, lines with a step after the
resumed step are dropped from ``metrics.jsonl``/``samples.jsonl`` so steps never appear twice.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, TextIO

from groupflow.run.files import (
    CONFIG_FILE,
    METRICS_FILE,
    SAMPLES_FILE,
    read_metrics,
    save_config,
    to_json_safe,
    to_plain,
    truncate_jsonl_after,
)
from groupflow.run.tracking_backends import (
    BackendContext,
    LoggerBackend,
    MissingBackendPackageError,
    make_mlflow,
    make_tensorboard,
    make_wandb,
)
from groupflow.utils.env import redact_secrets

__all__ = [
    "BACKENDS",
    "CONFIG_FILE",
    "METRICS_FILE",
    "SAMPLES_FILE",
    "BackendContext",
    "ConsoleBackend",
    "JsonlBackend",
    "LoggerBackend",
    "MissingBackendPackageError",
    "Tracker",
    "UnknownBackendError",
    "format_metrics_table",
    "read_metrics",
    "register_backend",
    "save_config",
    "truncate_jsonl_after",
]

_RESERVED_KEYS = ("step", "wall_time")


class UnknownBackendError(ValueError):
    """A logger backend name that is not registered."""


# ---------------------------------------------------------------------------------------------
# backends


class JsonlBackend:
    """Appends ``{"step", "wall_time", **metrics}`` per call to ``metrics.jsonl``, flushed per line."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        resume_step: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        kept = truncate_jsonl_after(self.path, -1 if resume_step is None else resume_step)
        # wall_time continues across a resume, so curves against time have no jump back to 0.
        walls = [row["wall_time"] for row in kept if isinstance(row.get("wall_time"), (int, float))]
        self._offset = max(walls, default=0.0)
        self._clock = clock
        self._start = clock()
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        wall = round(self._offset + self._clock() - self._start, 3)
        row = {"step": step, "wall_time": wall}
        row.update({k: (v if math.isfinite(v) else None) for k, v in metrics.items()})
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _format_value(value: float) -> str:
    """Short and readable: integers as such, otherwise 4 significant digits (``0.2591``, ``1.5e+04``)."""
    if math.isfinite(value) and value.is_integer() and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.4g}"


# Console selections are patterns so that new metrics of a known family show up without edits.
DEFAULT_TABLE_PATTERNS = ("reward/*", "acc/*", "val/*", "actor/*", "response_length/*", "time/*")
DEFAULT_POSTFIX = (
    ("reward", ("reward/mean",)),
    ("acc", ("acc/mean", "acc/*", "val/*acc*")),
    ("kl", ("actor/kl*",)),
    ("len", ("response_length/mean",)),
)


def _select(keys: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """Keys matching any pattern, in pattern order then alphabetical; each key once."""
    keys = sorted(keys)
    chosen: list[str] = []
    for pattern in patterns:
        chosen.extend(k for k in keys if fnmatchcase(k, pattern) and k not in chosen)
    return chosen


def format_metrics_table(
    metrics: Mapping[str, float],
    step: int,
    total_steps: int | None = None,
    patterns: Sequence[str] = DEFAULT_TABLE_PATTERNS,
    width: int = 100,
) -> str:
    """A compact, column-aligned block: a ``step N/T`` header, then ``key value`` cells in columns.

    Shows the keys matching ``patterns``; if none match, all keys (so a custom run still sees its
    metrics).
    """
    keys = _select(metrics, patterns) or sorted(metrics)
    header = f"step {step}" + (f"/{total_steps}" if total_steps else "")
    if not keys:
        return header
    values = {k: _format_value(metrics[k]) for k in keys}
    key_w = max(map(len, keys))
    val_w = max(map(len, values.values()))
    cell_w = key_w + 1 + val_w
    ncols = max(1, (width - 2 + 3) // (cell_w + 3))
    cells = [f"{k:<{key_w}} {values[k]:>{val_w}}" for k in keys]
    rows = ["  " + "   ".join(cells[i : i + ncols]) for i in range(0, len(cells), ncols)]
    return "\n".join([header, *rows])


class ConsoleBackend:
    """A tqdm progress bar with a short postfix, plus a metrics table every ``every`` steps."""

    def __init__(
        self,
        total_steps: int | None,
        every: int = 10,
        initial_step: int = 0,
        file: TextIO | None = None,
        table_patterns: Sequence[str] = DEFAULT_TABLE_PATTERNS,
        postfix: Sequence[tuple[str, Sequence[str]]] = DEFAULT_POSTFIX,
    ) -> None:
        from tqdm.auto import tqdm

        self._tqdm = tqdm
        self._total = total_steps
        self._every = every
        self._file = file
        self._table_patterns = table_patterns
        self._postfix_spec = postfix
        # Postfix values persist between steps: validation accuracy arrives only every k steps.
        self._postfix: dict[str, str] = {}
        self._bar = tqdm(
            total=total_steps, initial=initial_step, file=file, unit="step", dynamic_ncols=True
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        for label, patterns in self._postfix_spec:
            match = _select(metrics, patterns)
            if match:
                self._postfix[label] = _format_value(metrics[match[0]])
        if self._postfix:
            self._bar.set_postfix(self._postfix, refresh=False)
        if step > self._bar.n:
            self._bar.update(step - self._bar.n)
        else:
            self._bar.refresh()
        if step % self._every == 0 or step == self._total:
            table = format_metrics_table(metrics, step, self._total, self._table_patterns)
            self._tqdm.write(table, file=self._file)

    def close(self) -> None:
        self._bar.close()


BackendFactory = Callable[[BackendContext], LoggerBackend]

BACKENDS: dict[str, BackendFactory] = {
    "jsonl": lambda ctx: JsonlBackend(ctx.run_dir / METRICS_FILE, ctx.resume_step),
    "console": lambda ctx: ConsoleBackend(
        ctx.total_steps, ctx.console_every, initial_step=ctx.resume_step or 0, file=ctx.console_file
    ),
    "tensorboard": make_tensorboard,
    "wandb": make_wandb,
    "mlflow": make_mlflow,
}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Add a logger backend under ``name`` (a factory taking a :class:`BackendContext`)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"backend name must be a non-empty string, got {name!r}")
    if name in BACKENDS:
        raise ValueError(f"logger backend {name!r} is already registered")
    BACKENDS[name] = factory


def _resolve_backend_names(backends: str | Iterable[str]) -> list[str]:
    names = backends.split(",") if isinstance(backends, str) else list(backends)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"logger backend names must be strings, got {name!r}")
    names = [n.strip() for n in names if n.strip()]
    for name in names:
        if name not in BACKENDS:
            raise UnknownBackendError(
                f"unknown logger backend {name!r}; valid backends: {sorted(BACKENDS)}"
            )
    # jsonl is the run's record and the input of `groupflow plot`, so it is always on (and first).
    return list(dict.fromkeys(["jsonl", *names]))


def _check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(
            f"{name} must be an integer >= {minimum}{' or None' if optional else ''}, got {value!r}"
        )


def _as_float(value: Any) -> float | None:
    """A metric value as float, or None when it is not a single real number."""
    if isinstance(value, numbers.Real):  # includes bool and NumPy scalars
        return float(value)
    size = (
        value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", None)
    )
    if size == 1 and callable(getattr(value, "item", None)):
        item = value.item()
        if isinstance(item, numbers.Real):
            return float(item)
    return None


class Tracker:
    """Logs per-step metrics to the run directory and the chosen backends (rank 0 only).

    ``resume_step``: when resuming from a checkpoint at that step, earlier lines are kept and later
    ones dropped; ``None`` starts fresh (existing metrics/samples files are emptied, with a warning).
    If ``config`` is given it is saved (redacted) to ``config.yaml`` and sent to W&B/MLflow.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        backends: str | Iterable[str] = ("jsonl", "console"),
        *,
        project: str = "groupflow",
        run_name: str | None = None,
        config: Any = None,
        rank: int = 0,
        console_every: int = 10,
        total_steps: int | None = None,
        resume_step: int | None = None,
        console_file: TextIO | None = None,
    ) -> None:
        names = _resolve_backend_names(backends)
        _check_int("rank", rank, 0)
        _check_int("console_every", console_every, 1)
        _check_int("total_steps", total_steps, 0, optional=True)
        _check_int("resume_step", resume_step, 0, optional=True)
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.active = rank == 0
        self.backend_names = names if self.active else []
        self._backends: list[LoggerBackend] = []
        self._min_step = 0 if resume_step is None else resume_step + 1
        self._warned: set[str] = set()
        self._samples_file: TextIO | None = None
        self._closed = False
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        plain_config = {} if config is None else redact_secrets(to_plain(config, ""))
        if config is not None:
            save_config(self.run_dir, plain_config)
        self._samples_path = self.run_dir / SAMPLES_FILE
        self._warn_if_fresh_over_old_run(resume_step)
        truncate_jsonl_after(self._samples_path, -1 if resume_step is None else resume_step)
        ctx = BackendContext(
            run_dir=self.run_dir,
            project=project,
            run_name=run_name or self.run_dir.name,
            config=plain_config,
            console_every=console_every,
            total_steps=total_steps,
            resume_step=resume_step,
            console_file=console_file,
        )
        try:
            for name in names:
                self._backends.append(BACKENDS[name](ctx))
        except BaseException:
            self.close()  # do not leave already-started backends (W&B processes, files) behind
            raise

    def _warn_if_fresh_over_old_run(self, resume_step: int | None) -> None:
        old = self.run_dir / METRICS_FILE
        if resume_step is None and old.exists() and old.stat().st_size > 0:
            warnings.warn(
                f"{old} holds metrics of an earlier run; starting fresh empties it "
                "(pass resume_step=N to keep the steps up to a checkpoint)",
                stacklevel=3,
            )

    def _clean(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        if not isinstance(metrics, Mapping):
            raise TypeError(
                f"metrics must be a dict of name -> number, got {type(metrics).__name__}"
            )
        clean: dict[str, float] = {}
        for key, value in metrics.items():
            if not isinstance(key, str) or not key:
                raise TypeError(f"metric names must be non-empty strings, got {key!r}")
            if key in _RESERVED_KEYS:
                raise ValueError(
                    f"metric name {key!r} is reserved (the tracker writes {_RESERVED_KEYS})"
                )
            number = _as_float(value)
            if number is None:
                if key not in self._warned:
                    self._warned.add(key)
                    warnings.warn(
                        f"metric {key!r} has a non-numeric value of type {type(value).__name__}; "
                        "skipping it (this warning is shown once per key)",
                        stacklevel=3,
                    )
                continue
            clean[key] = number
        return clean

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one step's metrics. A step may be logged in several calls but never goes backwards."""
        if not self.active:
            return
        if self._closed:
            raise RuntimeError("Tracker.log called after close()")
        _check_int("step", step, 0)
        if step < self._min_step:
            raise ValueError(
                f"step {step} is before step {self._min_step}: steps must not go backwards "
                "(after a resume, log from resume_step + 1)"
            )
        clean = self._clean(metrics)
        for backend in self._backends:
            backend.log(clean, int(step))
        self._min_step = int(step)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append ``{"step": step, **row}`` per row to ``samples.jsonl`` (prompts, completions, rewards)."""
        if not self.active:
            return
        _check_int("step", step, 0)
        if isinstance(rows, Mapping) or not isinstance(rows, Sequence):
            raise TypeError(f"rows must be a list of dicts, got {type(rows).__name__}")
        lines = []
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise TypeError(f"samples row {i} must be a dict, got {type(row).__name__}")
            if "step" in row:
                raise ValueError(
                    f"samples row {i} has a 'step' key; the tracker adds the step itself"
                )
            safe = to_json_safe(row, f"samples row {i}")
            lines.append(json.dumps({"step": int(step), **safe}, allow_nan=False) + "\n")
        if self._samples_file is None:
            self._samples_file = open(self._samples_path, "a", encoding="utf-8")
        self._samples_file.write("".join(lines))
        self._samples_file.flush()

    def close(self) -> None:
        """Close every backend (even if one fails; the first error is re-raised). Idempotent."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        for backend in self._backends:
            try:
                backend.close()
            except Exception as err:  # keep closing the others; re-raised below
                errors.append(err)
        if self._samples_file is not None:
            self._samples_file.close()
        if errors:
            raise errors[0]

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
