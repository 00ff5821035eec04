"""Loading a run configuration: YAML (duplicate keys refused) plus dotted ``key=value``
overrides, validated once, with errors that name the full key path and the closest valid key.

Design decision: every way in (a file, overrides, a dict from the Python API) ends in
``config_from_dict``, so each gets the same validation and the same messages.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from groupflow.config.base import ConfigError
from groupflow.config.keys import suggest
from groupflow.config.presets import shadowed_by_file
from groupflow.config.root import Config

__all__ = ["apply_overrides", "config_from_dict", "load_config", "parse_overrides"]

log = logging.getLogger("groupflow")


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, but a key repeated in one mapping is an error, not a silent overwrite.

    PyYAML keeps the last value of a repeated key, so a second ``actor:`` section would drop the
    first one without a word. Keys brought in by a ``<<:`` merge may still be overridden, as YAML
    intends.
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r} (first at line {first}, again at line {line}); "
                        "keep one of them",
                        key_node.start_mark,
                    )
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["actor.lr=1e-4", "rollout.stop=[\\"\\n\\"]"]`` → ``{"actor.lr": 1e-4, ...}`` (values are YAML)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"override '{item}' is not of the form key=value (e.g. actor.lr=1e-4)"
            )
        try:
            value = _load_yaml(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(
                f"override '{item}': value is not valid YAML{_yaml_where(e)}"
            ) from None
        out[key] = _yaml11_float(value)
    return out


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)$")


def _yaml11_float(value: Any) -> Any:
    """YAML 1.1 reads '1e-4' (no dot) as a string; users mean a float."""
    if isinstance(value, str) and _FLOAT.match(value):
        return float(value)
    if isinstance(value, list):
        return [_yaml11_float(v) for v in value]
    if isinstance(value, dict):
        return {k: _yaml11_float(v) for k, v in value.items()}
    return value


def _yaml_where(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    if mark is None:
        return f": {problem}"
    return f" (line {mark.line + 1}, column {mark.column + 1}): {problem}"


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    for dotted, value in overrides.items():
        node = data
        parts = dotted.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ConfigError(f"override '{dotted}': '{where}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def config_from_dict(
    data: dict[str, Any], source: str = "<config>", *, python_data: tuple[str, ...] = ()
) -> Config:
    """Validate ``data``. ``python_data``: the datasets given as Python objects (``"train"``,
    ``"val"``; the Python API), which the config then must not name too."""
    import importlib

    for module in data.get("imports") or []:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(
                f"invalid configuration in {source}: 'imports': cannot import '{module}' ({e})"
            ) from e
    try:
        return Config.model_validate(data, context={"python_data": tuple(python_data)})
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def load_config(
    path: str | Path | None,
    overrides: list[str] | dict[str, Any] | None = None,
    *,
    python_data: tuple[str, ...] = (),
) -> Config:
    data: dict[str, Any] = {}
    source = "<overrides>"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            data = _load_yaml(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{path}' is not valid YAML{_yaml_where(e)}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{path}' must contain a mapping at the top level")
        data = _yaml11_float(data)
    if overrides:
        ov = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        if path is not None:
            for key, preset_value, file_value in shadowed_by_file(data, ov):
                log.warning(
                    "algorithm.preset=%s sets %s=%r, but %s gives %s=%r, which wins (a key "
                    "given explicitly does); add %s=%r to take the preset's",
                    ov.get("algorithm.preset") or ov["algorithm"]["preset"], key, preset_value,
                    path, key, file_value, key, preset_value,
                )  # fmt: skip
        data = apply_overrides(data, ov)
        source = f"{source} with overrides" if path is not None else source
    return config_from_dict(data, source, python_data=python_data)


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for e in err.errors():
        loc = [str(x) for x in e["loc"]]
        key = ".".join(loc) or "<top level>"
        if e["type"] == "extra_forbidden":
            hint = suggest(Config, loc)
            lines.append(f"  - '{key}': unknown key{hint}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = e.get("input")
            shown = "" if isinstance(got, dict) or got is None else f" (got {got!r})"
            lines.append(f"  - '{key}': {msg}{shown}")
    return "\n".join(lines)
