"""The configuration reference: every key of the schema is described, and descriptions are read
from the places the schema's authors write them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from groupflow.config import Config
from groupflow.config.reference import config_reference, field_comments


class _Inner(BaseModel):
    """An inner section.

    Its second paragraph is not part of the description."""

    width: int = Field(3, ge=1, le=9)  # how wide


class _Outer(BaseModel):
    # the comment block above
    # spans two lines
    above: str = "x"
    trailing: float = 1.5  # on the same line
    wrapped: int | None = Field(
        None, ge=0
    )  # after a statement that ruff split over lines, because this comment is far too long
    explicit: int = Field(0, description="from Field")  # the comment loses to it
    kind: Literal["a", "b"] = "a"
    inner: _Inner = Field(default_factory=_Inner)
    items: list[_Inner] = Field(default_factory=list)
    bare: bool = False


def test_comments_are_read_from_above_the_same_line_and_a_split_statement():
    assert field_comments(_Outer) == {
        "above": "the comment block above spans two lines",
        "trailing": "on the same line",
        "wrapped": "after a statement that ruff split over lines, because this comment is far too long",
        "explicit": "the comment loses to it",
    }


def test_reference_walks_nested_sections_with_types_defaults_and_allowed_values():
    sections = {s.path: s for s in config_reference(_Outer)}
    assert list(sections) == ["", "inner", "items[]"]
    keys = {k.path: k for k in sections[""].keys}
    assert keys["explicit"].description == "from Field"
    assert keys["kind"].allowed == "'a' · 'b'" and keys["kind"].type == "str"
    assert keys["wrapped"].type == "int | null" and keys["wrapped"].allowed == "≥ 0"
    assert keys["inner"].description == "An inner section." and keys["inner"].default == "{}"
    assert keys["bare"].description == ""  # what the completeness test below catches
    (width,) = sections["items[]"].keys
    assert (width.path, width.default, width.allowed) == ("items[].width", "3", "≥ 1, ≤ 9")
    assert width.description == "how wide"


def test_every_configuration_key_is_described():
    sections = config_reference(Config)
    keys = [k for s in sections for k in s.keys]
    assert len(keys) > 300
    missing = [k.path for k in keys if not k.description]
    assert not missing, (
        f"configuration keys without a description ({len(missing)}): {missing}; write a comment "
        "beside or above the field (groupflow.config.reference reads it)"
    )
    assert {"run.seed", "rollout.max_staleness", "diffusion.model.kind"} <= {k.path for k in keys}
