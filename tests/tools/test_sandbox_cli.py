"""A run that would execute model-written code refuses to start where no isolating sandbox
works: the CLI names the tool or reward and says what to install (exit 2, no traceback)."""

import pytest
import yaml

from groupflow.cli.commands import main
from groupflow.rewards import RewardConfigError
from groupflow.rewards.code import make_code_tests_reward
from groupflow.tools import sandbox
from groupflow.tools.sandbox import bwrap


@pytest.fixture
def no_bubblewrap(monkeypatch):
    monkeypatch.setattr(bwrap, "bwrap_path", lambda: None)
    monkeypatch.setattr(sandbox, "_resolved", {})
    monkeypatch.delenv("GROUPFLOW_SANDBOX", raising=False)


def _config(tmp_path, tiny_config_data) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config_data(run__total_steps=1)))
    return str(path)


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_code_reward_refuses_to_build(no_bubblewrap, monkeypatch):
    with pytest.raises(RewardConfigError, match="code_tests: the code sandbox needs bubblewrap"):
        make_code_tests_reward()
    monkeypatch.setenv("GROUPFLOW_SANDBOX", "guard")  # the machine-wide opt-in
    assert make_code_tests_reward()(
        completions=["print(2)"], tests=[{"inputs": [""], "outputs": ["2"]}]
    ) == [1.0]


def test_cli_run_with_a_code_reward_refuses_to_start(
    no_bubblewrap, tmp_path, capsys, tiny_config_data
):
    config = _config(tmp_path, tiny_config_data)
    err = _error(capsys, ["train", config, "reward.functions=[{name: code_tests}]", "--no-plot"])
    assert "code_tests" in err and "apt-get install bubblewrap" in err
    assert "sandbox: guard" in err  # the opt-in is named, with its caveat


def test_cli_run_with_the_python_tool_refuses_to_start(
    no_bubblewrap, tmp_path, capsys, tiny_config_data
):
    config = _config(tmp_path, tiny_config_data)
    argv = ["train", config, "rollout.max_turns=2", "rollout.tools=[{name: python}]", "--no-plot"]
    err = _error(capsys, argv)
    assert "rollout.tools[0]" in err and "apt-get install bubblewrap" in err


# What the process sees of bubblewrap: none on PATH, or one the kernel refuses namespaces to.
_REFUSING_BWRAP = "#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n"
_PROBE = r"""
import json, sys
from groupflow.rewards import build_reward_runner, make_code_tests_reward, RewardConfigError
runner = build_reward_runner(None)  # rewards by data_source, as the demos use
scores = runner(["abc"], ["cba"], data_source=["groupflow/reverse"], answer=["cba"])
try:
    make_code_tests_reward()
    refused = ""
except RewardConfigError as exc:
    refused = str(exc)
print(json.dumps({"reverse": scores.total.tolist(), "refused": refused}))
"""


@pytest.mark.parametrize("bubblewrap", ["missing", "refuses namespaces"])
def test_a_run_that_runs_no_code_never_needs_the_sandbox(tmp_path, bubblewrap):
    """Importing the rewards and scoring a run that executes no model code works without a
    working bubblewrap; the code reward alone refuses, naming every remedy."""
    import json
    import os
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if bubblewrap != "missing":
        fake = bin_dir / "bwrap"
        fake.write_text(_REFUSING_BWRAP)
        fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "GROUPFLOW_SANDBOX"}
    env["PATH"] = str(bin_dir)
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["reverse"] == [1.0]
    refused = out["refused"]
    assert refused.startswith("code_tests: ")
    if bubblewrap == "missing":
        assert "needs bubblewrap (bwrap)" in refused
    else:
        assert "No permissions to create new namespace" in refused
    # one message, three remedies: install bubblewrap, a sandbox service, the guard for this run
    assert "apt-get install bubblewrap" in refused
    assert "backend: remote" in refused
    assert "sandbox: guard" in refused and "not a security boundary" in refused
