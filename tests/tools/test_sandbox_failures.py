"""A sandbox that fails after its first probe (bubblewrap refusing a mount, say) is its own kind of
failure: a SandboxError, never the program's output; the code reward counts it in
reward/<name>/sandbox_failures and gives no score for the program; the python tool's call fails;
MAX_CONSECUTIVE_FAILURES in a row stop the run with a named error."""

import logging

import pytest

from groupflow.rewards import RewardError, RewardFunction, RewardRunner
from groupflow.rewards.code import CodeSandboxError, make_code_tests_reward
from groupflow.tools import python_tool, run_python
from groupflow.tools import sandbox as sandbox_module
from groupflow.tools.sandbox import SandboxBroken, SandboxError
from groupflow.tools.sandbox.bwrap import BwrapSandbox, bwrap_path, machine_setup

BWRAP_ERROR = "bwrap: Can't mount tmpfs on /newroot/sandbox: No space left on device"


@pytest.fixture
def flaky(tmp_path):
    """A bubblewrap that works until ``broken`` exists, then fails as a real one does."""
    real = bwrap_path()
    if real is None:
        pytest.skip("needs bubblewrap")
    broken = tmp_path / "broken"
    script = tmp_path / "bwrap"
    script.write_text(
        f"#!/bin/sh\nif [ -e {broken} ]; then echo {BWRAP_ERROR!r} >&2; exit 1; fi\n"
        f'exec {real} "$@"\n'
    )
    script.chmod(0o755)
    backend = BwrapSandbox(str(script), machine_setup(real))
    backend.broken = broken
    return backend


def test_a_failing_sandbox_is_an_error_never_the_programs_output(flaky):
    assert run_python("print(1)", sandbox=flaky).stdout == "1\n"
    flaky.broken.touch()
    with pytest.raises(SandboxError, match="No space left on device"):
        run_python("print(1)", sandbox=flaky)
    assert sandbox_module.sandbox_failures() == 1


def test_the_code_reward_counts_sandbox_failures_and_scores_no_program(flaky, caplog):
    tests = [{"inputs": ["1 2"], "outputs": ["3"]}]
    solution = "a, b = map(int, input().split())\nprint(a + b)"
    fn = make_code_tests_reward(sandbox=flaky, max_workers=1)
    runner = RewardRunner([RewardFunction("code_tests", fn)], failure_value=-1.0)
    result = runner(["p"] * 2, [solution, "print(0)"], tests=tests * 2)
    assert result.total.tolist() == [1.0, 0.0]
    assert result.metrics["reward/code_tests/sandbox_failures"] == 0.0
    flaky.broken.touch()
    with caplog.at_level(logging.WARNING):
        # the correct solution gets no score (failure_value, counted), not 0.0; the empty
        # completion needs no sandbox and scores 0 as before
        result = runner(["p"] * 2, [solution, ""], tests=tests * 2)
    assert result.total.tolist() == [-1.0, 0.0]
    assert result.metrics["reward/code_tests/sandbox_failures"] == 1.0
    assert result.metrics["reward/code_tests/failures"] == 1.0
    assert "code sandbox failed: bubblewrap failed to run the code" in caplog.text
    assert "No space left on device" in caplog.text
    with pytest.raises(RewardError, match="code sandbox failed: bubblewrap failed"):
        runner(["p"], [solution], tests=tests)  # every sample: the error names the cause


def test_a_broken_sandbox_stops_the_run_with_a_named_error(flaky):
    tests = [{"inputs": [""], "outputs": ["1"]}]
    fn = make_code_tests_reward(sandbox=flaky, max_workers=1)
    flaky.broken.touch()
    runner = RewardRunner([RewardFunction("code_tests", fn)], failure_value=-1.0)
    n = sandbox_module.MAX_CONSECUTIVE_FAILURES
    with pytest.raises(CodeSandboxError, match=f"failed on the last {n} runs in a row"):
        for _ in range(n):  # an empty completion keeps the batch from failing on every sample
            runner(["p"] * 2, ["print(1)", ""], tests=tests * 2)


def test_the_python_tool_fails_its_call_and_a_broken_sandbox_stops_it(flaky):
    tool = python_tool(sandbox=flaky)
    assert tool("print(2)") == "2"
    flaky.broken.touch()
    with pytest.raises(SandboxError):
        tool("print(2)")
    with pytest.raises(SandboxBroken):
        for _ in range(sandbox_module.MAX_CONSECUTIVE_FAILURES):
            try:
                tool("print(2)")
            except SandboxError:
                continue
