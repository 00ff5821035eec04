"""Reward time limits: a hanging sync or async reward costs its samples, never the run's progress.

Every "hang" here waits on an Event that the test sets at the end, so no thread outlives its test;
the time limits are a few tenths of a second, and each test checks that the step came back within
about twice the limit (batched call + per-sample retries).
"""

import asyncio
import threading
import time

import pytest

from groupflow.rewards import RewardError, RewardFunction, RewardRunner
from groupflow.rewards.calls import MAX_ABANDONED, TIMED_OUT, CallGuard

LIMIT = 0.3
COMPLETIONS = ["a", "b", "hang", "d"]
PROMPTS = ["p"] * 4


@pytest.fixture
def release():
    """An Event every hanging reward waits on; set when the test ends."""
    event = threading.Event()
    yield event
    event.set()


def _timed(runner, completions=COMPLETIONS):
    start = time.monotonic()
    result = runner(PROMPTS[: len(completions)], completions)
    return result, time.monotonic() - start


def test_a_sync_reward_hanging_on_one_sample_times_out_and_the_step_goes_on(release, caplog):
    def score(completions):
        if "hang" in completions:
            release.wait(30)
        return [float(len(c)) for c in completions]

    runner = RewardRunner([RewardFunction("len", score)], failure_value=-1.0, timeout_s=LIMIT)
    result, seconds = _timed(runner)
    # batched call timed out; the per-sample retries ran in order: "d" never got its turn
    assert result.total.tolist() == [1.0, 1.0, -1.0, -1.0]
    assert result.metrics["reward/len/timeouts"] == 2.0
    assert result.metrics["reward/len/failures"] == 2.0
    assert seconds < 2 * LIMIT + 2.0
    assert "reward 'len' failed on 2 of 4 samples (2 timed out" in caplog.text
    assert "no value within reward.timeout_s=0.3 s" in caplog.text
    assert "still running in background threads (len)" in caplog.text
    assert runner.guard.abandoned() == ["len", "len"]  # the batched call and the retry loop
    release.set()
    time.sleep(0.2)
    assert runner.guard.abandoned() == []


def test_an_async_reward_hanging_on_one_sample_is_cancelled_and_isolated(release):
    cancelled = []

    async def judge(completions):
        try:
            if "hang" in completions:
                await asyncio.sleep(30)
            return [float(len(c)) for c in completions]
        except asyncio.CancelledError:
            cancelled.append(list(completions))
            raise

    runner = RewardRunner([RewardFunction("judge", judge)], failure_value=-1.0, timeout_s=LIMIT)
    result, seconds = _timed(runner)
    assert result.total.tolist() == [1.0, 1.0, -1.0, 1.0]  # only the hanging sample
    assert result.metrics["reward/judge/timeouts"] == 1.0
    assert cancelled == [COMPLETIONS, ["hang"]]  # the batched call, then the one sample
    assert runner.guard.abandoned() == []  # cancelled: nothing left running
    assert seconds < 2 * LIMIT + 2.0


def test_every_sample_timing_out_stops_with_a_clear_error(release):
    def stuck(completions):
        release.wait(30)
        return [0.0] * len(completions)

    runner = RewardRunner([RewardFunction("stuck", stuck)], timeout_s=LIMIT)
    with pytest.raises(RewardError, match=r"'stuck' .* timed out on every sample \(2\).*timeout_s"):
        _timed(runner, ["x", "y"])


def test_abandoned_sync_calls_piling_up_stop_the_run(release):
    def sometimes_stuck(completions):
        if "hang" in completions:
            release.wait(30)
        return [0.0] * len(completions)

    runner = RewardRunner([RewardFunction("slow", sometimes_stuck)], timeout_s=0.1)
    for _ in range(MAX_ABANDONED // 2 - 1):  # each step leaves two calls behind
        runner(PROMPTS, COMPLETIONS)
    with pytest.raises(
        RewardError, match=rf"{MAX_ABANDONED} timed-out calls .*'slow'.* still running"
    ):
        runner(PROMPTS, COMPLETIONS)


def test_a_users_own_timeout_error_is_a_failure_not_a_timeout():
    def flaky(completions):
        if len(completions) > 1 or completions[0] == "hang":
            raise TimeoutError("judge API timed out")
        return [1.0]

    runner = RewardRunner([RewardFunction("flaky", flaky)], timeout_s=LIMIT)
    result = runner(PROMPTS, COMPLETIONS)
    assert result.metrics["reward/flaky/failures"] == 1.0
    assert result.metrics["reward/flaky/timeouts"] == 0.0


def test_without_a_limit_calls_run_in_the_callers_thread():
    threads = []

    def where(completions):
        threads.append(threading.current_thread())
        return [0.0] * len(completions)

    RewardRunner([RewardFunction("w", where)], timeout_s=None)(["p"], ["c"])
    RewardRunner([RewardFunction("w", where)], timeout_s=5)(["p"], ["c"])
    assert threads[0] is threading.current_thread() and threads[1] is not threads[0]


@pytest.mark.parametrize("bad", [0, -1.0, True, "5"])
def test_bad_time_limits_are_rejected(bad):
    with pytest.raises(ValueError, match="timeout_s must be a positive number or None"):
        CallGuard(bad)


def test_guard_results_keep_values_exceptions_and_timeouts_apart(release):
    guard = CallGuard(LIMIT)
    boom = ValueError("boom")

    def raise_boom():
        raise boom

    assert guard.per_sample(
        "r", [lambda: 1.0, raise_boom, lambda: release.wait(30), lambda: 2.0]
    ) == [
        1.0,
        boom,
        TIMED_OUT,
        TIMED_OUT,
    ]
    assert guard.batched("r", lambda: 3) == 3 and guard.batched("r", raise_boom) is boom
