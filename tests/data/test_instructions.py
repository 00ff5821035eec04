"""The built-in instructions task: deterministic, disjoint splits, compatible constraints."""

from __future__ import annotations

from groupflow.data import load_prompt_rows
from groupflow.data.instructions import (
    INCOMPATIBLE,
    TOPICS,
    constraint_text,
    make_instruction_rows,
)


def _topic(row):
    text = row["prompt"][0]["content"]
    topic = next(t for t in sorted(TOPICS, key=len, reverse=True) if t in text.split(".")[0])
    assert row["topic"] == topic  # the reward's relevance check reads the row's topic
    return topic


def test_splits_are_deterministic_and_held_out_topics_never_appear_in_training():
    train, val = make_instruction_rows(400, 40, seed=7)
    again, val_again = make_instruction_rows(400, 40, seed=7)
    assert train == again and val == val_again
    assert make_instruction_rows(400, 40, seed=8)[0] != train
    assert not {_topic(r) for r in train} & {_topic(r) for r in val}
    assert len({r["prompt"][0]["content"] for r in train}) == 400  # distinct prompts
    assert {r["split"] for r in train} == {"train"} and {r["split"] for r in val} == {"heldout"}


def test_rows_have_two_compatible_constraints_spelled_in_the_prompt():
    train, _ = make_instruction_rows(300, 1, seed=0)
    for r in train:
        kinds = [c["kind"] for c in r["constraints"]]
        assert len(set(kinds)) == 2 and frozenset(kinds) not in INCOMPATIBLE
        for c in r["constraints"]:
            assert constraint_text(c["kind"], c["arg"]) in r["prompt"][0]["content"]
    rows = load_prompt_rows(train)  # valid dataset rows (chat prompts, fields kept)
    assert rows[0].is_chat and rows[0].fields["data_source"] == "groupflow/instructions"
