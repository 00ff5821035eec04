"""Verifiable instruction-following constraints (IFEval-style) with partial credit.

Design decision: each constraint is a ``(kind, argument)`` pair stored in the dataset row
(``constraints: [{kind: keyword, arg: lantern}, ...]``) and checked by the official IFEval checker
of that kind (``groupflow.rewards.official_checkers``, strict, as the benchmark grades): what is
rewarded is exactly what IFEval measures (e.g. "lowercase" means lowercase *English*, as detected
by langdetect; a keyword matches anywhere, case-insensitively, as IFEval's regex does). Only
``start_word`` stays ours: IFEval has no such checker. The
reward is the fraction of a prompt's constraints the response satisfies (partial credit gives a
weak policy a signal long before it satisfies every constraint), so ``val/*/acc`` (reward 1.0)
is IFEval's strict prompt-level accuracy and ``val/*/reward`` its instruction-level accuracy.
Checks are deliberately literal (no model, no fuzzy matching): they are what is being learned.

A response must first *answer the request* (:func:`answers_request`): at least ``min_words``
words, not a repetition of a few, and — when the row names its ``topic`` — about the topic. Else
it scores 0 whatever it meets. Without this gate GRPO finds the degenerate optimum of IFEval-style
rewards within 30 steps: "no commas" + "at most 25 words" are both met by a four-word fragment
('"the swimsuitant sun"'), and a policy trained on them stops answering (measured on
SmolLM2-135M: response length 42 → 14 tokens while strict accuracy rose 6 → 69 %).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from groupflow.rewards.official_checkers import checker_registry, follow_lists

log = logging.getLogger(__name__)

__all__ = [
    "KINDS",
    "OFFICIAL",
    "answers_request",
    "check_constraint",
    "instruction_score",
    "make_ifeval_reward",
    "make_instructions_reward",
]

_WORD = re.compile(r"[A-Za-z0-9']+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text)


MIN_ANSWER_WORDS = 8
MIN_DISTINCT = 0.5  # distinct words / words: 'today today today must preserve today' fails
_FUNCTION_WORDS = frozenset("a an and at in of on the to your".split())


def _stem(word: str) -> str:
    """Crude and literal: the first four letters of a longer word ('bike' ~ 'bikes', 'learning'
    ~ 'learn'), a short word whole."""
    word = word.lower()
    return word[:4] if len(word) > 4 else word


def mentions_topic(text: str, topic: str) -> bool:
    """Some content word of ``topic`` ('a busy train station': busy, train, station) appears,
    compared by :func:`_stem`."""
    if not isinstance(topic, str):
        raise ValueError(f"instructions: a row's topic must be a string, got {topic!r}")
    wanted = {_stem(w) for w in _words(topic) if w.lower() not in _FUNCTION_WORDS}
    if not wanted:
        raise ValueError(f"instructions: topic {topic!r} has no content word")
    return any(_stem(w) in wanted for w in _words(text))


def answers_request(text: str, topic: str | None = None, min_words: int = MIN_ANSWER_WORDS) -> bool:
    """The response is an answer, not a fragment: at least ``min_words`` words, at least half of
    them distinct, and (given ``topic``) about it."""
    words = [w.lower() for w in _words(text)]
    if len(words) < min_words or len(set(words)) < MIN_DISTINCT * len(words):
        return False
    return topic is None or mentions_topic(text, topic)


def starts_with(text: str, word: str) -> bool:
    """The first word is ``word`` (case-insensitive)."""
    words = _words(text)
    return bool(words) and words[0].lower() == word.lower()


# kind -> (the official IFEval instruction id, its kwargs from the row's ``arg``). "At most N" is
# the official relation "less than" N + 1.
OFFICIAL: dict[str, tuple[str, Callable[[Any], dict[str, Any]]]] = {
    "keyword": ("keywords:existence", lambda arg: {"keywords": [arg]}),
    "lowercase": ("change_case:english_lowercase", lambda arg: {}),
    "max_words": ("length_constraints:number_words",
                  lambda arg: {"relation": "less than", "num_words": int(arg) + 1}),
    "max_sentences": ("length_constraints:number_sentences",
                      lambda arg: {"relation": "less than", "num_sentences": int(arg) + 1}),
    "end_phrase": ("startend:end_checker", lambda arg: {"end_phrase": arg}),
    "json": ("detectable_format:json_format", lambda arg: {}),
    "no_commas": ("punctuation:no_comma", lambda arg: {}),
}  # fmt: skip
# IFEval has no "the first word is W": its nearest, length_constraints:nth_paragraph_first_word,
# also demands an exact number of paragraphs, a different constraint.
OURS: dict[str, Callable[..., bool]] = {"start_word": starts_with}
KINDS = (*OFFICIAL, *OURS)


def _official(text: str, kind: str, arg: Any) -> bool:
    instruction_id, kwargs = OFFICIAL[kind]
    strict, _, errors = follow_lists(
        checker_registry("ifeval"), "", [instruction_id], [kwargs(arg)], text
    )
    for e in errors:  # scored as not followed, like the benchmark's grader
        log.warning("instructions reward: official checker raised: %s", e)
    return strict[0]


def check_constraint(text: str, constraint: Mapping[str, Any]) -> bool:
    """Whether ``text`` satisfies one ``{kind, arg}`` constraint; an unknown kind is an error."""
    kind = constraint.get("kind")
    arg = constraint.get("arg")
    if kind in OFFICIAL:
        return _official(text, kind, arg)
    if kind not in OURS:
        raise ValueError(f"unknown instruction constraint {kind!r}; known: {sorted(KINDS)}")
    return bool(OURS[kind](text) if arg is None else OURS[kind](text, arg))


def _text(completion: Any) -> str:
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))  # chat messages: the last reply
    return str(completion)


def instruction_score(
    text: str,
    constraints: Sequence[Mapping[str, Any]],
    topic: str | None = None,
    min_words: int = MIN_ANSWER_WORDS,
) -> float:
    """Fraction of ``constraints`` satisfied (IFEval's instruction-level credit), or 0 for a
    response that does not answer the request (:func:`answers_request`)."""
    if not constraints:
        raise ValueError("a row of the instructions task needs at least one constraint")
    if not answers_request(text, topic, min_words):
        return 0.0
    return sum(check_constraint(text, c) for c in constraints) / len(constraints)


def make_instructions_reward(min_words: int = MIN_ANSWER_WORDS) -> Callable[..., list[float]]:
    """The reward of the built-in ``instructions`` task: reads the row fields ``constraints`` and,
    where present, ``topic``. ``min_words``: the shortest response that counts as an answer
    (0 and no topic: the bare constraint checks)."""
    if not isinstance(min_words, int) or isinstance(min_words, bool) or min_words < 0:
        raise ValueError(f"instructions: min_words must be an integer >= 0, got {min_words!r}")

    def instructions(
        completions: Sequence[Any], constraints: Sequence[Any], topic: Sequence[Any] | None = None
    ) -> list[float]:
        topics = topic if topic is not None else [None] * len(completions)
        return [
            instruction_score(_text(c), cs, t, min_words)
            for c, cs, t in zip(completions, constraints, topics)
        ]

    return instructions


def ifeval_score(
    text: str,
    instruction_ids: Sequence[str],
    kwargs: Sequence[Mapping[str, Any]],
    topic: str | None = None,
    min_words: int = MIN_ANSWER_WORDS,
) -> float:
    """Fraction of a row's IFEval instructions the response follows, strict, by the official
    checkers (IFEval's instruction-level credit for one prompt), or 0 for a response that does not
    answer the request (:func:`answers_request`)."""
    if not instruction_ids or len(instruction_ids) != len(kwargs):
        raise ValueError(
            f"ifeval reward: a row needs as many kwargs as instruction ids, got "
            f"{len(instruction_ids)} ids and {len(kwargs)} kwargs"
        )
    registry = checker_registry("ifeval")
    unknown = [i for i in instruction_ids if i not in registry]
    if unknown:
        raise ValueError(
            f"ifeval reward: unknown instruction id(s) {unknown}; known: {sorted(registry)}"
        )
    if not answers_request(text, topic, min_words):
        return 0.0
    strict, _, errors = follow_lists(
        registry, "", list(instruction_ids), [dict(k) for k in kwargs], text
    )
    for e in errors:
        log.warning("ifeval reward: official checker raised: %s", e)
    return sum(strict) / len(strict)


def make_ifeval_reward(min_words: int = MIN_ANSWER_WORDS) -> Callable[..., list[float]]:
    """The official IFEval checkers as a reward on rows in IFEval's own format
    (``instruction_id_list``, ``kwargs``; the built-in ``ifeval_style`` task writes them, and so can
    a user's own data), with partial credit and the answer gate (``topic`` where a row has one)."""
    if not isinstance(min_words, int) or isinstance(min_words, bool) or min_words < 0:
        raise ValueError(f"ifeval reward: min_words must be an integer >= 0, got {min_words!r}")

    def ifeval(
        completions: Sequence[Any],
        instruction_id_list: Sequence[Any],
        kwargs: Sequence[Any],
        topic: Sequence[Any] | None = None,
    ) -> list[float]:
        topics = topic if topic is not None else [None] * len(completions)
        return [
            ifeval_score(_text(c), ids, kw, t, min_words)
            for c, ids, kw, t in zip(completions, instruction_id_list, kwargs, topics)
        ]

    return ifeval
