import threading
from decimal import Decimal

import pytest

from groupflow.rewards import RewardConfigError
from groupflow.rewards import math as rmath
from groupflow.rewards.math import (
    extract_gsm8k_answer,
    fallback_math_equal,
    gsm8k_score,
    last_boxed,
    make_gsm8k_reward,
    make_math_boxed_reward,
    math_boxed_score,
    math_equal,
    normalize_math_answer,
    parse_gsm8k_reference,
    reference_text,
)

# ---------------------------------------------------------------------------- GSM8K reference


@pytest.mark.parametrize(
    ("ground_truth", "expected"),
    [
        ("Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", "72"),
        ("72", "72"),
        ("#### 1,234", "1234"),
        ("$5.00", "5"),
        ("-3", "-3"),
        ("#### 0.25.", "0.25"),
        ("a #### 1 #### 2", "2"),
    ],
)
def test_gsm8k_reference(ground_truth, expected):
    assert parse_gsm8k_reference(ground_truth) == Decimal(expected)


def test_gsm8k_reference_not_a_number():
    with pytest.raises(ValueError, match="'#### seven' is not a number"):
        parse_gsm8k_reference("#### seven")
    with pytest.raises(TypeError, match="must be a string or a number, got list"):
        parse_gsm8k_reference([72])
    with pytest.raises(TypeError, match="got bool"):
        parse_gsm8k_reference(True)


@pytest.mark.parametrize("number, text", [(72, "72"), (654321.0, "654321"), (0.25, "0.25")])
def test_numeric_references_are_read_as_written(number, text):
    # a parquet int/float answer column: 654321.0 must not become the text "654321.0"
    assert reference_text(number, "GSM8K") == text
    assert parse_gsm8k_reference(number) == Decimal(text)
    assert math_boxed_score(f"\\boxed{{{text}}}", number, use_math_verify=False) == 1.0


def test_references_are_picked_per_row_and_missing_ones_declared():
    reward = make_gsm8k_reward(mode="flexible")
    assert reward.reference_fields == ("ground_truth", "answer")
    assert reward(["7", "8"], ground_truth=["7", None], answer=[None, "8"]) == [1.0, 1.0]
    with pytest.raises(TypeError, match="got NoneType"):  # a sample with neither: its failure
        reward(["9"], ground_truth=[None], answer=[None])


# ---------------------------------------------------------------------------- GSM8K extraction


@pytest.mark.parametrize(
    ("completion", "strict", "flexible"),
    [
        ("so #### 1,234", "1234", "1234"),
        ("#### $5.00", "5", "5"),
        ("#### -3", "-3", "-3"),
        ("####42", "42", "42"),
        ("The answer is 7.", None, "7"),
        ("#### 72.0", "72", "72"),
        ("#### 2.5 dollars", "2.5", "2.5"),
        ("#### 5 then #### 6", "6", "6"),
        ("#### 5 then ####", None, "5"),
        ("#### no idea", None, None),
        ("no number here", None, None),
        ("she had 5-3 = 2 left", None, "2"),
        ("x = -4", None, "-4"),
        ("3,4", None, "4"),
        ("1,234,567 apples", None, "1234567"),
        ("it is .5", None, "0.5"),
    ],
)
def test_gsm8k_extraction(completion, strict, flexible):
    got_strict = extract_gsm8k_answer(completion, "strict")
    got_flexible = extract_gsm8k_answer(completion, "flexible")
    assert got_strict == (None if strict is None else Decimal(strict))
    assert got_flexible == (None if flexible is None else Decimal(flexible))


def test_gsm8k_no_300_char_window_strict():
    # verl reads only the last 300 characters and would miss this answer.
    completion = "reasoning " * 200 + "#### 42\n" + "Let me double-check my reasoning. " * 15
    assert len(completion.split("#### 42")[1]) > 300
    assert gsm8k_score(completion, "#### 42", mode="strict") == 1.0


def test_gsm8k_flexible_is_last_number_in_whole_text():
    tail = "I am confident in this result, which follows from the steps above. " * 8
    assert len(tail) > 300 and not any(ch.isdigit() for ch in tail)
    assert gsm8k_score("The answer is 42. " + tail, "42", mode="flexible") == 1.0
    # Honest semantics: a later number, wherever it appears, is the "last number".
    assert gsm8k_score("The answer is 42. Check: 3 steps. " + tail, "42", mode="flexible") == 0.0


def test_gsm8k_scores():
    assert gsm8k_score("#### 72", "72") == 1.0
    assert gsm8k_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_score("seventy-two", "72", format_score=0.1) == 0.0
    assert gsm8k_score("#### -3.50", "#### -3.5") == 1.0
    assert gsm8k_score("#### 1234", "1,234") == 1.0
    assert gsm8k_score("The answer is 7.", "7", mode="strict") == 0.0
    assert gsm8k_score("The answer is 7.", "7", mode="flexible") == 1.0


