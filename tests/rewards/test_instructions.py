"""The instruction-following checkers and the partial-credit reward, on hand-written responses."""

from __future__ import annotations

import pytest

from groupflow.rewards import build_reward_runner, get_reward
from groupflow.rewards.instructions import check_constraint, instruction_score


@pytest.mark.parametrize(
    "kind, arg, text, expected",
    [
        ("keyword", "lantern", "An old Lantern glows.", True),
        ("keyword", "lantern", "Lanterns glow.", False),  # a whole word, not a prefix
        ("lowercase", None, "all quiet here.", True),
        ("lowercase", None, "all quiet here. Mostly.", False),
        ("lowercase", None, "123 ...", False),  # no letters: nothing was written in lowercase
        ("max_words", 3, "one two three", True),
        ("max_words", 3, "one two three four", False),
        ("max_words", 3, "", False),
        ("max_sentences", 2, "First one. Second one!", True),
        ("max_sentences", 2, "First. Second. Third.", False),
        ("max_sentences", 1, "No end mark", True),
        ("max_sentences", 1, "Ends. then more", False),  # a second sentence without a mark
        ("end_phrase", "That is all.", "Trains are long. That is all.  \n", True),
        ("end_phrase", "That is all.", "That is all. Bye.", False),
        ("json", None, '{"topic": "tea", "text": "warm"}', True),
        ("json", None, '```json\n{"a": 1}\n```', True),
        ("json", None, 'Here: {"a": 1}', False),
        ("no_commas", None, "tea is warm and kind", True),
        ("no_commas", None, "tea, warm", False),
        ("start_word", "Indeed", "indeed, it is.", True),
        ("start_word", "Indeed", "Yes indeed.", False),
    ],
)
def test_each_checker_on_hand_written_text(kind, arg, text, expected):
    assert check_constraint(text, {"kind": kind, "arg": arg}) is expected


def test_the_score_is_the_fraction_of_constraints_met():
    cs = [{"kind": "lowercase", "arg": None}, {"kind": "max_words", "arg": 4}]
    assert instruction_score("tea is warm", cs) == 1.0
    assert instruction_score("Tea is warm", cs) == 0.5
    assert instruction_score("Tea is very warm today", cs) == 0.0


def test_the_reward_reads_constraints_and_takes_chat_completions():
    fn = get_reward("instructions")
    cs = [{"kind": "no_commas", "arg": None}]
    assert fn(["a, b", [{"role": "assistant", "content": "a b"}]], [cs, cs]) == [0.0, 1.0]


def test_the_task_data_source_picks_this_reward():
    runner = build_reward_runner(None)
    result = runner(
        ["p"], ["hello"], constraints=[[{"kind": "lowercase", "arg": None}]],
        data_source=["groupflow/instructions"],
    )  # fmt: skip
    assert result.total.tolist() == [1.0]


def test_bad_constraints_are_errors():
    with pytest.raises(ValueError, match="unknown instruction constraint 'shout'"):
        check_constraint("x", {"kind": "shout"})
    with pytest.raises(ValueError, match="at least one constraint"):
        instruction_score("x", [])
