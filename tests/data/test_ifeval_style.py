from __future__ import annotations

import collections

import pytest

from groupflow.data import load_prompt_rows
from groupflow.data.ifeval_style import KINDS, make_ifeval_style_rows
from groupflow.evals.ifbench import IFBENCH
from groupflow.evals.ifeval import IFEVAL
from groupflow.rewards.instructions import make_ifeval_reward
from groupflow.rewards.official_checkers import checker_registry

pytest.importorskip("if_verifiable")


@pytest.fixture(scope="module")
def rows():
    return make_ifeval_style_rows(600, 48, 7)


def test_rows_are_deterministic_and_held_out_topics_never_appear_in_training(rows):
    train, heldout = rows
    again = make_ifeval_style_rows(600, 48, 7)
    assert train == again[0] and heldout == again[1]
    assert {r["topic"] for r in train if r["topic"]}.isdisjoint(
        {r["topic"] for r in heldout if r["topic"]}
    )
    assert make_ifeval_style_rows(600, 48, 8)[0] != train


def test_rows_are_ifeval_format_with_valid_kinds_no_conflicts_and_ifevals_counts(rows):
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_CONFLICTS

    train, _ = rows
    registry = checker_registry("ifeval")
    counts = collections.Counter(len(r["instruction_id_list"]) for r in train)
    assert set(counts) == {1, 2, 3} and counts[1] > counts[2] > counts[3]
    for r in train:
        ids = r["instruction_id_list"]
        assert len(ids) == len(r["kwargs"]) == len(set(ids))
        assert all(i in registry and i in KINDS for i in ids)
        for a in ids:  # the official conflicts, either direction
            assert not any(b in INSTRUCTION_CONFLICTS[a] for b in ids if b != a)
        for kind, kw in zip(ids, r["kwargs"]):
            if kind == "length_constraints:number_words" and kw["relation"] == "at least":
                assert kw["num_words"] <= 40  # fits max_answer_words 80
            if kind == "combination:repeat_prompt":
                assert r["prompt"][0]["content"].startswith(kw["prompt_to_repeat"])
    assert {i for r in train for i in r["instruction_id_list"]} == set(KINDS)
    assert "detectable_format:constrained_response" not in KINDS
    # rows load as prompt rows and carry the reward's fields
    loaded = list(load_prompt_rows(train[:5]))
    assert loaded[0].fields["instruction_id_list"] == train[0]["instruction_id_list"]


def test_no_ifeval_or_ifbench_prompt_is_a_training_prompt(rows):
    train, heldout = rows
    ours = [r["prompt"][0]["content"] for r in train + heldout]
    for bench in (IFEVAL, IFBENCH):
        theirs = [r.fields["raw_prompt"] for r in bench.load().rows]
        assert len(theirs) > 200
        first_sentences = {t.split(".")[0].strip().lower() for t in theirs}
        assert not set(ours) & set(theirs)
        assert not {o.split(".")[0].strip().lower() for o in ours} & first_sentences


def test_the_ifeval_reward_grades_rows_with_the_official_checkers_and_the_gate():
    reward = make_ifeval_reward()
    ids = ["punctuation:no_comma", "change_case:english_lowercase"]
    kw = [{}, {}]
    good = "the ocean is wide and deep and full of fish that swim all day long"
    one = "The ocean is wide and deep and full of fish that swim all day long"
    both_fail = "The ocean, wide and deep, is full of fish that swim all day long"
    off_topic = "the mountain is tall and cold and covered in snow most of the year"
    short = "the ocean"
    got = reward([good, one, both_fail, off_topic, short], [ids] * 5, [kw] * 5,
                 ["the ocean"] * 5)  # fmt: skip
    assert got == [1.0, 0.5, 0.0, 0.0, 0.0]
    # no topic (a response_language row): only the length / repetition gate applies
    assert reward([off_topic], [ids], [kw], [None]) == [1.0]
    # arguments are the row's kwargs
    words = reward([good], [["length_constraints:number_words"]],
                   [[{"relation": "less than", "num_words": 10}]], [None])  # fmt: skip
    assert words == [0.0]


def test_the_ifeval_reward_refuses_malformed_rows_by_name():
    reward = make_ifeval_reward()
    with pytest.raises(ValueError, match="unknown instruction id"):
        reward(["some words here about the ocean and more"], [["no:such"]], [[{}]], [None])
    with pytest.raises(ValueError, match="as many kwargs as instruction ids"):
        reward(["x"], [["punctuation:no_comma"]], [[]], [None])
    with pytest.raises(ValueError, match="min_words"):
        make_ifeval_reward(min_words=-1)
    with pytest.raises(ValueError, match="max_answer_words"):
        make_ifeval_style_rows(1, 1, 0, max_answer_words=8)
