import io
import logging
import time

import pytest

from groupflow.utils.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "groupflow"]


def test_off_a_terminal_a_line_every_interval(caplog):
    caplog.set_level(logging.INFO, logger="groupflow")
    clock, stream = Clock(), io.StringIO()
    with Progress("eval (greedy)", 32, stream=stream, heartbeat_s=None, clock=clock) as p:
        p.update(16, tokens=800, correct=4, scored=16)
        assert _lines(caplog) == []  # less than interval_s (30 s) since the start
        clock.now = 40.0
        p.update(8, tokens=400, correct=2, scored=8)
        assert _lines(caplog) == ["eval (greedy): 24/32 prompts, 30 tokens/s, acc 25.0%, 40 s"]
        clock.now = 50.0
        p.update(8)
        assert len(_lines(caplog)) == 1
    # the end of a task that logged anything is logged too
    assert _lines(caplog)[-1] == "eval (greedy): 32/32 prompts, 24 tokens/s, acc 25.0%, 50 s"
    assert stream.getvalue() == ""  # no bar drawn into a log file


def test_a_short_task_off_a_terminal_stays_quiet(caplog):
    caplog.set_level(logging.INFO, logger="groupflow")
    with Progress("validation (greedy)", 4, stream=io.StringIO(), heartbeat_s=None) as p:
        p.update(4, tokens=10, correct=1, scored=4)
    assert _lines(caplog) == []


def test_on_a_terminal_a_bar(caplog):
    caplog.set_level(logging.INFO, logger="groupflow")
    tty = Terminal()
    with Progress("eval (greedy)", 32, stream=tty, heartbeat_s=None, interval_s=0) as p:
        p.update(16, tokens=800, correct=4, scored=16)
        p.write('{"completion": "x"}', tty)
    drawn = tty.getvalue()
    assert "eval (greedy)" in drawn and "32/32" not in drawn and "16/32" in drawn
    assert "acc=25.0%" in drawn and "tokens/s=" in drawn and '{"completion": "x"}' in drawn
    assert _lines(caplog) == []  # the bar replaces the log lines


def test_the_heartbeat_reports_a_long_silent_stage(caplog):
    caplog.set_level(logging.INFO, logger="groupflow")
    stream = io.StringIO()
    with Progress("convert-gguf", 4, "stages", stream=stream, interval_s=0, heartbeat_s=0.01) as p:
        p.stage("reading the weights")  # logs the first line
        deadline = time.monotonic() + 10
        while len(_lines(caplog)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # nothing is updated: only the heartbeat can log more
    assert _lines(caplog)[1].startswith("convert-gguf: 0/4 stages, stage reading the weights, ")


@pytest.mark.parametrize("seconds, text", [(5, "5 s"), (125, "2 min 05 s"), (3725, "1 h 02 min")])
def test_elapsed_time_format(seconds, text):
    clock = Clock()
    p = Progress("x", None, "steps", stream=io.StringIO(), heartbeat_s=None, clock=clock)
    clock.now = seconds
    p.update(3, loss="0.5")
    assert p.line() == f"x: 3 steps, loss 0.5, {text}"
    p.close()
