"""The base of every run-configuration section: a strict pydantic model, the config's error
type, and the field types the sections share.

Design decision: strict sections (unknown keys are errors, no silent coercion), with defaults that
make an example file short. Every batch-size name states its unit — ``prompts_per_step``,
``samples_per_prompt``, ``mini_batch_samples``, ``micro_batch_samples`` / ``micro_batch_tokens`` —
because mixing prompt and sample units is the most common verl misconfiguration. A check that
needs one section only lives on that section; checks across sections live on ``Config``
(``config/root.py``). The LLM-side sections are split by domain: ``model_data`` (what a run
starts from), ``rollout`` (how experience is produced and served), ``training`` (how the policy
and the critic learn from it), ``rewards`` (what scores it), ``run`` (where the run executes,
what it records, how it is evaluated); ``diffusion`` holds the diffusion policy's section.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
)


class ConfigError(ValueError):
    """The configuration file or an override is invalid."""


_T = TypeVar("_T")


def present(value: _T | None, key: str) -> _T:
    """``value`` of an optional section or key that validation guarantees to be set where this
    is called (``model`` of an LLM run, ``diffusion`` of a diffusion run, ``model.path`` of a
    model that is not tiny). The type checker narrows on it. A config built around the
    validator gets a ``ConfigError`` naming the key, not an ``AttributeError`` on None."""
    if value is None:
        raise ConfigError(f"{key} must be set here (it is None)")
    return value


class _Section(BaseModel):
    # strict: no silent coercion — `prompts_per_step: true` is not 1, `greedy: 1` is not true,
    # `total_steps: 2.5` or "3" is not an int. An int is still accepted where a float is expected.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


def _list_as_tuple(value: Any) -> Any:
    # YAML has no tuples: a fixed-length pair is written (and dumped by to_dict) as a list.
    return tuple(value) if isinstance(value, list) else value


FloatPair = Annotated[tuple[float, float], BeforeValidator(_list_as_tuple)]
IntPair = Annotated[tuple[int, int], BeforeValidator(_list_as_tuple)]
