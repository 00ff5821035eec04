import pytest

from groupflow.utils.timing import StageTimer, throughput


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_stages_accumulate_and_nest():
    clock = FakeClock()
    timer = StageTimer(clock=clock)
    with timer("step"):
        with timer("rollout"):
            clock.now += 2.0
        with timer("update"):
            clock.now += 0.5
        with timer("rollout"):  # a second rollout in the same step adds up
            clock.now += 1.0
    assert timer.metrics() == {"time/step": 3.5, "time/rollout": 3.0, "time/update": 0.5}
    assert timer.seconds("rollout") == 3.0
    timer.reset()
    assert timer.metrics() == {}


def test_time_is_recorded_when_the_stage_raises():
    clock = FakeClock()
    timer = StageTimer(prefix="t/", clock=clock)
    with pytest.raises(RuntimeError), timer("reward"):
        clock.now += 0.25
        raise RuntimeError("boom")
    assert timer.metrics() == {"t/reward": 0.25}
    with timer("reward"):  # the stage is usable again after the exception
        clock.now += 0.25
    assert timer.metrics() == {"t/reward": 0.5}


def test_sync_runs_at_both_edges():
    calls = []
    timer = StageTimer(clock=FakeClock(), sync=lambda: calls.append("sync"))
    with timer("x"):
        calls.append("body")
    assert calls == ["sync", "body", "sync"]


def test_bad_use_is_an_error():
    timer = StageTimer(clock=FakeClock())
    with pytest.raises(ValueError, match="already being timed"), timer("a"), timer("a"):
        pass
    with pytest.raises(ValueError, match="non-empty string"), timer(""):
        pass
    with pytest.raises(KeyError, match="'nope' has not been timed"):
        timer.seconds("nope")
    with timer("a"), pytest.raises(RuntimeError, match="cannot reset"):
        timer.reset()


def test_throughput():
    assert throughput(300, 1.5) == 200.0
    assert throughput(0, 2.0) == 0.0
    with pytest.raises(ValueError, match="seconds must be > 0"):
        throughput(10, 0.0)
    with pytest.raises(ValueError, match="count must be >= 0"):
        throughput(-1, 1.0)
    clock = FakeClock()
    timer = StageTimer(clock=clock)
    with timer("rollout"):
        clock.now += 4.0
    assert timer.throughput("rollout", 1000, "tokens") == {"perf/rollout_tokens_per_s": 250.0}
