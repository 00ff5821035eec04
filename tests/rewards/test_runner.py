import asyncio
import logging
import math

import pytest
import torch

from groupflow.rewards import (
    MissingRewardFieldError,
    RewardConfigError,
    RewardError,
    RewardFunction,
    RewardOutputError,
    RewardRunner,
    UnknownDataSourceError,
    register_data_source,
)
from groupflow.rewards import registry as reg

PROMPTS = ["p0", "p1", "p2", "p3"]
COMPLETIONS = ["1", "2", "bad", "4"]


def as_number(completions):
    return [float(c) for c in completions]  # raises ValueError on "bad"


def length(completions):
    return [len(c) for c in completions]


def test_weighted_sum_and_metrics():
    runner = RewardRunner(
        [
            RewardFunction("num", lambda completions: [1.0, 2.0, 3.0, 4.0], weight=0.5),
            RewardFunction("len", length, weight=2.0),
        ]
    )
    result = runner(PROMPTS, COMPLETIONS)
    # total = 0.5 * num + 2 * len = [0.5+2, 1+2, 1.5+6, 2+2]
    assert torch.allclose(result.total, torch.tensor([2.5, 3.0, 7.5, 4.0]))
    assert result.total.dtype == torch.float32 and result.total.shape == (4,)
    assert torch.equal(result.components["len"], torch.tensor([1.0, 1.0, 3.0, 1.0]))
    m = result.metrics
    assert m["reward/num/mean"] == pytest.approx(2.5)
    assert m["reward/num/std"] == pytest.approx(math.sqrt(1.25))  # population std
    assert m["reward/len/mean"] == pytest.approx(1.5)
    assert m["reward/num/failures"] == 0.0 and m["reward/len/failures"] == 0.0
    assert m["reward/total/mean"] == pytest.approx(4.25)
    assert m["reward/all_none"] == 0.0


