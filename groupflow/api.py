"""The Python API: ``groupflow.Run(config, rewards=..., train_dataset=...).fit()`` (TRL's spirit).

Design decision: a notebook run and a CLI run are the same run. ``Run`` takes the config as a
YAML path, a dict or a ``Config`` (plus dotted overrides), validates it with the CLI's validator
and messages, and adds only what a config file cannot hold: reward *callables* and in-memory
datasets (a ``datasets.Dataset``, a pandas DataFrame or a list of row dicts). These travel to the
assembly as one plain ``PythonInputs`` object, so nothing below this module knows whether a
reward came from an import path or a notebook cell. ``groupflow train`` is a thin layer over
``Run``. A dataset given here replaces ``data.train_files`` / ``data.task`` (or
``data.val_files``), and naming both is an error, as is any config problem the CLI would report.

    import groupflow

    def short(completions, **_):
        return [1.0 if len(c) < 50 else 0.0 for c in completions]

    run = groupflow.Run("my_run.yaml", rewards=[short], overrides={"run.total_steps": 2},
                        train_dataset=[{"prompt": "Say hi"}, {"prompt": "Name a colour"}])
    final_metrics = run.fit()
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from groupflow.assembly.data import PythonInputs
from groupflow.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_from_dict,
    load_config,
    parse_overrides,
)
from groupflow.rewards import RewardConfigError, RewardFunction, make_reward_function
from groupflow.trainer import Trainer

__all__ = ["Run", "as_rows", "reward_functions"]

RewardLike = Callable[..., Any] | RewardFunction | str | Mapping[str, Any]


class Run:
    """One training run built from Python.

    Args:
        config: a YAML file path, a dict (what the YAML would hold) or a :class:`Config`.
        overrides: dotted overrides, ``["actor.lr=1e-4"]`` (YAML values) or ``{"actor.lr": 1e-4}``.
        rewards: reward functions after the config's ``reward.functions``: each a callable
            (``fn(prompts, completions, **fields) -> list[float]``, named by its ``__name__``), a
            built-in name (``"gsm8k"``), an import path (``"pkg.mod:fn"``), a
            :class:`~groupflow.rewards.RewardFunction`, or a mapping ``{"function": fn,
            "weight": 0.5, "label": "short", "kwargs": {...}}``.
        train_dataset: training rows (``{"prompt": ..., <fields>}``) as a
            ``datasets.Dataset``, a pandas DataFrame or any iterable of dicts.
        val_dataset: validation rows, in the same forms.

    The trainer is built here (data and rewards checked, model loaded), as in TRL; ``fit()``
    trains and returns the last step's metrics.
    """

    def __init__(
        self,
        config: str | Path | Mapping[str, Any] | Config,
        *,
        overrides: list[str] | Mapping[str, Any] | None = None,
        rewards: RewardLike | Iterable[RewardLike] | None = None,
        train_dataset: Any = None,
        val_dataset: Any = None,
    ) -> None:
        given = tuple(
            k for k, v in (("train", train_dataset), ("val", val_dataset)) if v is not None
        )
        self.config = build_config(config, overrides, given)
        self.inputs = PythonInputs(
            rewards=tuple(reward_functions(rewards)),
            train_rows=None if train_dataset is None else as_rows(train_dataset, "train_dataset"),
            val_rows=None if val_dataset is None else as_rows(val_dataset, "val_dataset"),
        )
        self.trainer = Trainer(self.config, inputs=self.inputs)

    @property
    def run_dir(self) -> Path:
        """Where metrics, samples, checkpoints and plots go."""
        return self.trainer.run_dir

    def fit(self) -> dict[str, float]:
        """Train for ``run.total_steps`` (resuming per ``run.resume``); the last step's metrics."""
        return self.trainer.fit()

    def validate(self) -> dict[str, float]:
        """Held-out metrics of the current policy (needs validation data)."""
        return self.trainer.validate()

    def shutdown(self) -> None:
        """Stop the worker groups (Ray actors); the run directory stays."""
        self.trainer.shutdown()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def build_config(
    config: str | Path | Mapping[str, Any] | Config,
    overrides: list[str] | Mapping[str, Any] | None = None,
    python_data: tuple[str, ...] = (),
) -> Config:
    """The validated config (the CLI's loader and messages); ``python_data`` names the datasets
    given as objects, which the config must then not name."""
    if isinstance(config, (str, Path)):
        ov = dict(overrides) if isinstance(overrides, Mapping) else list(overrides or [])
        return load_config(config, ov, python_data=python_data)
    if isinstance(config, Config):
        data, source = config.to_dict(), "<Config object>"
    elif isinstance(config, Mapping):
        data, source = copy.deepcopy(dict(config)), "<config dict>"
    else:
        raise ConfigError(
            f"groupflow.Run: config must be a YAML path, a dict or a groupflow Config, got "
            f"{type(config).__name__}"
        )
    if python_data and isinstance(config, Config):
        # a Config object validated without the datasets names its own source: drop it
        d = data.get("data", {})
        if "train" in python_data:
            d.update(train_files=[], task=None)
        if "val" in python_data:
            d["val_files"] = []
    if overrides:
        ov = parse_overrides(list(overrides)) if not isinstance(overrides, Mapping) else overrides
        data = apply_overrides(data, dict(ov))
        source += " with overrides"
    return config_from_dict(data, source, python_data=python_data)


