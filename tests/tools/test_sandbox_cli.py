"""A run that would execute model-written code refuses to start where no isolating sandbox
works: the CLI names the tool or reward and says what to install (exit 2, no traceback)."""

import pytest
import yaml

from groupflow.cli import main
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
