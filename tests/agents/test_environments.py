"""Environments: the tool environment's answers and counters, and containment of user code that
raises, hangs or returns garbage (a failure is reported, never raised)."""

from __future__ import annotations

import asyncio
import importlib
import time

import pytest

from groupflow.agents import calls
from groupflow.agents.environments import (
    ToolEnvironment,
    normalize_observation,
    reset_env,
    step_env,
)
from groupflow.agents.parsers import build_parser
from groupflow.agents.tools import build_tools
from groupflow.utils.daemon_calls import Abandoned


@pytest.fixture
def helpers(helpers_on_path):
    return importlib.import_module("agent_helpers")


def _tool_env(helpers, **kw):
    tools = build_tools(
        [{"name": "calculator"}, {"function": "agent_helpers:slow_tool", "timeout_s": 0.2},
         {"function": "agent_helpers:failing_tool"}],
    )  # fmt: skip
    return ToolEnvironment(tools, build_parser("hermes"), **kw)


def _call(name, **args):
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def test_tool_environment_answers_each_call(helpers):
    env = _tool_env(helpers)
    obs, reward, done = asyncio.run(env.step("x " + _call("calculator", expression="6*7") + _call("calculator", expression="1/0")))  # fmt: skip
    assert (reward, done) == (0.0, False)
    assert [m["content"] for m in obs] == ["42", "Error: ZeroDivisionError: division by zero"]
    assert all(m["role"] == "tool" and m["name"] == "calculator" for m in obs)
    assert env.stats == {
        "tool_calls": 2,
        "tool_errors": 1,
        "tool_timeouts": 0,
        "bad_calls": 0,
        "sandbox_failures": 0,
    }
    obs, reward, done = asyncio.run(env.step("The answer is 42."))
    assert obs is None and done


def test_tool_timeout_error_and_bad_calls_are_observations(helpers):
    env = _tool_env(helpers, max_calls_per_turn=3)
    start = time.perf_counter()
    text = (_call("slow_tool", seconds=5) + _call("failing_tool", x="a") + _call("nope")
            + _call("calculator", expr="1") + "<tool_call>{oops</tool_call>")  # fmt: skip
    obs, _, done = asyncio.run(env.step(text))
    assert time.perf_counter() - start < 2  # the 5 s tool was abandoned at 0.2 s
    contents = [m["content"] for m in obs]
    assert contents[0].startswith("Error: the tool call is not valid JSON")
    assert contents[1].startswith("Error: at most 3 tool calls per turn")
    assert contents[2] == "Error: slow_tool timed out after 0.2 s"
    assert contents[3] == "Error: RuntimeError: cannot handle a"
    assert contents[4].startswith("Error: unknown tool 'nope'; available: ")
    assert not done
    assert env.stats == {
        "tool_calls": 3,
        "tool_errors": 1,
        "tool_timeouts": 1,
        "bad_calls": 2,
        "sandbox_failures": 0,
    }
    obs, _, _ = asyncio.run(env.step(_call("calculator", expr="1")))
    assert "unknown argument(s) ['expr']" in obs[0]["content"]


def test_an_unprintable_result_and_a_call_nested_too_deeply_are_the_tools_failures(helpers):
    tools = build_tools([{"function": "agent_helpers:unprintable_tool"}])
    env = ToolEnvironment(tools, build_parser("hermes"))
    text = _call("unprintable_tool", x="a") + "<tool_call>" + "[" * 100_000 + "</tool_call>"
    result = asyncio.run(step_env(env, text, timeout_s=5))
    assert result.failure is None and not result.done  # the sample goes on
    assert [m["content"] for m in result.observation] == [
        "Error: the tool call is not valid JSON (nested too deeply)",
        "Error: unprintable_tool returned a _Unprintable that cannot be shown as text "
        "(RuntimeError)",
    ]
    assert env.stats == {
        "tool_calls": 1,
        "tool_errors": 1,
        "tool_timeouts": 0,
        "bad_calls": 1,
        "sandbox_failures": 0,
    }


def test_user_environment_async_and_sync(helpers):
    env = helpers.AsyncEchoEnv()
    r = asyncio.run(reset_env(env, {"prompt": "p"}, 1.0))
    assert r.observation == [{"role": "user", "content": "start p"}] and r.failure is None
    r = asyncio.run(step_env(env, "abc", 1.0))
    assert (r.observation[0]["content"], r.reward, r.done) == ("echo 3", 0.5, False)
    env = helpers.CountdownEnv(turns=1)
    asyncio.run(reset_env(env, {"prompt": "p", "target": "x"}, 1.0))
    r = asyncio.run(step_env(env, "x!", 1.0))
    assert (r.observation[0]["content"], r.reward, r.done) == ("left 0", 1.0, True)