def test_one_sample_raising_is_isolated_counted_and_logged_once(caplog):
    calls = []

    def counted(completions):
        calls.append(len(completions))
        return as_number(completions)

    runner = RewardRunner([RewardFunction("num", counted)], failure_value=-1.0)
    with caplog.at_level(logging.WARNING, logger="groupflow.rewards"):
        result = runner(PROMPTS, COMPLETIONS)
    assert calls == [4, 1, 1, 1, 1]  # batched, then once per sample
    assert result.total.tolist() == [1.0, 2.0, -1.0, 4.0]
    assert result.metrics["reward/num/failures"] == 1.0
    records = [r for r in caplog.records if r.name == "groupflow.rewards"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert "'num'" in message and "sample 2" in message
    assert "ValueError" in message and "could not convert string to float: 'bad'" in message


def test_first_failure_index_and_count_with_several_failures(caplog):
    runner = RewardRunner([RewardFunction("num", as_number)])
    with caplog.at_level(logging.WARNING, logger="groupflow.rewards"):
        result = runner(["a", "b", "c"], ["x", "1", "y"])
    assert result.total.tolist() == [0.0, 1.0, 0.0]
    assert result.metrics["reward/num/failures"] == 2.0
    assert len(caplog.records) == 1
    assert "2 of 3 samples" in caplog.records[0].getMessage()
    assert "sample 0" in caplog.records[0].getMessage()


def test_spec_failure_value_overrides_runner():
    runner = RewardRunner([RewardFunction("num", as_number, failure_value=-5.0)], failure_value=-1)
    assert runner(PROMPTS, COMPLETIONS).components["num"].tolist() == [1.0, 2.0, -5.0, 4.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_value_is_a_failure(bad, caplog):
    runner = RewardRunner([RewardFunction("r", lambda completions: [1.0, bad, 3.0, 4.0])])
    with caplog.at_level(logging.WARNING, logger="groupflow.rewards"):
        result = runner(PROMPTS, COMPLETIONS)
    assert result.total.tolist() == [1.0, 0.0, 3.0, 4.0]
    assert result.metrics["reward/r/failures"] == 1.0
    assert "sample 1" in caplog.records[0].getMessage()
    assert "non-finite" in caplog.records[0].getMessage()


def test_wrong_number_of_values_is_a_programming_error():
    runner = RewardRunner([RewardFunction("short", lambda completions: [1.0])])
    with pytest.raises(RewardOutputError, match="'short'.*returned 1 values for 4 completions"):
        runner(PROMPTS, COMPLETIONS)


def test_non_numeric_value_is_a_programming_error():
    runner = RewardRunner([RewardFunction("txt", lambda completions: ["yes"] * 4)])
    with pytest.raises(RewardOutputError, match="'txt'.*non-numeric value at position 0: 'yes'"):
        runner(PROMPTS, COMPLETIONS)


def test_all_samples_failing_raises_with_first_exception():
    def broken(completions):
        raise ZeroDivisionError("division by zero")

    runner = RewardRunner([RewardFunction("broken", broken), RewardFunction("len", length)])
    with pytest.raises(
        RewardError, match="'broken'.*every sample \\(4\\).*ZeroDivisionError"
    ) as info:
        runner(PROMPTS, COMPLETIONS)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_config_error_inside_reward_is_not_isolated():
    def misconfigured(completions):
        raise RewardConfigError("needs field 'answer'")

    runner = RewardRunner([RewardFunction("m", misconfigured)])
    with pytest.raises(RewardConfigError, match="needs field 'answer'"):
        runner(PROMPTS, COMPLETIONS)


def test_none_is_no_opinion(caplog):
    runner = RewardRunner(
        [
            RewardFunction("a", lambda completions: [1.0, None, None, 2.0], weight=2.0),
            RewardFunction("b", lambda completions: [0.5, 3.0, None, None]),
        ],
        failure_value=-1.0,
    )
    with caplog.at_level(logging.WARNING, logger="groupflow.rewards"):
        result = runner(PROMPTS, COMPLETIONS)
    # sample 0: 2*1 + 0.5; 1: only b; 2: nobody -> failure value; 3: only a.
    assert result.total.tolist() == [2.5, 3.0, -1.0, 4.0]
    assert math.isnan(result.components["a"][1].item())
    assert result.metrics["reward/all_none"] == 1.0
    assert result.metrics["reward/a/mean"] == pytest.approx(1.5)  # over the non-None values
    assert result.metrics["reward/a/failures"] == 0.0
    assert "1 of 4 samples got no reward" in caplog.records[0].getMessage()


def test_component_that_is_always_none_has_no_mean():
    runner = RewardRunner(
        [RewardFunction("none", lambda completions: [None] * 4), RewardFunction("len", length)]
    )
    result = runner(PROMPTS, COMPLETIONS)
    assert "reward/none/mean" not in result.metrics
    assert result.metrics["reward/none/failures"] == 0.0
    assert result.total.tolist() == [1.0, 1.0, 3.0, 1.0]


def test_async_function():
    async def judge(completions, ground_truth):
        await asyncio.sleep(0)
        return [float(c == g) for c, g in zip(completions, ground_truth)]

    runner = RewardRunner([RewardFunction("judge", judge)])
    result = runner(["a", "b"], ["x", "y"], ground_truth=["x", "z"])
    assert result.total.tolist() == [1.0, 0.0]


def test_async_function_when_loop_is_running():
    async def judge(completions):
        await asyncio.sleep(0)
        return [float(c) for c in completions]  # raises on "bad": per-sample fallback

    runner = RewardRunner([RewardFunction("judge", judge)])

    async def trainer_step():
        return runner(PROMPTS, COMPLETIONS)

    result = asyncio.run(trainer_step())
    assert result.total.tolist() == [1.0, 2.0, 0.0, 4.0]
    assert result.metrics["reward/judge/failures"] == 1.0


def test_signature_filtering_and_missing_field():
    def exact(completions, ground_truth):
        return [float(c == g) for c, g in zip(completions, ground_truth)]

    runner = RewardRunner([RewardFunction("exact", exact)])
    got = runner(["a", "b"], ["1", "2"], ground_truth=["1", "3"], data_source=["s", "s"])
    assert got.total.tolist() == [1.0, 0.0]
    with pytest.raises(MissingRewardFieldError, match="'exact'.*'ground_truth'.*'answer'"):
        runner(["a"], ["1"], answer=["1"])
    with pytest.raises(MissingRewardFieldError, match="'ground_truth'"):
        runner.check_fields(["answer"])


def test_field_length_mismatch():
    runner = RewardRunner([RewardFunction("len", length)])
    with pytest.raises(ValueError, match="field 'ground_truth' has 1 entries but there are 2"):
        runner(["a", "b"], ["1", "2"], ground_truth=["1"])
    with pytest.raises(ValueError, match="field 'prompts' has 1 entries"):
        runner(["a"], ["1", "2"])


def test_runner_construction_errors():
    with pytest.raises(RewardConfigError, match="at least one"):
        RewardRunner([])
    with pytest.raises(RewardConfigError, match="failure_value must be a finite number"):
        RewardRunner([RewardFunction("len", length)], failure_value=float("nan"))
    with pytest.raises(RewardConfigError, match="unique.*\\['x'\\]"):
        RewardRunner([RewardFunction("x", length), RewardFunction("x", length)])


def test_empty_batch():
    result = RewardRunner([RewardFunction("len", length)])([], [])
    assert result.total.shape == (0,) and result.metrics == {}


# ---------------------------------------------------------------------------- data_source mode


@pytest.fixture
def isolated_sources(monkeypatch):
    monkeypatch.setattr(reg, "_DATA_SOURCES", dict(reg._DATA_SOURCES))


def test_dispatch_by_data_source(isolated_sources):
    register_data_source("toy/echo", lambda completions: [0.25] * len(completions), name="echo")
    runner = RewardRunner.by_data_source(reg.data_source_rewards)
    result = runner(
        ["q"] * 4,
        ["#### 72", "\\boxed{\\frac{1}{2}}", "#### 5", "anything"],
        ground_truth=["72", "0.5", "6", "x"],
        data_source=["openai/gsm8k", "HuggingFaceH4/MATH-500", "openai/gsm8k", "toy/echo"],
    )
    assert result.total.tolist() == [1.0, 1.0, 0.0, 0.25]
    assert set(result.components) == {"gsm8k", "math_boxed", "echo"}
    assert result.components["gsm8k"][0].item() == 1.0
    assert math.isnan(result.components["gsm8k"][1].item())
    assert result.metrics["reward/gsm8k/mean"] == pytest.approx(0.5)
    assert result.metrics["reward/all_none"] == 0.0


def test_dispatch_shares_one_component_across_math_sources():
    runner = RewardRunner.by_data_source(reg.data_source_rewards)
    result = runner(
        ["q", "q"],
        ["\\boxed{3}", "\\boxed{4}"],
        ground_truth=["3", "3"],
        data_source=["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval"],
    )
    assert list(result.components) == ["math_boxed"]
    assert result.total.tolist() == [1.0, 0.0]


def test_dispatch_failure_isolation_reports_batch_index(caplog):
    runner = RewardRunner.by_data_source(reg.data_source_rewards)
    with caplog.at_level(logging.WARNING, logger="groupflow.rewards"):
        result = runner(
            ["q"] * 3,
            ["\\boxed{1}", "#### 1", "#### 2"],
            ground_truth=["1", "not a number", "2"],
            data_source=["lighteval/MATH", "openai/gsm8k", "openai/gsm8k"],
        )
    assert result.total.tolist() == [1.0, 0.0, 1.0]
    assert result.metrics["reward/gsm8k/failures"] == 1.0
    assert "sample 1" in caplog.records[0].getMessage()


def test_dispatch_unknown_source():
    runner = RewardRunner.by_data_source(reg.data_source_rewards)
    with pytest.raises(UnknownDataSourceError) as info:
        runner(
            ["q"] * 3,
            ["a"] * 3,
            ground_truth=["1"] * 3,
            data_source=["openai/gsm8k", "my/data", "other"],
        )
    message = str(info.value)
    assert "'my/data', 'other'" in message
    assert 'register_data_source("my/data", fn)' in message
    assert "openai/gsm8k" in message  # lists the known sources


def test_dispatch_without_data_source_field():
    runner = RewardRunner.by_data_source(reg.data_source_rewards)
    with pytest.raises(MissingRewardFieldError, match="no 'data_source' field"):
        runner(["q"], ["a"], ground_truth=["1"])


# ----- fields each dataset row must carry -------------------------------------------------------


def test_missing_fields_of_a_row_for_explicit_rewards():
    def exact(completions, answer, scale=1.0):
        return [scale * (c == a) for c, a in zip(completions, answer)]

    def lengths(completions, completion_lengths, ground_truth):  # lengths come from the trainer
        return [float(n) for n in completion_lengths]

    runner = RewardRunner([RewardFunction("exact", exact), RewardFunction("len", lengths)])
    assert runner.missing_fields({"answer": "1", "ground_truth": "2"}) == []
    assert runner.missing_fields({"answer": None}) == [
        ("answer", "reward 'exact' needs field 'answer', which this row lacks"),
        ("ground_truth", "reward 'len' needs field 'ground_truth', which this row lacks"),
    ]
    fixed = RewardRunner([RewardFunction("exact", exact, options={"answer": "7"})])
    assert fixed.missing_fields({}) == []  # a fixed option is not a dataset field


def test_missing_fields_of_a_row_chosen_by_data_source():
    runner = reg.build_reward_runner(None)
    assert runner.missing_fields({"data_source": "groupflow/reverse", "answer": "12"}) == []
    assert runner.missing_fields({"data_source": "groupflow/reverse"}) == [
        ("answer", "reward 'reverse' needs field 'answer', which this row lacks")
    ]
    assert runner.missing_fields({"data_source": "openai/gsm8k", "answer": "#### 3"}) == []
    assert runner.missing_fields({"data_source": "openai/gsm8k", "ground_truth": None}) == [
        (
            "ground_truth",
            "reward 'gsm8k' needs field 'ground_truth or answer', which this row lacks",
        )
    ]
    assert runner.missing_fields({"prompt_id": 3})[0][0] == "data_source"
    with pytest.raises(UnknownDataSourceError, match="'nope'"):
        runner.missing_fields({"data_source": "nope"})


def test_a_failed_score_says_why_in_the_log_and_in_the_error_when_every_sample_fails(caplog):
    import logging
    import pickle

    from groupflow.rewards import FailedScore, RewardError

    def picky(completions, **_):
        return [1.0 if c == "ok" else FailedScore(f"cannot score {c!r}") for c in completions]

    runner = RewardRunner([RewardFunction("picky", picky)], failure_value=-1.0)
    with caplog.at_level(logging.WARNING, logger="groupflow.rewards"):
        assert runner(["p", "p"], ["ok", "bad"]).total.tolist() == [1.0, -1.0]
    assert "cannot score 'bad'" in caplog.text
    with pytest.raises(RewardError, match="ValueError: cannot score 'x'"):
        runner(["p"], ["x"])
    again = pickle.loads(pickle.dumps(FailedScore("why")))
    assert again.reason == "why" and math.isnan(again)


def test_a_rewards_own_counters_are_logged_under_its_name():
    counts = {"n": 0}

    def counting(completions, **_):
        counts["n"] += len(completions)
        return [0.0] * len(completions)

    counting.take_metrics = lambda: {"seen": counts["n"]}
    result = RewardRunner([RewardFunction("c", counting)])(["p"] * 3, ["a"] * 3)
    assert result.metrics["reward/c/seen"] == 3.0
    counting.take_metrics = lambda: {"seen": "three"}
    with pytest.raises(RewardOutputError, match="take_metrics"):
        RewardRunner([RewardFunction("c", counting)])(["p"], ["a"])


# ----- normalize: group, shares and monitors -----------------------------------------------------


def _wide_and_narrow(**kw):
    return RewardRunner(
        [
            RewardFunction("wide", lambda completions: [1.0, 3.0, 10.0, 10.0]),
            RewardFunction("narrow", lambda completions: [0.1, 0.0, 0.0, 0.2]),
            RewardFunction("held_out", lambda completions: [5.0, 0.0, 0.0, 5.0], monitor=True),
        ],
        **kw,
    )


def test_group_normalised_runner_totals_shares_and_monitor():
    r = 1 / math.sqrt(2)
    runner = _wide_and_narrow(normalize="group", normalize_eps=0.0)
    result = runner(PROMPTS, COMPLETIONS, group_ids=[0, 0, 1, 1])
    # wide: z [-r, r, 0, 0]; narrow: z [r, -r, -r, r]; the monitor is not in the sum
    assert torch.allclose(result.total, torch.tensor([0.0, 0.0, -r, r]), atol=1e-6)
    assert result.metrics["reward/wide/share"] == pytest.approx(1 / 3)
    assert result.metrics["reward/narrow/share"] == pytest.approx(2 / 3)
    assert "reward/held_out/share" not in result.metrics
    assert result.metrics["reward/held_out/mean"] == pytest.approx(2.5)  # logged all the same
    assert result.weights == {"wide": 1.0, "narrow": 1.0}
    # without groups (validation): the plain weighted sum, monitor still left out
    plain = runner(PROMPTS, COMPLETIONS)
    assert torch.allclose(plain.total, torch.tensor([1.1, 3.0, 10.0, 10.2]))
    assert not any(k.endswith("/share") for k in plain.metrics)
    # group_ids never reach the reward functions
    seen = []
    spy = RewardRunner([RewardFunction("spy", lambda completions, **kw: seen.append(kw) or [0.0])])
    spy(["p"], ["c"], group_ids=[0])
    assert seen == [{"prompts": ["p"]}]


def test_weighted_sum_runner_logs_shares_with_groups():
    result = _wide_and_narrow()(PROMPTS, COMPLETIONS, group_ids=torch.tensor([0, 0, 1, 1]))
    assert torch.allclose(result.total, torch.tensor([1.1, 3.0, 10.0, 10.2]))
    assert result.metrics["reward/wide/share"] == pytest.approx(0.5 / 0.575)


def test_normalize_and_monitor_bad_input():
    only = [RewardFunction("m", length, monitor=True)]
    with pytest.raises(RewardConfigError, match="every reward .* is a monitor"):
        RewardRunner(only)
    with pytest.raises(RewardConfigError, match="normalize must be one of"):
        RewardRunner([RewardFunction("n", length)], normalize="batch")
    with pytest.raises(RewardConfigError, match="normalize_eps must be a finite number >= 0"):
        RewardRunner([RewardFunction("n", length)], normalize_eps=-1)
    with pytest.raises(RewardConfigError, match="monitor must be true or false"):
        RewardFunction("n", length, monitor="yes")
    with pytest.raises(ValueError, match="group_ids has 3 entries but there are 4 completions"):
        _wide_and_narrow()(PROMPTS, COMPLETIONS, group_ids=[0, 0, 1])


def test_monitor_and_normalize_from_config_specs():
    runner = reg.build_reward_runner(
        [{"name": "format_tags"},
         {"function": "tests.rewards.test_runner:length", "monitor": True}],
        normalize="group",
    )  # fmt: skip
    assert runner.normalize == "group"
    assert [s.monitor for s in runner.specs] == [False, True]