def test_gsm8k_reward_fields():
    strict = make_gsm8k_reward()
    assert strict(completions=["#### 1", "#### 3"], ground_truth=["1", "2"]) == [1.0, 0.0]
    assert strict(completions=["#### 1"], answer=["blah #### 1"]) == [1.0]
    flexible = make_gsm8k_reward(mode="flexible", correct_score=2.0, format_score=0.5)
    assert flexible(completions=["so 1", "so 3", "none"], ground_truth=["1", "2", "3"]) == [
        2.0,
        0.5,
        0.0,
    ]
    with pytest.raises(RewardConfigError, match="'ground_truth' or 'answer'.*\\['extra_info'\\]"):
        strict(completions=["#### 1"], extra_info=[{}])


def test_gsm8k_bad_options():
    with pytest.raises(RewardConfigError, match="unknown mode 'loose'.*strict.*flexible"):
        make_gsm8k_reward(mode="loose")
    with pytest.raises(RewardConfigError, match="correct_score"):
        make_gsm8k_reward(correct_score=float("nan"))


# ---------------------------------------------------------------------------- boxed extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{\\frac{1}{\\sqrt{2}}} done", "\\frac{1}{\\sqrt{2}}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\fbox{x^{2}}", "x^{2}"),
        ("$\\boxed 5$", "5"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\boxed{1} and then \\boxed{12", None),  # the last one is cut off: no answer
        ("no box", None),
        ("\\boxedfoo{3}", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("10\\text{ cm}", "10"),
        ("\\dfrac12", "\\frac{1}{2}"),
        ("90^\\circ", "90"),
        ("50\\%", "50"),
        ("x = 5", "5"),
        ("$\\text{(A)}$", "(A)"),
        ("3\\!\\,000.", "3000"),
    ],
)
def test_normalize_math_answer(raw, expected):
    assert normalize_math_answer(raw) == expected


def test_math_equal_with_math_verify():
    pytest.importorskip("math_verify")
    assert math_equal("\\frac{1}{2}", "0.5")
    assert math_equal("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2")
    assert math_equal("x^2+1", "1+x^2")
    assert not math_equal("3", "4")
    assert not math_equal("\\pi", "3.14")


def test_math_equal_fallback_when_math_verify_missing(monkeypatch):
    monkeypatch.setattr(rmath, "load_math_verify", lambda: None)
    assert math_equal("\\frac{1}{2}", "0.5")  # exact-number comparison
    assert math_equal("1,000", "1000")
    assert math_equal("\\left(1,2\\right)", "(1, 2)")
    # Symbolic equivalence needs math-verify: the fallback does not claim it.
    assert not math_equal("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2")
    assert not math_equal("x^2+1", "1+x^2")


def test_use_math_verify_false_never_loads_it(monkeypatch):
    def boom():
        raise AssertionError("math-verify must not be used")

    monkeypatch.setattr(rmath, "load_math_verify", boom)
    assert not math_equal("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2", use_math_verify=False)
    assert fallback_math_equal("-\\frac{3}{4}", "-0.75")


def test_math_verify_in_worker_thread():
    # math-verify's signal-based timeout only works in the main thread; we must not crash.
    pytest.importorskip("math_verify")
    result = {}
    worker = threading.Thread(target=lambda: result.update(ok=math_equal("\\sqrt{4}", "2")))
    worker.start()
    worker.join()
    assert result == {"ok": True}


def test_math_boxed_score():
    solution = "Half of it is $\\boxed{\\frac{1}{2}}$."
    assert math_boxed_score("so \\boxed{\\dfrac{1}{2}}", solution) == 1.0
    assert math_boxed_score("so \\boxed{3}", "\\frac{1}{2}", format_score=0.1) == 0.1
    assert math_boxed_score("the answer is 1/2", "\\frac{1}{2}", format_score=0.1) == 0.0
    assert math_boxed_score("\\boxed{}", "1", format_score=0.1) == 0.0
    with pytest.raises(ValueError, match="no usable answer"):
        math_boxed_score("\\boxed{1}", "\\boxed{")


def test_math_boxed_reward_fields_and_options():
    reward = make_math_boxed_reward(use_math_verify=False)
    assert reward(completions=["\\boxed{2}", "\\boxed{3}"], ground_truth=["2", "2"]) == [1.0, 0.0]
    assert reward(completions=["\\boxed{2}"], solution=["... \\boxed{2}"]) == [1.0]
    with pytest.raises(RewardConfigError, match="'ground_truth' or 'answer' or 'solution'"):
        reward(completions=["\\boxed{2}"])
    with pytest.raises(RewardConfigError, match="timeout_seconds"):
        make_math_boxed_reward(timeout_seconds=-1)
    with pytest.raises(RewardConfigError, match="use_math_verify"):
        make_math_boxed_reward(use_math_verify="yes")
