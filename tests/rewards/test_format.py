import pytest

from groupflow.rewards import RewardConfigError
from groupflow.rewards.format import format_pattern, make_format_tags_reward


def score(completions, **options):
    return make_format_tags_reward(**options)(completions=completions)


def test_full_mode():
    good = [
        "<think>step 1\nstep 2</think>\n<answer>42</answer>",
        "  <think></think><answer>x</answer>\n",
    ]
    bad = [
        "<think>a</think>",  # no answer block
        "<answer>42</answer>",  # no think block
        "Sure! <think>a</think><answer>b</answer>",  # text before
        "<think>a</think><answer>b</answer> trailing",  # text after
        "<think>a</think><answer>b</answer><answer>c</answer>",  # a second answer
        "<answer>b</answer><think>a</think>",  # wrong order
        "<think>a<think>b</think><answer>c</answer>",  # nested think tag
    ]
    assert score(good) == [1.0, 1.0]
    assert score(bad) == [0.0] * len(bad)


def test_search_mode():
    got = score(
        ["Sure! <think>a</think> <answer>b</answer> done", "<answer>b</answer>"], mode="search"
    )
    assert got == [1.0, 0.0]


def test_custom_tags_score_and_answer_only():
    assert score(
        ["<reasoning>r</reasoning><final>f</final>"],
        think_tag="reasoning",
        answer_tag="final",
        score=0.5,
    ) == [0.5]
    assert score(["<answer>7</answer>", "<think>a</think><answer>7</answer>"], think_tag=None) == [
        1.0,
        0.0,
    ]


def test_tag_names_are_escaped():
    pattern = format_pattern(think_tag="a.b")
    assert pattern.search("<a.b>x</a.b><answer>y</answer>")
    assert not pattern.search("<aXb>x</aXb><answer>y</answer>")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "anywhere"}, "unknown mode 'anywhere'.*full.*search"),
        ({"think_tag": "<think>"}, "think_tag must be a tag name"),
        ({"answer_tag": None}, "answer_tag must be a tag name"),
        ({"score": float("inf")}, "score must be a finite number"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(RewardConfigError, match=message):
        make_format_tags_reward(**options)
