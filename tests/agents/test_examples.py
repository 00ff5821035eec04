"""The example tool, environment and workflow files under examples/ work as their docstrings say."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from groupflow.agents.environments import ToolEnvironment, step_env
from groupflow.agents.parsers import build_parser
from groupflow.agents.tools import build_tools
from groupflow.utils.imports import resolve_import_path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_constants_tool_described_bound_and_failing_cleanly():
    path = str(EXAMPLES / "agents" / "constants_tool.py")
    plain, si = build_tools(
        [{"function": f"{path}:lookup_constant"},
         {"function": f"{path}:lookup_constant", "label": "constant_si", "kwargs": {"units": "SI"}}]
    )  # fmt: skip
    assert set(plain.parameters) == {"name", "units"} and plain.required == ["name"]
    assert set(si.parameters) == {"name"} and si.schema["function"]["name"] == "constant_si"
    env = ToolEnvironment([plain, si], build_parser("hermes"))
    text = ('<tool_call>{"name": "constant_si", "arguments": {"name": "Speed of light"}}</tool_call>'
            '<tool_call>{"name": "lookup_constant", "arguments": {"name": "dark energy"}}</tool_call>')  # fmt: skip
    obs, _, done = asyncio.run(env.step(text))
    assert [m["content"] for m in obs] == [
        "2.99792e+08 m/s",
        "Error: KeyError: \"unknown constant 'dark energy'; known: ['avogadro constant', "
        "'boltzmann constant', 'elementary charge', 'gravitational constant', 'planck constant', "
        "'speed of light']\"",
    ]
    assert not done and env.stats["tool_errors"] == 1


def test_guess_number_environment_plays_a_game():
    cls = resolve_import_path(f"{EXAMPLES / 'agents' / 'guess_number.py'}:GuessNumber", "env")
    env = cls(max_guesses=3)
    assert env.reset({"secret": 42, "prompt": "p"}) == "guess 1-100:"
    steps = [asyncio.run(step_env(env, text, 1.0)) for text in ("50", "hmm", "42")]
    assert [(s.observation, s.reward, s.done) for s in steps] == [
        ([{"role": "user", "content": "lower:"}], 0.0, False),
        ([{"role": "user", "content": "say a number:"}], 0.0, False),
        (None, 1.0, True),
    ]


@pytest.mark.parametrize("name", ["guess_number.yaml", "ttrl_reverse.yaml", "calc_tools_demo.yaml"])
def test_example_runs_two_steps(name, tmp_path):
    from groupflow.config import load_config
    from groupflow.trainer import Trainer

    overrides = [f"run.output_dir={tmp_path}", "run.total_steps=2", "run.loggers=[]",
                 "validation.before_training=false", "validation.every_steps=0",
                 "data.prompts_per_step=2", "rollout.samples_per_prompt=2"]  # fmt: skip
    if name != "guess_number.yaml":
        overrides += ["sft.steps=2", "data.task.num_val=4"]
    trainer = Trainer(load_config(EXAMPLES / name, overrides))
    final = trainer.fit()
    assert trainer.step == 2 and "reward/mean" in final
