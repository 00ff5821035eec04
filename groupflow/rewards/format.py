"""Format reward: does the completion follow ``<think>…</think> <answer>…</answer>``?

Design decision: one regular expression built once from the tag names. Each block's content may
not contain its own tags, so ``<think>a</think><answer>b</answer><answer>c</answer>`` does not
pass by letting ``.*`` swallow the extra tags (TRL's pattern lets it). Mode ``"full"`` (default)
requires the whole completion, up to surrounding whitespace, to be exactly the two blocks;
``"search"`` accepts the blocks anywhere. Content may span lines (DOTALL).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from groupflow.rewards.base import RewardConfigError

FORMAT_MODES = ("full", "search")
_TAG_NAME = re.compile(r"[A-Za-z][\w.-]*")


def _block(tag: str) -> str:
    name = re.escape(tag)
    inner = rf"(?:(?!</?{name}>).)*"
    return rf"<{name}>{inner}</{name}>"


def format_pattern(
    think_tag: str | None = "think", answer_tag: str = "answer", mode: str = "full"
) -> re.Pattern[str]:
    """The compiled pattern; ``think_tag=None`` requires only the answer block."""
    for key, tag in (("think_tag", think_tag), ("answer_tag", answer_tag)):
        if tag is None and key == "think_tag":
            continue
        if not isinstance(tag, str) or not _TAG_NAME.fullmatch(tag):
            raise RewardConfigError(
                f"format_tags: {key} must be a tag name like 'think' (letters, digits, _ . -), "
                f"got {tag!r}"
            )
    if mode not in FORMAT_MODES:
        raise RewardConfigError(
            f"format_tags: unknown mode {mode!r}; valid modes: {list(FORMAT_MODES)}"
        )
    body = (
        _block(answer_tag) if think_tag is None else rf"{_block(think_tag)}\s*{_block(answer_tag)}"
    )
    if mode == "full":
        body = rf"\A\s*{body}\s*\Z"
    return re.compile(body, re.DOTALL)


def make_format_tags_reward(
    think_tag: str | None = "think",
    answer_tag: str = "answer",
    mode: str = "full",
    score: float = 1.0,
) -> Callable[..., list[float]]:
    """``score`` for completions matching :func:`format_pattern`, else 0.0."""
    pattern = format_pattern(think_tag, answer_tag, mode)
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        raise RewardConfigError(f"format_tags: score must be a finite number, got {score!r}")
    score = float(score)

    def format_tags(completions: list[str]) -> list[float]:
        return [score if pattern.search(c) else 0.0 for c in completions]

    return format_tags
