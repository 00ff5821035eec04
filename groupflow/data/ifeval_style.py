"""The built-in ``ifeval_style`` task: our writing requests, IFEval's instruction kinds.

Design decision: to teach what IFEval measures without training on IFEval, each prompt is one of
our own writing requests about one of our topics (``groupflow.data.instructions``' topics, the
same held-out split by topic) followed by 1-3 verifiable instructions drawn the way IFEval's
authors drew theirs: the official checker class of a kind builds its own description and draws
its own arguments (``build_description``; Python's ``random`` seeded per row, so the rows are
deterministic in ``seed``), conflicting kinds are never paired (the official
``INSTRUCTION_CONFLICTS``), and 1/2/3 instructions per prompt come in IFEval's own proportions
(305/179/57 of 541). A row is in IFEval's own format (``instruction_id_list``, ``kwargs``), so the
reward (``groupflow.rewards.instructions.make_ifeval_reward``) grades it with the official
checkers exactly as the benchmark grades a response; no IFEval or IFBench prompt text is used
(``tests/data/test_ifeval_style.py`` checks that none appears).

Two departures from the checkers' own draws, both for a policy trained with short answers on a
CPU: arguments that need more words than ``max_answer_words`` allows ("at least 300 words", "at
least 17 sentences", twenty all-capital words) are drawn from ranges that fit, and
``response_language`` asks for a Latin-script language (the answer gate counts Latin-script
words). ``detectable_format:constrained_response`` ("answer with one of: My answer is yes.") is
not drawn: it conflicts with every other kind and its answer is shorter than the gate's 8 words.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np

from groupflow.data.instructions import distinct_rows, split_topics
from groupflow.rewards.official_checkers import checker_registry, seeded_random

__all__ = ["DATA_SOURCE", "KINDS", "REQUESTS", "make_ifeval_style_rows"]

DATA_SOURCE = "groupflow/ifeval_style"

REQUESTS = (
    "Write a short description of {topic}.",
    "Tell me something interesting about {topic}.",
    "Write a short story about {topic}.",
    "Write a poem about {topic}.",
    "Write a short blog post about {topic}.",
    "Write an email to a friend about {topic}.",
    "Explain {topic} to a child.",
    "Give me some tips about {topic}.",
    "Write a short advertisement about {topic}.",
    "Write a short essay about {topic}.",
    "Write a letter to your teacher about {topic}.",
    "Describe a day spent with {topic}.",
)
# IFEval's kinds, less constrained_response (see the module docstring)
KINDS = (
    "keywords:existence", "keywords:frequency", "keywords:forbidden_words",
    "keywords:letter_frequency", "language:response_language",
    "length_constraints:number_sentences", "length_constraints:number_paragraphs",
    "length_constraints:number_words", "length_constraints:nth_paragraph_first_word",
    "detectable_content:number_placeholders", "detectable_content:postscript",
    "detectable_format:number_bullet_lists", "detectable_format:number_highlighted_sections",
    "detectable_format:multiple_sections", "detectable_format:json_format",
    "detectable_format:title", "combination:two_responses", "combination:repeat_prompt",
    "startend:end_checker", "change_case:capital_word_frequency", "change_case:english_capital",
    "change_case:english_lowercase", "punctuation:no_comma", "startend:quotation",
)  # fmt: skip
# IFEval's split of its 541 prompts into 1, 2 and 3 instructions
COUNT_WEIGHTS = (305, 179, 57)
LATIN_LANGUAGES = ("es", "fr", "de", "it", "pt")


def _fitting_args(kind: str, max_words: int) -> dict[str, Any]:
    """Arguments of ``kind`` that an answer of ``max_words`` words can meet (the rest of a kind's
    arguments, and every argument of other kinds, are the checker's own draw)."""
    relation = random.choice(("less than", "at least"))
    if kind == "length_constraints:number_words":
        low = max(2 * 8, max_words // 8)
        n = (
            random.randint(low, max_words // 2)
            if relation == "at least"
            else random.randint(low, max_words + max_words // 2)
        )
        return {"relation": relation, "num_words": n}
    if kind == "length_constraints:number_sentences":
        top = max(2, max_words // 16)
        return {"relation": relation, "num_sentences": random.randint(1 if relation == "at least" else 2, top)}  # fmt: skip
    if kind == "change_case:capital_word_frequency":
        top = max(2, max_words // 10)
        return {"capital_relation": relation, "capital_frequency": random.randint(1, top)}
    if kind in ("length_constraints:number_paragraphs", "detectable_format:multiple_sections"):
        key = "num_paragraphs" if "paragraphs" in kind else "num_sections"
        return {key: random.randint(1, max(1, min(5, max_words // 20)))}
    if kind == "length_constraints:nth_paragraph_first_word":
        n = random.randint(1, max(1, min(5, max_words // 20)))
        return {"num_paragraphs": n, "nth_paragraph": random.randint(1, n)}
    if kind == "language:response_language":
        return {"language": random.choice(LATIN_LANGUAGES)}
    return {}


def _conflicts() -> dict[str, set[str]]:
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_CONFLICTS, conflict_make

    return conflict_make({k: set(v) for k, v in INSTRUCTION_CONFLICTS.items()})


def _instructions(
    registry: Mapping[str, type], conflicts: Mapping[str, set[str]], request: str, max_words: int
) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """(ids, descriptions, kwargs) of 1-3 non-conflicting instructions, drawn with ``random``."""
    (count,) = random.choices((1, 2, 3), weights=COUNT_WEIGHTS)
    ids: list[str] = []
    while len(ids) < count:
        kind = random.choice(KINDS)
        if any(kind in conflicts[i] for i in ids):
            continue
        ids.append(kind)
    descriptions, kwargs = [], []
    for kind in ids:
        checker = registry[kind](kind)
        args = _fitting_args(kind, max_words)
        if kind == "combination:repeat_prompt":
            args = {"prompt_to_repeat": request}
        descriptions.append(checker.build_description(**args))
        kwargs.append(dict(checker.get_instruction_args() or {}))
    return ids, descriptions, kwargs


def _rows(n: int, topics: list[str], seed: int, split: str, max_words: int) -> list[dict[str, Any]]:  # fmt: skip
    registry, conflicts = checker_registry("ifeval"), _conflicts()
    rng = np.random.default_rng(seed)

    def draw() -> tuple[str, dict[str, Any]]:
        topic = topics[rng.integers(len(topics))]
        request = REQUESTS[rng.integers(len(REQUESTS))].format(topic=topic)
        with seeded_random(int(rng.integers(2**31))):
            ids, descriptions, kwargs = _instructions(registry, conflicts, request, max_words)
        # the answer gate's topic; a response in another language cannot name it in English
        gate = None if "language:response_language" in ids else topic
        fields = {"instruction_id_list": ids, "kwargs": kwargs, "topic": gate,
                  "data_source": DATA_SOURCE}  # fmt: skip
        return " ".join([request, *descriptions]), fields

    return distinct_rows(n, draw, "ifeval_style", split)


def make_ifeval_style_rows(
    n_train: int, n_heldout: int, seed: int, max_answer_words: int = 80
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, held-out rows) in IFEval's row format; held-out topics never appear in
    training prompts. ``max_answer_words``: the longest answer the instructions may demand."""
    if max_answer_words < 16:
        raise ValueError(f"ifeval_style: max_answer_words must be >= 16, got {max_answer_words}")
    train, heldout = split_topics()
    return (
        _rows(n_train, train, seed * 2 + 1, "train", max_answer_words),
        _rows(n_heldout, heldout, seed * 2, "heldout", max_answer_words),
    )
