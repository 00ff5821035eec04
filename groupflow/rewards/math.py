"""Exact-answer rewards for math datasets: GSM8K (``####`` answers) and MATH (``\\boxed{}``).

Design decision: extraction and comparison are small pure functions on one string
(:func:`extract_gsm8k_answer`, :func:`last_boxed`, :func:`math_equal`), and the reward factories
only map them over a batch. Unlike verl, extraction looks at the whole completion, not its last
300 characters (verl PR 7274). GSM8K answers compare as exact decimals ("72.0" == "72").
MATH answers compare with ``math-verify`` when it is installed, always OR-ed with a documented
string/number normalisation (:func:`normalize_math_answer`) that is also the fallback without it.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

from groupflow.rewards.base import RewardConfigError


@functools.cache
def load_math_verify() -> Any:
    """The ``math_verify`` module, or None when not installed (``pip install groupflow[math]``).

    Imported lazily: it pulls in sympy, which costs seconds at start-up.
    """
    try:
        import math_verify
    except ImportError:  # the normalised string/number comparison is the documented fallback
        return None
    return math_verify


GSM8K_MODES = ("strict", "flexible")

# A number as written in GSM8K answers: "-3", "1,234", "$5.00", "0.5", ".5". The minus sign only
# counts when it does not follow a word character ("5-3" is 5 and 3); thousands separators must
# group by three ("3,4" is 3 and 4); a trailing "." (end of sentence) is not part of the number.
_NUMBER = re.compile(
    r"(?:(?<![\w)])(?P<sign>-))?\$?"
    r"(?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|(?<![\d.])\.\d+)"
)


# --------------------------------------------------------------------------------------------
# GSM8K


def _to_decimal(match: re.Match[str]) -> Decimal:
    text = match.group("digits").replace(",", "")
    return -Decimal(text) if match.group("sign") else Decimal(text)


def reference_text(value: Any, reward: str) -> str:
    """A reference answer as text: strings as they are; numbers (a parquet int or float column)
    as they are written, an integral float without its ".0" (72.0 -> "72")."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{reward} ground truth must be a string or a number, got {type(value).__name__}"
        )
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def parse_gsm8k_reference(ground_truth: str | float) -> Decimal:
    """The reference number: the text after the last ``####`` (or all of it), normalised.

    Normalisation removes ``,``, ``$``, surrounding spaces and a trailing ``.``. A number is
    taken as its value.
    """
    ground_truth = reference_text(ground_truth, "GSM8K")
    text = ground_truth.rsplit("####", 1)[-1]
    text = text.replace(",", "").replace("$", "").strip().rstrip(".").strip()
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise ValueError(f"GSM8K ground truth {ground_truth!r} is not a number") from None
    if not value.is_finite():
        raise ValueError(f"GSM8K ground truth {ground_truth!r} is not a finite number")
    return value


def extract_gsm8k_answer(completion: str, mode: str = "strict") -> Decimal | None:
    """The completion's answer, or None if it has none.

    strict: the number right after the last ``####`` (spaces and ``$`` allowed in between).
    flexible: the last number anywhere in the completion.
    """
    if mode == "strict":
        if "####" not in completion:
            return None
        match = _NUMBER.match(completion.rsplit("####", 1)[1].lstrip())
        return _to_decimal(match) if match else None
    if mode == "flexible":
        last = None
        for last in _NUMBER.finditer(completion):  # noqa: B007 - we want the final match
            pass
        return _to_decimal(last) if last else None
    raise RewardConfigError(f"unknown GSM8K mode {mode!r}; valid modes: {list(GSM8K_MODES)}")


def gsm8k_score(
    completion: str,
    ground_truth: str,
    mode: str = "strict",
    correct_score: float = 1.0,
    format_score: float = 0.0,
) -> float:
    """``correct_score`` if the answer equals the reference, ``format_score`` if an answer was
    found but differs, 0.0 if no answer was found (verl's convention)."""
    reference = parse_gsm8k_reference(ground_truth)
    answer = extract_gsm8k_answer(completion, mode)
    if answer is None:
        return 0.0
    return correct_score if answer == reference else format_score


def _pick_reference_field(reward: str, fields: dict[str, Any], names: Sequence[str]) -> list[Any]:
    """Each sample's reference: the first of ``names`` it has a (non-None) value for."""
    present = [fields[n] for n in names if n in fields]
    if not present:
        raise RewardConfigError(
            f"reward {reward!r} reads the reference answer from field "
            + " or ".join(repr(n) for n in names)
            + f", but the batch has neither; available fields: {sorted(fields)}"
        )
    return [next((v for v in column if v is not None), None) for column in zip(*present)]


