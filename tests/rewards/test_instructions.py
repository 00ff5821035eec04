"""The instruction-following reward (official IFEval checkers but for start_word) and its partial
credit, on hand-written responses."""

from __future__ import annotations

import pytest

from groupflow.rewards import build_reward_runner, get_reward
from groupflow.rewards.instructions import (
    answers_request,
    check_constraint,
    instruction_score,
    make_instructions_reward,
    mentions_topic,
)


@pytest.mark.parametrize(
    "kind, arg, text, expected",
    [
        ("keyword", "lantern", "An old Lantern glows.", True),
        # IFEval's keywords:existence is a case-insensitive regex search, not a whole-word match
        ("keyword", "lantern", "Lanterns glow.", True),
        ("keyword", "lantern", "A lamp glows.", False),
        ("lowercase", None, "all is quiet here tonight and the whole town is asleep.", True),
        # change_case:english_lowercase: lowercase *English* (langdetect), as IFEval grades it
        ("lowercase", None, "le chat dort sur le canapé pendant que la pluie tombe.", False),
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
    assert instruction_score("tea is warm", cs, min_words=0) == 1.0
    assert instruction_score("Tea is warm", cs, min_words=0) == 0.5
    assert instruction_score("Tea is very warm today", cs, min_words=0) == 0.0


ANSWER = "Bees carry pollen from one flower to the next one."  # 10 words, 9 distinct


@pytest.mark.parametrize(
    "text, topic, expected",
    [
        (ANSWER, "bees and flowers", True),
        (ANSWER, None, True),  # no topic: length and variety only
        ("bee on a flower", "bees and flowers", False),  # a fragment (4 words)
        ("Today today today today today must preserve the today", None, False),  # 4/9 distinct
        (ANSWER, "the history of bread", False),  # not about the topic
        ("Riding a bike takes practice and a little courage.", "learning to ride a bike", True),
    ],
)
def test_a_response_must_answer_the_request(text, topic, expected):
    assert answers_request(text, topic) is expected


def test_the_topic_is_matched_by_its_content_words_stems():
    assert mentions_topic("Two bikes.", "learning to ride a bike")  # 'bike' ~ 'bikes'
    assert mentions_topic("I learned a lot.", "learning to ride a bike")  # 'lear'
    assert not mentions_topic("The ride was long.", "the history of bread")
    with pytest.raises(ValueError, match="no content word"):
        mentions_topic("x", "the")
    with pytest.raises(ValueError, match="topic must be a string, got 7"):
        answers_request("one two three four five six seven eight", 7)


def test_a_fragment_that_meets_every_constraint_scores_zero():
    # what GRPO found on SmolLM2 without the gate: both constraints met, nothing answered
    cs = [{"kind": "no_commas", "arg": None}, {"kind": "max_words", "arg": 25}]
    assert instruction_score('"The Summer Festival in Green"', cs, "a summer festival") == 0.0
    text = "A summer festival is a big party outside with music and games for everyone."
    assert instruction_score(text, cs, "a summer festival") == 1.0
    assert instruction_score(text.replace("big", "big, loud"), cs, "a summer festival") == 0.5


def test_the_reward_reads_constraints_and_takes_chat_completions():
    fn = get_reward("instructions")
    cs = [{"kind": "no_commas", "arg": None}]
    chat = [{"role": "assistant", "content": ANSWER}]
    assert fn([ANSWER.replace("pollen", "pollen,"), chat], [cs, cs]) == [0.0, 1.0]
    assert fn([ANSWER, ANSWER], [cs, cs], topic=["bees", "bread"]) == [1.0, 0.0]
    assert get_reward("instructions", min_words=0)(["a b"], [cs]) == [1.0]
    with pytest.raises(ValueError, match="min_words must be an integer >= 0"):
        make_instructions_reward(min_words=-1)


def test_the_task_data_source_picks_this_reward():
    runner = build_reward_runner(None)
    result = runner(
        ["p"], [ANSWER.lower()], constraints=[[{"kind": "lowercase", "arg": None}]],
        topic=["honey bees"], data_source=["groupflow/instructions"],
    )  # fmt: skip
    assert result.total.tolist() == [1.0]


def test_bad_constraints_are_errors():
    with pytest.raises(ValueError, match="unknown instruction constraint 'shout'"):
        check_constraint("x", {"kind": "shout"})
    with pytest.raises(ValueError, match="at least one constraint"):
        instruction_score("x", [])
