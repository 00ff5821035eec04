"""The built-in ``instructions`` task: short writing requests with verifiable constraints.

Design decision: a real small model (SmolLM2-135M-Instruct, on a CPU) needs a task where it has
some but not much success and where success is checked by code. GSM8K is out of reach (1 %
greedy); IFEval-style constraints are not (Tulu 3's RLVR trains on them): the model writes
fluent text, and whether that text is lowercase, short, ends with a given phrase or is JSON is
a literal check (``groupflow.rewards.instructions``). Each prompt is a writing request about a
topic plus two constraints of different kinds, scored with partial credit (the fraction met),
and only if the response answers the request (at least 8 words, not a repetition, about the
row's ``topic``: ``groupflow.rewards.instructions.answers_request``).

Held-out prompts use topics no training prompt uses (every fifth topic of the list), so the
held-out split is disjoint from training by topic, not just by prompt text; both splits are
deterministic in ``seed``. Prompts are chat messages (the model's chat template applies).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "DATA_SOURCE",
    "TOPICS",
    "constraint_text",
    "distinct_rows",
    "make_instruction_rows",
    "split_topics",
]

DATA_SOURCE = "groupflow/instructions"

TOPICS = (
    "the ocean", "a rainy afternoon", "your favourite food", "learning to ride a bike",
    "the moon", "a busy train station", "autumn leaves", "a city at night", "honey bees",
    "a mountain hike", "the history of bread", "a lighthouse", "snow days", "coffee",
    "an old library", "the desert", "playing chess", "volcanoes", "a small bakery",
    "the first day of school", "whales", "a summer festival", "recycling", "the night sky",
    "a village market", "trains", "gardening", "thunderstorms", "a friendly dog", "museums",
    "rivers", "a birthday party", "bicycles", "the forest", "cooking soup", "penguins",
    "a quiet morning", "windmills", "the internet", "a football match", "tea", "islands",
    "painting", "owls", "a long road trip", "clocks", "the rainforest", "kites", "castles",
    "robots", "a farm", "sunflowers", "the post office", "camping", "dinosaurs", "bridges",
    "music lessons", "a zoo", "rain boots", "the alphabet", "sailing", "a snowman", "maps",
    "apples", "the circus", "hot air balloons", "ants", "a train journey", "homework",
    "lemonade", "the stars", "puzzles", "a picnic", "glaciers", "airports", "pianos",
    "the wind", "bees and flowers", "a science fair", "caves",
)  # fmt: skip
REQUESTS = (
    "Write a short description of {topic}.",
    "Tell me something interesting about {topic}.",
    "Write a few lines about {topic}.",
    "Explain {topic} to a child.",
)
# kind -> (instruction text, argument choices or None)
CONSTRAINTS: dict[str, tuple[str, tuple[Any, ...] | None]] = {
    "keyword": ("Include the word '{arg}' in your response.",
                ("lantern", "copper", "meadow", "harbor", "velvet", "thunder", "orchard",
                 "compass", "marble", "whistle", "falcon", "glacier")),
    "lowercase": ("Write your entire response in lowercase letters; no capital letters are "
                  "allowed.", None),
    "max_words": ("Answer in at most {arg} words.", (15, 25, 40)),
    "max_sentences": ("Use at most {arg} sentences.", (1, 2, 3)),
    "end_phrase": ('End your response with the exact phrase "{arg}"',
                   ("Is there anything else I can help with?", "That is all.",
                    "Have a nice day!")),
    "json": ("Wrap your entire response in JSON format.", None),
    "no_commas": ("Do not use any commas in your response.", None),
    "start_word": ("Start your response with the word '{arg}'.",
                   ("Indeed", "Today", "Yes", "Well")),
}  # fmt: skip
KINDS = tuple(CONSTRAINTS)
# pairs that contradict each other: text outside the JSON value breaks it; the ending phrases
# hold capitals
INCOMPATIBLE = {
    frozenset(("json", "end_phrase")),
    frozenset(("json", "start_word")),
    frozenset(("lowercase", "end_phrase")),
}
CONSTRAINTS_PER_PROMPT = 2


def constraint_text(kind: str, arg: Any) -> str:
    template, _ = CONSTRAINTS[kind]
    return template.format(arg=arg)


def split_topics() -> tuple[list[str], list[str]]:
    """(training topics, held-out topics): every fifth topic is held out."""
    heldout = [t for i, t in enumerate(TOPICS) if i % 5 == 4]
    train = [t for i, t in enumerate(TOPICS) if i % 5 != 4]
    return train, heldout


def _draw(rng: np.random.Generator, topics: list[str]) -> tuple[str, str, list[dict[str, Any]]]:
    topic = topics[rng.integers(len(topics))]
    request = REQUESTS[rng.integers(len(REQUESTS))].format(topic=topic)
    while True:
        kinds = [KINDS[i] for i in rng.choice(len(KINDS), CONSTRAINTS_PER_PROMPT, replace=False)]
        if frozenset(kinds) not in INCOMPATIBLE:
            break
    constraints = []
    for kind in kinds:
        choices = CONSTRAINTS[kind][1]
        arg = None if choices is None else choices[rng.integers(len(choices))]
        constraints.append({"kind": kind, "arg": arg})
    text = " ".join([request] + [constraint_text(c["kind"], c["arg"]) for c in constraints])
    return text, topic, constraints


def distinct_rows(
    n: int, draw: Callable[[], tuple[str, dict[str, Any]]], task: str, split: str
) -> list[dict[str, Any]]:
    """``n`` rows of distinct prompt texts: ``draw()`` gives (text, the row's other fields); the
    rows are chat prompts tagged with ``split``. Too few distinct prompts is an error naming
    ``task``."""
    rows, seen, misses = [], set(), 0
    while len(rows) < n and misses < 10_000:  # distinct prompts, until the space runs dry
        text, fields = draw()
        if text in seen:
            misses += 1
            continue
        seen.add(text)
        misses = 0
        rows.append({"prompt": [{"role": "user", "content": text}], **fields, "split": split})
    if len(rows) < n:
        raise ValueError(f"the {task} task has fewer than {n} distinct {split} prompts")
    return rows


def _rows(n: int, topics: list[str], rng: np.random.Generator, split: str) -> list[dict]:
    def draw() -> tuple[str, dict[str, Any]]:
        text, topic, constraints = _draw(rng, topics)
        # the reward checks that a response is about its topic
        return text, {"constraints": constraints, "topic": topic, "data_source": DATA_SOURCE}

    return distinct_rows(n, draw, "instructions", split)


def make_instruction_rows(
    n_train: int, n_heldout: int, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, held-out rows); held-out topics never appear in training prompts."""
    train_topics, heldout_topics = split_topics()
    heldout = _rows(n_heldout, heldout_topics, np.random.default_rng((seed, 101)), "heldout")
    train = _rows(n_train, train_topics, np.random.default_rng((seed, 102)), "train")
    return train, heldout