@pytest.mark.parametrize(
    "name, kind, message",
    [("RaisingEnv", "error", "RaisingEnv.step: KeyError: 'the simulator crashed'"),
     ("HangingEnv", "timeout", "HangingEnv.step timed out after 0.2 s"),
     ("GarbageEnv", "invalid", "GarbageEnv.step must return (observation, reward, done)")],
)  # fmt: skip
def test_failing_environments_are_reported_not_raised(helpers, name, kind, message):
    env = getattr(helpers, name)()
    start = time.perf_counter()
    r = asyncio.run(step_env(env, "text", 0.2))
    assert time.perf_counter() - start < 2
    assert r.done and r.failure_kind == kind and r.failure.startswith(message)


def test_tools_and_environments_that_exit_or_interrupt_fail_their_sample_only(helpers):
    tools = build_tools(
        [
            {"function": "agent_helpers:exiting_tool"},
            {"function": "agent_helpers:interrupting_tool"},
        ]
    )
    env = ToolEnvironment(tools, build_parser("hermes"))
    obs, _, done = asyncio.run(
        env.step(_call("exiting_tool", x="--help") + _call("interrupting_tool", x="a"))
    )
    assert [m["content"] for m in obs] == ["Error: SystemExit: 2", "Error: KeyboardInterrupt"]
    assert not done and env.stats["tool_errors"] == 2
    r = asyncio.run(step_env(helpers.ExitingEnv(), "text", 1.0))
    assert (r.done, r.failure_kind, r.failure) == (True, "error", "ExitingEnv.step: SystemExit: 0")
    r = asyncio.run(reset_env(helpers.InterruptingEnv(), {"prompt": "p"}, 1.0))
    assert r.failure == "InterruptingEnv.reset: KeyboardInterrupt" and r.failure_kind == "error"


def test_the_tool_environments_reset_runs_no_thread_and_hung_calls_stop_the_run(
    helpers, monkeypatch
):
    tools = build_tools([{"function": "agent_helpers:hang_tool", "label": "calc",
                          "timeout_s": 0.02}])  # fmt: skip
    env = ToolEnvironment(tools, build_parser("hermes"))
    monkeypatch.setattr(calls, "_abandoned", Abandoned())  # not those of earlier tests
    monkeypatch.setattr(calls, "MAX_ABANDONED", 2)
    try:
        text = _call("calc", expression="99*99")
        for _ in range(2):  # each call is abandoned: the model reads a timeout
            obs, _, _ = asyncio.run(env.step(text))
            assert obs[0]["content"] == "Error: calc timed out after 0.02 s"
        assert env.stats["tool_timeouts"] == 2
        with pytest.raises(calls.StuckCallsError, match=r"2 timed-out calls .*tool 'calc' \(2\)"):
            asyncio.run(env.step(text))
        with pytest.raises(calls.StuckCallsError):  # a user environment's calls stop too
            asyncio.run(step_env(helpers.CountdownEnv(), "text", 1.0))
        # the tool environment's reset is a no-op that needs no thread (none could start here)
        monkeypatch.setattr(calls, "MAX_ABANDONED", 10**6)
        monkeypatch.setattr(calls, "start_daemon", None)
        r = asyncio.run(reset_env(ToolEnvironment(tools, build_parser("hermes")), {}, 0.01))
        assert r.failure is None and r.observation is None
    finally:
        helpers.RELEASE.set()
    deadline = time.monotonic() + 5
    while calls.abandoned_calls() and time.monotonic() < deadline:
        time.sleep(0.01)
    helpers.RELEASE.clear()


def test_bad_step_values(helpers):
    class NanReward:
        def step(self, text):
            return ("ok", float("nan"), False)

    class BadObservation:
        def step(self, text):
            return (42, 0.0, False)

    assert "reward must be finite" in asyncio.run(step_env(NanReward(), "t", 1)).failure
    assert "observation must be text" in asyncio.run(step_env(BadObservation(), "t", 1)).failure


def test_normalize_observation():
    assert normalize_observation(None) is None and normalize_observation("") is None
    assert normalize_observation("hi") == [{"role": "user", "content": "hi"}]
    assert normalize_observation({"role": "tool", "content": "1"}) == [
        {"role": "tool", "content": "1"}
    ]
    with pytest.raises(ValueError, match="'role' and 'content'"):
        normalize_observation([{"role": "tool", "content": 3}])