def reward_functions(rewards: RewardLike | Iterable[RewardLike] | None) -> list[RewardFunction]:
    """Reward objects from what a notebook holds (see :class:`Run`); errors name the entry."""
    if rewards is None:
        return []
    entries = (
        [rewards]
        if callable(rewards) or isinstance(rewards, (str, Mapping, RewardFunction))
        else list(rewards)
    )
    out = []
    for i, r in enumerate(entries):
        where = f"rewards[{i}]"
        if isinstance(r, RewardFunction):
            out.append(r)
        elif isinstance(r, str):
            spec = {"function": r} if ":" in r else {"name": r}
            out.append(make_reward_function(spec, where=where))
        elif isinstance(r, Mapping) and callable(r.get("function")):
            unknown = {str(k) for k in r} - {"function", "label", "weight", "failure_value",
                                             "kwargs"}  # fmt: skip
            if unknown:
                raise RewardConfigError(
                    f"{where}: unknown key {sorted(unknown)[0]!r}; valid keys: function, label, "
                    "weight, failure_value, kwargs"
                )
            out.append(
                RewardFunction(
                    r.get("label") or _callable_name(r["function"], where),
                    r["function"],
                    r.get("weight", 1.0),
                    r.get("failure_value"),
                    options=dict(r.get("kwargs") or {}),
                )
            )
        elif isinstance(r, Mapping):
            out.append(make_reward_function(dict(r), where=where))
        elif callable(r):
            out.append(RewardFunction(_callable_name(r, where), r))
        else:
            raise RewardConfigError(
                f"{where}: a reward is a callable, a built-in name, 'module:function', a "
                f"RewardFunction or a mapping with 'function'; got {type(r).__name__}"
            )
    return out


def _callable_name(fn: Any, where: str) -> str:
    name = getattr(fn, "__name__", type(fn).__name__)
    if name == "<lambda>":
        raise RewardConfigError(
            f"{where}: a lambda has no name for the reward metrics; give it one with "
            "{'function': fn, 'label': 'my_reward'} (or use a def)"
        )
    return name


def as_rows(dataset: Any, where: str) -> list[dict[str, Any]]:
    """Row dicts from a ``datasets.Dataset``, a pandas DataFrame or an iterable of dicts."""
    if isinstance(dataset, (str, Path)):
        raise TypeError(
            f"{where}: give rows (a datasets.Dataset, a DataFrame or a list of dicts); for files "
            "set data.train_files / data.val_files in the config"
        )
    if type(dataset).__name__ in ("DatasetDict", "IterableDatasetDict"):
        raise TypeError(
            f"{where}: a DatasetDict holds several splits ({', '.join(dataset)}); pass one, "
            "e.g. dataset['train']"
        )
    if hasattr(dataset, "to_list"):  # datasets.Dataset
        return dataset.to_list()
    if hasattr(dataset, "to_dict") and hasattr(dataset, "columns"):  # pandas.DataFrame
        return dataset.to_dict(orient="records")
    if isinstance(dataset, Mapping):
        raise TypeError(f"{where}: a single dict is one row; pass a list of row dicts")
    try:
        return list(dataset)
    except TypeError:
        raise TypeError(
            f"{where}: expected a datasets.Dataset, a DataFrame or a list of row dicts, got "
            f"{type(dataset).__name__}"
        ) from None
