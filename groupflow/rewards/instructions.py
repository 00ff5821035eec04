"""Verifiable instruction-following constraints (IFEval-style) with partial credit.

Design decision: each constraint is a ``(kind, argument)`` pair stored in the dataset row
(``constraints: [{kind: keyword, arg: lantern}, ...]``) and checked by one small pure function on
the response text, as IFEval's instruction checkers and Tulu 3's RLVR constraint rewards do. The
reward is the fraction of a prompt's constraints the response satisfies (partial credit gives a
weak policy a signal long before it satisfies every constraint), so ``val/*/acc`` (reward 1.0)
is IFEval's strict prompt-level accuracy and ``val/*/reward`` its instruction-level accuracy.
Checks are deliberately literal (no model, no fuzzy matching): they are what is being learned.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["CHECKERS", "check_constraint", "instruction_score", "make_instructions_reward"]

_WORD = re.compile(r"[A-Za-z0-9']+")
_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def _words(text: str) -> list[str]:
    return _WORD.findall(text)


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


def instruction_score(text: str, constraints: Sequence[Mapping[str, Any]]) -> float:
    """Fraction of ``constraints`` satisfied (IFEval's instruction-level credit)."""
    if not constraints:
        raise ValueError("a row of the instructions task needs at least one constraint")
    return sum(check_constraint(text, c) for c in constraints) / len(constraints)


def make_instructions_reward() -> Callable[..., list[float]]:
    """The reward of the built-in ``instructions`` task: reads the row field ``constraints``."""

    def instructions(completions: Sequence[Any], constraints: Sequence[Any]) -> list[float]:
        return [instruction_score(_text(c), cs) for c, cs in zip(completions, constraints)]

    return instructions
