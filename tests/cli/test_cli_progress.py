"""Long commands report progress (groupflow/utils/progress.py): a bar when stderr is a terminal,
log lines otherwise. A short 2-step run is trained once for eval and generate; pretrain-diffusion
runs a few steps; convert-gguf converts a tiny model standing in for the GGUF file's."""

from __future__ import annotations

import contextlib
import io
import logging
import sys

import pytest
import yaml

from groupflow.cli.commands import main
from groupflow.models import gguf as gguf_mod
from groupflow.utils import progress as progress_mod


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_base):
    tiny_config_dict, with_overrides = tiny_base
    root = tmp_path_factory.mktemp("progress")
    data = with_overrides(tiny_config_dict(root), {"run.total_steps": 1})
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump(data))
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", str(config), "--no-plot"]) == 0
    return str(config), str(root / "tiny")


@pytest.fixture
def log_lines(caplog, monkeypatch):
    """Progress log lines, with every update allowed to log (no 30 s wait)."""
    monkeypatch.setattr(progress_mod, "INTERVAL_S", 0.0)
    caplog.set_level(logging.INFO, logger="groupflow")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "groupflow"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _terminal(monkeypatch) -> Terminal:
    """Make stderr a terminal; returns what gets drawn on it. Called in the test body: pytest's
    capture puts its own stderr back between a fixture's setup and the test."""
    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    return tty


def test_eval_logs_prompts_tokens_and_accuracy_off_a_terminal(run, log_lines, capsys):
    config, run_dir = run
    assert main(["eval", config, "--checkpoint", run_dir]) == 0
    lines = [ln for ln in log_lines() if ln.startswith("eval (greedy): ")]
    assert lines and lines[-1].startswith("eval (greedy): 16/16 prompts, ")
    assert " tokens/s, acc " in lines[-1]
    assert "eval (greedy)" not in capsys.readouterr().err  # no bar


def test_eval_draws_a_bar_on_a_terminal(run, monkeypatch, log_lines, capsys):
    config, run_dir = run
    terminal = _terminal(monkeypatch)
    assert main(["eval", config, "--checkpoint", run_dir]) == 0
    err = terminal.getvalue()
    assert "eval (greedy)" in err and "16/16" in err and "acc=" in err
    assert not [ln for ln in log_lines() if ln.startswith("eval (greedy)")]


def test_generate_reports_prompts_done(run, log_lines, capsys):
    config, run_dir = run
    argv = ["generate", config, "--checkpoint", run_dir, "--prompt", "reverse 12 ="]
    assert main([*argv, "--prompt", "reverse 34 ="]) == 0
    assert capsys.readouterr().out.count('"completion"') == 2
    assert any(ln.startswith("generate: 2/2 prompts, ") for ln in log_lines())


def test_pretrain_diffusion_reports_steps_and_loss(tmp_path, log_lines, capsys):
    assert main(["pretrain-diffusion", "--out", str(tmp_path / "m"), "--steps", "3"]) == 0
    assert any(
        ln.startswith("pre-training the tiny flow model: 3/3 steps, loss ") for ln in log_lines()
    )


def _fake_gguf(monkeypatch, tmp_path):
    """load_gguf gives a tiny Llama and a character tokenizer (the real file takes a minute)."""
    from groupflow.data.tokenizer import train_char_tokenizer
    from groupflow.models.causal_lm import build_tiny_llama

    tokenizer = train_char_tokenizer(["reverse 0123456789 ="])
    model = build_tiny_llama(len(tokenizer), hidden_size=16, num_layers=1, num_heads=2, seed=0)

    def load(path, dtype, on_stage):
        on_stage("reading the weights")
        on_stage("reading the tokenizer")
        return model, tokenizer

    monkeypatch.setattr(gguf_mod, "load_gguf", load)
    return ["convert-gguf", "--out", str(tmp_path / "hf"), "--gguf", str(tmp_path / "x.gguf")]


def test_convert_gguf_reports_its_stages(tmp_path, monkeypatch, log_lines, capsys):
    assert main(_fake_gguf(monkeypatch, tmp_path)) == 0
    stages = [ln.split(", ")[0:2] for ln in log_lines() if ln.startswith("convert-gguf: ")]
    assert stages[:4] == [
        ["convert-gguf: 0/4 stages", "stage reading the weights"],
        ["convert-gguf: 1/4 stages", "stage reading the tokenizer"],
        ["convert-gguf: 2/4 stages", "stage copying the weights to float32"],
        ["convert-gguf: 3/4 stages", f"stage writing {tmp_path / 'hf'}"],
    ]
    assert stages[-1][0] == "convert-gguf: 4/4 stages"
    assert (tmp_path / "hf" / "config.json").is_file()


def test_convert_gguf_draws_a_bar_on_a_terminal(tmp_path, monkeypatch, capsys):
    terminal = _terminal(monkeypatch)
    assert main(_fake_gguf(monkeypatch, tmp_path)) == 0
    err = terminal.getvalue()
    assert "convert-gguf" in err and "4/4" in err and "stage=writing" in err


def test_validation_inside_train_reports_progress(tmp_path, tiny_config_data, log_lines, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tiny_config_data(run__total_steps=1)))
    assert main(["train", str(config), "--no-plot"]) == 0
    assert any(ln.startswith("validation (greedy): 16/16 prompts, ") for ln in log_lines())
