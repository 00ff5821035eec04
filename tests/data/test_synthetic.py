"""Tests for groupflow.data.synthetic: task rows, rewards, warm-start pairs."""

import pytest

from groupflow.data.datasets import load_prompt_rows
from groupflow.data.synthetic import (
    REWARD_FUNCTIONS,
    accuracy,
    add_reward,
    clean_completion,
    exact_match,
    make_task_rows,
    reverse_reward,
    sft_pairs,
)
from groupflow.data.tokenizer import train_char_tokenizer


def prompts(rows):
    return [r["prompt"] for r in rows]


@pytest.mark.parametrize("task,digits", [("reverse", 6), ("add", 3), ("reverse", 2)])
def test_train_and_heldout_disjoint_and_distinct(task, digits):
    train, heldout = make_task_rows(task, 60, 30, seed=0, digits=digits)
    assert len(train) == 60 and len(heldout) == 30
    assert len(set(prompts(train))) == 60 and len(set(prompts(heldout))) == 30
    assert not set(prompts(train)) & set(prompts(heldout))
    assert {r["split"] for r in train} == {"train"} and {r["split"] for r in heldout} == {"heldout"}


def test_deterministic_per_seed_and_heldout_independent_of_n_train():
    a = make_task_rows("reverse", 50, 20, seed=1)
    assert a == make_task_rows("reverse", 50, 20, seed=1)
    assert a != make_task_rows("reverse", 50, 20, seed=2)
    bigger = make_task_rows("reverse", 500, 20, seed=1)
    assert bigger[1] == a[1] and bigger[0][:50] == a[0]
    # Several RNG blocks with duplicates (4800 of 10**4 problems): still a prefix-stable stream.
    small = make_task_rows("reverse", 100, 300, seed=3, digits=4)
    large = make_task_rows("reverse", 4500, 300, seed=3, digits=4)
    assert large[1] == small[1] and large[0][:100] == small[0]


def test_row_format():
    (row,), _ = make_task_rows("reverse", 1, 0, seed=0)
    digits = row["prompt"][len("reverse ") : -len(" =")]
    assert row["prompt"] == f"reverse {digits} =" and len(digits) == 6
    assert row["answer"] == digits[::-1] and row["data_source"] == "groupflow/reverse"
    (add,), _ = make_task_rows("add", 1, 0, seed=0, digits=4)
    a, b = add["prompt"][len("add ") : -len(" =")].split("+")
    assert len(a) == len(b) == 4 and add["answer"] == str(int(a) + int(b))
    assert add["data_source"] == "groupflow/add"


def test_rows_are_valid_dataset_rows_and_fit_the_tokenizer():
    train, _ = make_task_rows("add", 5, 0, seed=0)
    ds = load_prompt_rows(train)
    assert ds[0].fields["answer"] == train[0]["answer"]
    tok = train_char_tokenizer()
    assert tok.unk_token_id not in tok(train[0]["prompt"])["input_ids"]


def test_bad_arguments():
    with pytest.raises(
        ValueError, match=r"unknown synthetic task 'mul'.*\('reverse', 'add', 'calc'\)"
    ):
        make_task_rows("mul", 1, 1, seed=0)
    with pytest.raises(ValueError, match="only 10 distinct problems"):
        make_task_rows("reverse", 8, 3, seed=0, digits=1)
    with pytest.raises(ValueError, match="digits must be <= 9"):
        make_task_rows("add", 1, 1, seed=0, digits=10)
    with pytest.raises(ValueError, match="n_train must be >= 0"):
        make_task_rows("reverse", -1, 1, seed=0)


def test_exhaustive_space_still_disjoint():
    train, heldout = make_task_rows("reverse", 7, 3, seed=0, digits=1)
    assert sorted(prompts(train) + prompts(heldout)) == [f"reverse {d} =" for d in range(10)]


def test_reverse_reward_hand_computed():
    answer = "319284"
    completions = [
        "319284",  # exact -> 1.0
        "  319284<eos><pad>",  # exact after cleaning -> 1.0
        "319284\nreverse 1 =",  # cut at newline -> 1.0
        "319000",  # 3/6 right -> 0.3 * 0.5 = 0.15
        "3192845",  # longer: 6 positions right of 7 characters -> 0.3 * 6/7
        "3192",  # shorter: 4/6 -> 0.2
        "",  # empty -> 0.0
        "482913",  # no position right -> 0.0
        "x19284",  # 5/6 -> 0.25
    ]
    got = reverse_reward([""] * 9, completions, [answer] * 9)
    assert got == pytest.approx([1.0, 1.0, 1.0, 0.15, 0.3 * 6 / 7, 0.2, 0.0, 0.0, 0.25])
    assert add_reward(["p"], ["1627"], ["1627"]) == [1.0]
    assert REWARD_FUNCTIONS["groupflow/reverse"] is reverse_reward
    assert REWARD_FUNCTIONS["groupflow/add"] is add_reward


def test_reward_accepts_chat_completions_and_checks_alignment():
    assert reverse_reward(["p"], [[{"role": "assistant", "content": "21"}]], ["21"]) == [1.0]
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        reverse_reward(["p", "q"], ["1", "2"], ["1"])
    with pytest.raises(ValueError, match="answer is empty"):
        reverse_reward(["p"], ["1"], [""])
    with pytest.raises(TypeError, match="got int"):
        reverse_reward(["p"], [5], ["5"])


def test_exact_match_and_accuracy():
    assert clean_completion(" 12 </s> 34") == "12"
    assert exact_match("12<eos>", "12") and not exact_match("123", "12")
    assert accuracy(["12", "13", " 14\n", "1"], ["12", "12", "14", "2"]) == 0.5
    assert accuracy([], []) == 0.0


def test_sft_pairs_use_train_rows_only():
    train, heldout = make_task_rows("reverse", 3, 2, seed=0)
    pairs = list(sft_pairs(train, eos_text="<eos>"))
    assert pairs == [(r["prompt"], r["answer"] + "<eos>") for r in train]
    assert list(sft_pairs(load_prompt_rows(train))) == [(r["prompt"], r["answer"]) for r in train]
    with pytest.raises(ValueError, match="row 0 has split='heldout'"):
        list(sft_pairs(heldout))


def test_a_missing_answer_is_an_error_not_the_text_none():
    # str(None) == "None": a completion "None" used to score as an exact match
    with pytest.raises(ValueError, match="the row has no answer"):
        reverse_reward(["p"], ["None"], answer=[None])
