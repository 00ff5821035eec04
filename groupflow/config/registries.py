"""The registries whose names a config may give — advantage estimators, policy losses and their
options, diffusion samplers — as the config's validators look them up.

Design decision: ``import groupflow.config`` stays torch-free (the docs build, the configuration
reference and a process that only reads a config load no torch), while the names a config accepts
are the registries' own, never a copy to keep in step. The registries are filled by the torch
modules that define the math, so this module imports those on first use, when a config naming an
estimator, a loss or a sampler is validated: the config package's one place with lazy imports,
both downward (config -> algorithms, config -> diffusion.samplers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "advantage_estimator",
    "check_options",
    "is_policy_loss",
    "option_names",
    "policy_loss",
    "get_sampler",
]


def _algorithms():
    # lazy: keeps `import groupflow.config` torch-free (the registries live with the torch math)
    import groupflow.algorithms.registry

    return groupflow.algorithms


def advantage_estimator(name: str) -> Callable[..., Any]:
    """The registered estimator ``name``; an unknown name raises, listing the valid ones."""
    return _algorithms().ADVANTAGE_ESTIMATORS.get(name)


def policy_loss(name: str) -> Callable[..., Any]:
    """The registered policy loss ``name``; an unknown name raises, listing the valid ones."""
    return _algorithms().POLICY_LOSSES.get(name)


def is_policy_loss(name: object) -> bool:
    return name in _algorithms().POLICY_LOSSES


def option_names(fn: Callable[..., Any]) -> tuple[str, ...] | None:
    """The options (keyword-only parameters) ``fn`` takes; None when it takes any."""
    return _algorithms().registry.option_names(fn)


def check_options(fn: Callable[..., Any], opts: Mapping[str, Any], *, what: str) -> None:
    """Raise if ``opts`` holds an option ``fn`` does not take (the message names ``what``)."""
    _algorithms().registry.check_options(fn, opts, what=what)


def get_sampler(name: str) -> Any:
    """The diffusion sampler ``name`` (its spec); an unknown name raises, listing the valid ones."""
    # lazy: keeps `import groupflow.config` torch-free (the sampler registry lives with the samplers)
    import groupflow.diffusion.samplers

    return groupflow.diffusion.samplers.get_sampler(name)