def _check_score(reward: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardConfigError(f"{reward}: {key} must be a finite number, got {value!r}")
    return float(value)


def make_gsm8k_reward(
    mode: str = "strict", correct_score: float = 1.0, format_score: float = 0.0
) -> Callable[..., list[float]]:
    """GSM8K exact-answer reward; reference from field ``ground_truth`` (else ``answer``)."""
    if mode not in GSM8K_MODES:
        raise RewardConfigError(f"gsm8k: unknown mode {mode!r}; valid modes: {list(GSM8K_MODES)}")
    correct_score = _check_score("gsm8k", "correct_score", correct_score)
    format_score = _check_score("gsm8k", "format_score", format_score)

    def gsm8k(completions: list[str], **fields: Any) -> list[float]:
        references = _pick_reference_field("gsm8k", fields, ("ground_truth", "answer"))
        return [
            gsm8k_score(c, r, mode, correct_score, format_score)
            for c, r in zip(completions, references)
        ]

    gsm8k.reference_fields = ("ground_truth", "answer")  # a row needs one (checked at load)
    return gsm8k


# --------------------------------------------------------------------------------------------
# MATH (\boxed answers)

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _balanced(text: str, start: int) -> str | None:
    """Content of the brace group opening at ``text[start] == "{"``; ``\\{``/``\\}`` are literal."""
    depth = 0
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces), or None.

    Also accepts the brace-less ``\\boxed 5`` form (up to the next space or ``$``). Only the last
    occurrence counts: if it is unbalanced (e.g. a truncated generation), there is no answer.
    """
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    rest = matches[-1].end()
    if rest < len(text) and text[rest] == "{":
        return _balanced(text, rest)
    if rest < len(text) and text[rest] == " ":
        token = re.match(r" +([^\s$]+)", text[rest:])
        return token.group(1) if token else None
    return None


_UNIT_SUFFIX = re.compile(r"(?<=\S)\\(?:text|mbox|mathrm)\{\s[^{}]*\}$")
_UNWRAP = re.compile(r"\\(?:text|textbf|textit|mbox|mathrm|mathbf)\{([^{}]*)\}")
_SPACING = re.compile(r"\\(?:left|right|quad|qquad|displaystyle)(?![A-Za-z])|\\[!,;: ]|~")


def normalize_math_answer(answer: str) -> str:
    """A canonical string for a MATH answer (the fallback comparison).

    Rules, in order: drop ``$``; drop ``\\left``, ``\\right``, ``\\displaystyle`` and spacing
    (``\\! \\, \\; \\: \\quad \\qquad ~``); drop a trailing unit written as ``\\text{ cm}`` (a
    ``\\text``/``\\mbox``/``\\mathrm`` group whose content starts with a space, Hendrycks'
    convention); drop degree and percent marks (``^\\circ``, ``^{\\circ}``, ``\\%``, ``%``);
    unwrap ``\\text{X}``, ``\\textbf{X}``, ``\\mathrm{X}`` ...; ``\\dfrac``/``\\tfrac`` ->
    ``\\frac`` and ``\\frac12`` -> ``\\frac{1}{2}``; remove all whitespace; drop a leading
    ``x=`` (one variable, as in "x=5"); drop a trailing ``.``.
    """
    text = answer.replace("$", "")
    text = _SPACING.sub("", text)
    text = _UNIT_SUFFIX.sub("", text.strip())
    for mark in ("^{\\circ}", "^\\circ", "\\%", "%"):
        text = text.replace(mark, "")
    text = _UNWRAP.sub(r"\1", text)
    text = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", text)
    text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\s+", "", text)
    text = re.sub(r"^[A-Za-z]=", "", text)
    return text.rstrip(".")


_FRACTION = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$|^(-?\d+)/(-?\d+)$")


def _as_number(normalized: str) -> Fraction | None:
    """A normalised answer as an exact number (integer, decimal, a/b, \\frac{a}{b}), or None."""
    text = normalized
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):  # "1,000" is a thousands separator
        text = text.replace(",", "")
    match = _FRACTION.match(text)
    try:
        if match and match.group(2) is not None:
            value = Fraction(int(match.group(2)), int(match.group(3)))
            return -value if match.group(1) else value
        if match:
            return Fraction(int(match.group(4)), int(match.group(5)))
        if re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", text):
            return Fraction(text)
    except ZeroDivisionError:
        return None
    return None


def fallback_math_equal(reference: str, answer: str) -> bool:
    """Equal after :func:`normalize_math_answer`, as strings or as exact numbers."""
    ref, ans = normalize_math_answer(reference), normalize_math_answer(answer)
    if not ref or not ans:
        return False
    if ref == ans:
        return True
    ref_num, ans_num = _as_number(ref), _as_number(ans)
    return ref_num is not None and ref_num == ans_num


def _math_verify_equal(mv: Any, reference: str, answer: str, timeout_seconds: int) -> bool:
    # math-verify times out with signal.alarm, which only works in the main thread; elsewhere
    # (a reward thread pool, an async reward's worker thread) run without its timeout.
    in_main = threading.current_thread() is threading.main_thread()
    timeout = timeout_seconds if in_main and timeout_seconds > 0 else None
    gold = mv.parse(f"${reference.replace('$', '')}$", parsing_timeout=timeout)
    pred = mv.parse(f"${answer.replace('$', '')}$", parsing_timeout=timeout)
    if not gold or not pred:
        return False
    return bool(mv.verify(gold, pred, timeout_seconds=timeout))


def math_equal(
    reference: str, answer: str, timeout_seconds: int = 5, use_math_verify: bool = True
) -> bool:
    """True if ``answer`` matches ``reference``: normalised equality, or math-verify equivalence
    (e.g. ``\\frac{\\sqrt{2}}{2}`` vs ``\\sqrt{2}/2``) when math-verify is importable and
    ``use_math_verify`` is set."""
    if fallback_math_equal(reference, answer):
        return True
    mv = load_math_verify() if use_math_verify else None
    return mv is not None and _math_verify_equal(mv, reference, answer, timeout_seconds)


def math_boxed_score(
    completion: str,
    ground_truth: str,
    correct_score: float = 1.0,
    format_score: float = 0.0,
    timeout_seconds: int = 5,
    use_math_verify: bool = True,
) -> float:
    """``correct_score`` if the last boxed answer matches, ``format_score`` if there is a boxed
    answer that does not, 0.0 if there is none. A ground truth containing ``\\boxed{}`` (a full
    MATH solution) is reduced to its last boxed content first."""
    ground_truth = reference_text(ground_truth, "MATH")
    reference = last_boxed(ground_truth) if _BOXED.search(ground_truth) else ground_truth
    if reference is None or not reference.strip():
        raise ValueError(f"MATH ground truth {ground_truth!r} has no usable answer")
    answer = last_boxed(completion)
    if answer is None or not answer.strip():
        return 0.0
    correct = math_equal(reference, answer, timeout_seconds, use_math_verify)
    return correct_score if correct else format_score


def make_math_boxed_reward(
    correct_score: float = 1.0,
    format_score: float = 0.0,
    timeout_seconds: int = 5,
    use_math_verify: bool = True,
) -> Callable[..., list[float]]:
    """MATH-style reward on the last ``\\boxed{}``; reference from ``ground_truth`` (else
    ``answer``, else ``solution``). ``use_math_verify=False`` skips math-verify even when
    installed (faster, stricter); ``timeout_seconds`` bounds each math-verify parse/compare."""
    correct_score = _check_score("math_boxed", "correct_score", correct_score)
    format_score = _check_score("math_boxed", "format_score", format_score)
    if (
        isinstance(timeout_seconds, bool)
        or not isinstance(timeout_seconds, int)
        or timeout_seconds < 0
    ):
        raise RewardConfigError(
            f"math_boxed: timeout_seconds must be an integer >= 0 (0 = no timeout), "
            f"got {timeout_seconds!r}"
        )
    if not isinstance(use_math_verify, bool):
        raise RewardConfigError(
            f"math_boxed: use_math_verify must be true or false, got {use_math_verify!r}"
        )

    def math_boxed(completions: list[str], **fields: Any) -> list[float]:
        references = _pick_reference_field(
            "math_boxed", fields, ("ground_truth", "answer", "solution")
        )
        return [
            math_boxed_score(c, r, correct_score, format_score, timeout_seconds, use_math_verify)
            for c, r in zip(completions, references)
        ]

    math_boxed.reference_fields = ("ground_truth", "answer", "solution")
    return math_boxed
