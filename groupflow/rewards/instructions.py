"""Verifiable instruction-following constraints (IFEval-style) with partial credit.

Design decision: each constraint is a ``(kind, argument)`` pair stored in the dataset row
(``constraints: [{kind: keyword, arg: lantern}, ...]``) and checked by one small pure function on
the response text, as IFEval's instruction checkers and Tulu 3's RLVR constraint rewards do. The
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

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "CHECKERS",
    "answers_request",
    "check_constraint",
    "instruction_score",
    "make_instructions_reward",
]

_WORD = re.compile(r"[A-Za-z0-9']+")
_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


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


def has_keyword(text: str, word: str) -> bool:
    """The word appears as a whole word, in any case."""
    return word.lower() in (w.lower() for w in _words(text))


def all_lowercase(text: str) -> bool:
    """Letters present and none of them upper case."""
    return any(c.isalpha() for c in text) and text == text.lower()


def max_words(text: str, limit: int) -> bool:
    """At most ``limit`` words (and at least one)."""
    return 0 < len(_words(text)) <= int(limit)


def max_sentences(text: str, limit: int) -> bool:
    """At most ``limit`` sentences: runs of . ! ? before a space or the end, plus a last sentence
    left without one."""
    text = text.strip()
    if not text:
        return False
    ends = _SENTENCE_END.findall(text)
    tail = 0 if re.search(r"[.!?]\s*$", text) else 1
    return len(ends) + tail <= int(limit)


def ends_with(text: str, phrase: str) -> bool:
    """The response ends with exactly ``phrase`` (trailing whitespace ignored)."""
    return text.rstrip().endswith(phrase)


def is_json(text: str) -> bool:
    """The whole response is one JSON value (a ```json fence around it is allowed, as IFEval)."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    try:
        json.loads(body)
    except ValueError:
        return False
    return bool(body)


def no_commas(text: str) -> bool:
    return bool(text.strip()) and "," not in text


def starts_with(text: str, word: str) -> bool:
    """The first word is ``word`` (case-insensitive)."""
    words = _words(text)
    return bool(words) and words[0].lower() == word.lower()


CHECKERS: dict[str, Callable[..., bool]] = {
    "keyword": has_keyword,
    "lowercase": all_lowercase,
    "max_words": max_words,
    "max_sentences": max_sentences,
    "end_phrase": ends_with,
    "json": is_json,
    "no_commas": no_commas,
    "start_word": starts_with,
}


def check_constraint(text: str, constraint: Mapping[str, Any]) -> bool:
    """Whether ``text`` satisfies one ``{kind, arg}`` constraint; an unknown kind is an error."""
    kind = constraint.get("kind")
    if kind not in CHECKERS:
        raise ValueError(f"unknown instruction constraint {kind!r}; known: {sorted(CHECKERS)}")
    fn = CHECKERS[kind]
    arg = constraint.get("arg")
    return bool(fn(text) if arg is None else fn(text, arg))


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
