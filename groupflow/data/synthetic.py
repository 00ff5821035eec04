"""Built-in verifiable tasks for the CPU demo: reverse a digit string, or add two numbers.

Design decision: prompts are short, fixed-width character strings (`"reverse 482913 ="` ->
`"319284"`, `"add 012345+678901 ="` -> `"691246"`) so a tiny character-level LM can learn them in
minutes, and the reward is dense enough for GRPO to get a signal from a weak policy: 1.0 for an
exact answer, else 0.3 x the fraction of answer positions the completion gets right.

Train and held-out prompts are drawn from one seeded stream of distinct problems, held-out first:
the two sets are disjoint by construction, and the held-out set depends only on
(task, seed, digits, n_heldout) — growing the training set never changes what is evaluated
(except when more than half of all problems are requested, where a full permutation is used).
Rows are plain dataset rows (`prompt`, `answer`, `data_source`, `split`), so they go through the
same `load_prompt_rows` path as user data; the `split` field lets `sft_pairs` refuse held-out rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

TASKS = ("reverse", "add", "calc")
DATA_SOURCES = {"reverse": "groupflow/reverse", "add": "groupflow/add", "calc": "groupflow/calc"}
# Largest `digits` per task such that the problem space (10**digits, resp. 10**(2*digits))
# still fits in an int64 for numpy sampling.
MAX_DIGITS = {"reverse": 18, "add": 9, "calc": 9}
# calc: the tool call a demonstration makes (the demo's calculator tool is labelled "calc")
CALC_CALL = "<calc>{a}*{b}</calc>"

EXACT_REWARD = 1.0
PARTIAL_WEIGHT = 0.3
# Text that ends a completion: EOS spellings of common tokenizers, decoded without
# skip_special_tokens. A newline ends it too, since every answer here is one line.
EOS_MARKERS = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<pad>", "\n")


# --------------------------------------------------------------------------------------------
# Problems
# --------------------------------------------------------------------------------------------


def _reverse_problem(x: int, digits: int) -> tuple[str, str]:
    s = f"{x:0{digits}d}"
    return f"reverse {s} =", s[::-1]


def _add_problem(x: int, digits: int) -> tuple[str, str]:
    a, b = divmod(x, 10**digits)
    return f"add {a:0{digits}d}+{b:0{digits}d} =", str(a + b)


def _calc_factors(x: int, digits: int) -> tuple[int, int]:
    """Two factors of exactly ``digits`` digits each (no leading zero) from one draw."""
    span = 9 * 10 ** (digits - 1)
    a, b = divmod(x, span)
    return 10 ** (digits - 1) + a, 10 ** (digits - 1) + b


def _calc_problem(x: int, digits: int) -> tuple[str, str]:
    a, b = _calc_factors(x, digits)
    return f"mul {a}*{b} =", str(a * b)


_PROBLEMS = {"reverse": _reverse_problem, "add": _add_problem, "calc": _calc_problem}


def _space_size(task: str, digits: int) -> int:
    if task == "calc":
        return (9 * 10 ** (digits - 1)) ** 2
    return 10**digits if task == "reverse" else 10 ** (2 * digits)


_DRAW_BLOCK = 4096


def _distinct_draws(rng: np.random.Generator, space: int, k: int) -> list[int]:
    """k distinct integers in [0, space), in a stream order that extends with k."""
    if k > space // 2:
        # Rejection sampling would crawl near exhaustion; the space is small here anyway.
        return [int(x) for x in rng.permutation(space)[:k]]
    seen: dict[int, None] = {}  # insertion-ordered set
    while len(seen) < k:
        # A fixed block size keeps the sequence of RNG calls independent of k, so a larger k
        # only extends the list (numpy may discard buffered bits between calls).
        for x in rng.integers(0, space, size=_DRAW_BLOCK):
            seen.setdefault(int(x))
            if len(seen) == k:
                break
    return list(seen)


def make_task_rows(
    task: str, n_train: int, n_heldout: int, seed: int, digits: int = 6
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint train / held-out rows for `task` ("reverse" or "add"), deterministic per seed.

    Each row: {"prompt": str, "answer": str, "data_source": "groupflow/<task>", "split": ...}.
    """
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; choose one of {TASKS}")
    for name, value, minimum in (
        ("n_train", n_train, 0),
        ("n_heldout", n_heldout, 0),
        ("seed", seed, 0),
        ("digits", digits, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if digits > MAX_DIGITS[task]:
        raise ValueError(f"digits must be <= {MAX_DIGITS[task]} for task {task!r}, got {digits}")
    space = _space_size(task, digits)
    if n_train + n_heldout > space:
        raise ValueError(
            f"task {task!r} with digits={digits} has only {space} distinct problems, fewer than "
            f"n_train + n_heldout = {n_train + n_heldout}; use more digits or fewer rows"
        )
    # Seed sequence (seed, task index) so the two tasks do not reuse one another's draws.
    rng = np.random.default_rng((seed, TASKS.index(task)))
    draws = _distinct_draws(rng, space, n_heldout + n_train)
    make = _PROBLEMS[task]

    def row(x: int, split: str) -> dict[str, Any]:
        prompt, answer = make(x, digits)
        out: dict[str, Any] = {
            "prompt": prompt,
            "answer": answer,
            "data_source": DATA_SOURCES[task],
            "split": split,
        }
        if task == "calc":
            out["demo"] = _calc_demo(x, digits, seed)
        return out

    heldout = [row(x, "heldout") for x in draws[:n_heldout]]
    train = [row(x, "train") for x in draws[n_heldout:]]
    return train, heldout


def _calc_demo(x: int, digits: int, seed: int) -> list[str]:
    """A demonstration for the warm start: half of the problems (chosen per problem, seeded) are
    answered with the calculator — call, then copy its result — the other half directly, which a
    tiny model cannot do; so the warm-started policy calls the tool only about half of the time
    and RL has something to learn."""
    a, b = _calc_factors(x, digits)
    use_tool = np.random.default_rng((seed, x, 7)).random() < 0.5
    return [CALC_CALL.format(a=a, b=b), str(a * b)] if use_tool else [str(a * b)]


def _row_value(row: Any, key: str) -> Any:
    if isinstance(row, dict):
        return row.get(key)
    # A PromptRow from groupflow.data.rows: prompt attribute, other columns in `fields`.
    return row.prompt if key == "prompt" else row.fields.get(key)


def sft_pairs(train_rows: Iterable[Any], eos_text: str = "") -> Iterator[tuple[str, str]]:
    """(prompt, target) pairs for the demo's supervised warm start, from TRAIN rows only.

    Accepts row dicts or `PromptRow`s; a row whose `split` is not "train" is an error, so held-out
    prompts cannot leak into the warm start. `eos_text` (e.g. the tokenizer's eos token) is
    appended to each target so the policy learns to stop.
    """
    for i, r in enumerate(train_rows):
        split = _row_value(r, "split")
        if split is not None and split != "train":
            raise ValueError(
                f"sft_pairs row {i} has split={split!r}; the warm start must use train rows only"
            )
        prompt, answer = _row_value(r, "prompt"), _row_value(r, "answer")
        if prompt is None or answer is None:
            raise ValueError(f"sft_pairs row {i} needs both 'prompt' and 'answer'")
        yield prompt, str(answer) + eos_text


# --------------------------------------------------------------------------------------------
# Rewards
# --------------------------------------------------------------------------------------------


def clean_completion(text: str) -> str:
    """The answer part of a completion: leading whitespace dropped, cut at the first EOS-like
    marker or newline, trailing whitespace dropped."""
    text = text.lstrip()
    cut = min((i for i in (text.find(m) for m in EOS_MARKERS) if i >= 0), default=len(text))
    return text[:cut].strip()


def _completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    # TRL's conversational completions: a list of messages, the last one from the assistant.
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(
        f"completion must be a string or a list of chat messages, got {type(completion).__name__}"
    )


def _score(completion: Any, answer: Any) -> float:
    if answer is None:  # str(None) would be scored as the answer "None"
        raise ValueError("the row has no answer; a synthetic-task row needs a non-empty answer")
    text = clean_completion(_completion_text(completion))
    target = str(answer).strip()
    if not target:
        raise ValueError("answer is empty; a synthetic-task row must have a non-empty answer")
    if text == target:
        return EXACT_REWARD
    right = sum(c == a for c, a in zip(text, target))  # zip stops at the shorter string
    # Dividing by the longer length makes surplus characters cost credit: otherwise RL learns
    # that never stopping is free (a longer string has more chances to match a position).
    return PARTIAL_WEIGHT * right / max(len(target), len(text))


def answer_match_reward(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any
) -> list[float]:
    """Reward for the synthetic tasks, one float per completion.

    1.0 if the cleaned completion (see `clean_completion`) equals the answer exactly; otherwise
    0.3 x (number of positions i where completion[i] == answer[i]) / max(len(answer),
    len(completion)). Surplus characters dilute the credit (so "3192845" scores 0.3 x 6/7),
    missing characters score as wrong, an empty completion scores 0.0.
    """
    if len(completions) != len(answer):
        raise ValueError(
            f"got {len(completions)} completions but {len(answer)} answers; they must align"
        )
    return [_score(c, a) for c, a in zip(completions, answer)]


reverse_reward = answer_match_reward
add_reward = answer_match_reward
# For the reward registry: data_source -> reward function.
REWARD_FUNCTIONS = {
    DATA_SOURCES["reverse"]: reverse_reward,
    DATA_SOURCES["add"]: add_reward,
    DATA_SOURCES["calc"]: answer_match_reward,  # multi-turn: scores the model's last turn
}


def exact_match(completion: Any, answer: Any) -> bool:
    """Whether a completion's cleaned answer equals `answer` exactly."""
    return clean_completion(_completion_text(completion)) == str(answer).strip()


def accuracy(completions: Sequence[Any], answers: Sequence[Any]) -> float:
    """Fraction of exact matches (0.0 for no completions)."""
    if len(completions) != len(answers):
        raise ValueError(f"got {len(completions)} completions but {len(answers)} answers")
    if not completions:
        return 0.0
    return sum(exact_match(c, a) for c, a in zip(completions, answers)) / len(completions)
