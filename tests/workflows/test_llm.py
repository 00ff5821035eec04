"""Shared LLM workflow helpers: a warm-start demonstration's model turns (multi-turn and agent
workflows read them alike) and the error that names the bad row, file and field."""

import pytest

from groupflow.data import PromptRow
from groupflow.workflows.llm import sft_turns


def _row(value):
    return PromptRow("q", {} if value is ... else {"demo": value}, "train.jsonl", 7)


def test_one_turn_or_a_list_of_turns():
    assert sft_turns(_row("4"), "demo") == ["4"]
    assert sft_turns(_row(["call", "4"]), "demo") == ["call", "4"]


@pytest.mark.parametrize("value", [..., None, [], ["ok", 3], 5, {"turn": "x"}])
def test_a_bad_demonstration_names_row_file_and_field(value):
    with pytest.raises(
        ValueError, match=r"sft: row 7 of train.jsonl: field 'demo' \(sft.target_field\)"
    ):
        sft_turns(_row(value), "demo")
