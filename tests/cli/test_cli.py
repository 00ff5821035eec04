"""Tests of the ``groupflow`` command through ``groupflow.cli.commands.main`` (in process).

One tiny 2-step run is trained once per module and shared by the export/eval/generate/plot tests.
User errors must exit with code 2 and one clear ``groupflow <command>: error: ...`` message on
stderr, never a traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from groupflow.cli.commands import main
from groupflow.config import load_config
from groupflow.models.logprobs import response_logprobs
from groupflow.rollout.engines.hf import left_pad
from groupflow.run.checkpoint import find_latest_checkpoint, load_checkpoint
from groupflow.trainer import Trainer

PROMPTS = ["reverse 1234 =", "reverse 9075 ="]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_base):
    """A 2-step run with a checkpoint at step 2: (config file, run dir, what train printed)."""
    tiny_config_dict, with_overrides = tiny_base
    root = tmp_path_factory.mktemp("cli")
    data = with_overrides(
        tiny_config_dict(root),
        {"run.save_every": 2, "run.total_steps": 5, "validation.before_training": True},
    )
    config_file = root / "tiny.yaml"
    config_file.write_text(yaml.safe_dump(data))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        # the override wins over the file's total_steps; plots are on by default
        assert main(["train", str(config_file), "run.total_steps=2"]) == 0
    return config_file, root / "tiny", printed.getvalue()


def test_train_writes_run_plots_and_summary(trained):
    config_file, run_dir, printed = trained
    assert (run_dir / "checkpoints" / "step_2" / "manifest.json").is_file()
    assert not (run_dir / "checkpoints" / "step_5").exists()
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert sorted({json.loads(line)["step"] for line in metrics}) == [0, 1, 2]  # 0: before training
    assert load_config(run_dir / "config.yaml").run.total_steps == 2
    assert f"run directory: {run_dir}" in printed
    assert "held-out greedy accuracy: before" in printed
    assert "plots:" in printed and (run_dir / "plots" / "overview.png").is_file()


def _checkpoint_model(config_file: Path, run_dir: Path):
    trainer = Trainer(load_config(config_file), inference_run_dir=run_dir)
    trainer.policy.actor.model.load_state_dict(
        load_checkpoint(find_latest_checkpoint(run_dir / "checkpoints"))["model"]
    )
    return trainer


def test_export_gives_an_hf_model_with_identical_logprobs(trained, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_file, run_dir, _ = trained
    out = tmp_path / "hf"
    assert main(["export", str(config_file), "--checkpoint", str(run_dir), "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()

    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    trainer = _checkpoint_model(config_file, run_dir)
    ours = trainer.policy.actor.model.eval()
    assert any(
        not torch.equal(a, b)
        for a, b in zip(
            ours.state_dict().values(),
            Trainer(trainer.cfg, inference_run_dir=run_dir)
            .policy.actor.model.state_dict()
            .values(),
        )
    ), "the checkpoint should differ from the initial weights"

    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert ids == [trainer.policy.tokenizer(p)["input_ids"] for p in PROMPTS]
    prompt_ids, prompt_mask = left_pad(ids, tokenizer.pad_token_id)
    answers = [p.split()[1][::-1] for p in PROMPTS]
    resp = [
        tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for a in answers
    ]
    responses = torch.tensor(resp)
    mask = torch.ones_like(responses)
    with torch.no_grad():
        theirs_lp, _ = response_logprobs(model, prompt_ids, prompt_mask, responses, mask)
        ours_lp, _ = response_logprobs(ours, prompt_ids, prompt_mask, responses, mask)
    assert torch.equal(theirs_lp, ours_lp)


def test_eval_writes_records_consistent_with_printed_metrics(trained, tmp_path, capsys):
    config_file, run_dir, _ = trained
    out = tmp_path / "records.jsonl"
    args = ["eval", str(config_file), "--checkpoint", str(run_dir), "--output", str(out)]
    assert main(args) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 16  # num_val prompts, greedy only
    assert {r["mode"] for r in records} == {"greedy"}
    assert {"prompt", "completion", "reward", "data_source", "finish_reason"} <= set(records[0])
    printed = dict(
        line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("val/")
    )
    acc = sum(r["reward"] >= 1.0 for r in records) / len(records)
    assert float(printed["val/greedy/acc"]) == pytest.approx(acc, abs=1e-4)
    mean_reward = sum(r["reward"] for r in records) / len(records)
    assert float(printed["val/greedy/reward"]) == pytest.approx(mean_reward, abs=1e-4)


def test_generate_prints_one_json_line_per_sample(trained, capsys):
    config_file, run_dir, _ = trained
    args = ["generate", str(config_file), "--checkpoint", str(run_dir)]
    for p in PROMPTS:
        args += ["--prompt", p]
    assert main([*args, "--num-samples", "2", "--greedy"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["prompt"] for x in lines] == [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    assert all(x["finish_reason"] in ("stop", "length") for x in lines)
    # greedy: both samples of a prompt are the same
    assert lines[0]["completion"] == lines[1]["completion"]
    assert lines[2]["completion"] == lines[3]["completion"]


def test_plot_writes_pngs(trained, tmp_path, capsys):
    _, run_dir, _ = trained
    assert main(["plot", str(run_dir), "--out", str(tmp_path / "plots")]) == 0
    paths = [Path(p) for p in capsys.readouterr().out.split()]
    assert tmp_path / "plots" / "overview.png" in paths
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", p


def test_plot_compares_several_runs(trained, tmp_path, capsys):
    _, run_dir, _ = trained
    out = tmp_path / "cmp"
    argv = ["plot", str(run_dir), str(run_dir), "--out", str(out), "--metrics", "reward/mean"]
    assert main(argv) == 0
    assert [Path(p).name for p in capsys.readouterr().out.split()] == [
        "reward_mean.png", "overview.png",
    ]  # fmt: skip
    assert main(["plot", str(run_dir), str(run_dir)]) == 2  # several runs need --out
    assert "give --out DIR" in capsys.readouterr().err


# ----- user errors ---------------------------------------------------------------------------------


def _user_error(capsys, argv: list[str], allow_bullets: bool = False) -> str:
    """Run main, check exit code 2 and one error line without a traceback; return the message."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    prefix = f"groupflow {argv[0]}: error: "
    assert lines and lines[0].startswith(prefix), err
    # validation errors list one problem per bullet line under the header; the CLI may add a
    # hint on how to see the traceback
    extra = [
        line
        for line in lines[1:]
        if not (allow_bullets and line.startswith("  - ")) and not line.startswith("(run with")
    ]
    assert not extra, f"error is not one line: {err!r}"
    return "\n".join(lines)[len(prefix) :]


def _write(tmp_path, data, name="c.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(path)


def test_missing_config_file(tmp_path, capsys):
    msg = _user_error(capsys, ["train", str(tmp_path / "nope.yaml")])
    assert "nope.yaml" in msg and "does not exist" in msg


def test_bad_yaml(tmp_path, capsys):
    path = _write(tmp_path, "run:\n  name: [unclosed\n")
    msg = _user_error(capsys, ["train", path])
    assert "not valid YAML" in msg and re.search(r"line \d+", msg)


def test_bad_yaml_exits_2_without_traceback(tmp_path, capsys):
    path = _write(tmp_path, "run:\n  name: [unclosed\n")
    assert main(["train", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("groupflow train: error: ") and "not valid YAML" in err
    assert "Traceback" not in err


def test_unknown_key_suggests_the_closest(tmp_path, capsys, tiny_config_data):
    data = tiny_config_data()
    data["actor"]["lrr"] = 1e-3
    msg = _user_error(capsys, ["train", _write(tmp_path, data)], allow_bullets=True)
    assert "'actor.lrr': unknown key; did you mean 'actor.lr'?" in msg


def test_bad_override_syntax(tmp_path, capsys, tiny_config_data):
    path = _write(tmp_path, tiny_config_data())
    msg = _user_error(capsys, ["train", path, "actor.lr"])
    assert "'actor.lr'" in msg and "key=value" in msg


def test_override_into_a_value(tmp_path, capsys, tiny_config_data):
    path = _write(tmp_path, tiny_config_data())
    msg = _user_error(capsys, ["train", path, "actor.lr.x=1"])
    assert "'actor.lr' is a value, not a section" in msg


def test_nonexistent_model_path(tmp_path, capsys, tiny_config_data):
    path = _write(tmp_path, tiny_config_data())
    missing = tmp_path / "no_such_model"
    msg = _user_error(capsys, ["train", path, "model.tiny=null", f"model.path={missing}"])
    assert str(missing) in msg and "does not exist" in msg


def test_malformed_data_row_names_file_row_and_field(tmp_path, capsys, tiny_config_data):
    rows = tmp_path / "train.jsonl"
    good = {"prompt": "reverse 1234 =", "answer": "4321", "data_source": "groupflow/reverse"}
    rows.write_text(json.dumps(good) + "\n" + json.dumps({**good, "prompt": 7}) + "\n")
    path = _write(tmp_path, tiny_config_data())
    msg = _user_error(capsys, ["train", path, "data.task=null", f"data.train_files=[{rows}]"])
    assert str(rows) in msg and "row 1" in msg and "field 'prompt'" in msg


def test_export_with_missing_checkpoint(tmp_path, capsys, tiny_config_data):
    path = _write(tmp_path, tiny_config_data())
    missing = tmp_path / "no_ckpt"
    msg = _user_error(
        capsys, ["export", path, "--checkpoint", str(missing), "--out", str(tmp_path / "o")]
    )
    assert str(missing) in msg


def _jsonl_rows(tmp_path) -> Path:
    rows = tmp_path / "train.jsonl"
    good = {"prompt": "reverse 1234 =", "answer": "4321", "data_source": "groupflow/reverse"}
    rows.write_text(json.dumps(good) + "\n" + json.dumps({**good, "prompt": "reverse 12 ="}) + "\n")
    return rows


def test_overlong_prompt_with_overlong_error_names_file_and_row(tmp_path, capsys, tiny_config_data):
    rows = _jsonl_rows(tmp_path)
    path = _write(tmp_path, tiny_config_data())
    overrides = ["data.task=null", f"data.train_files=[{rows}]", "data.max_prompt_tokens=3"]
    msg = _user_error(capsys, ["train", path, *overrides, "data.overlong_prompts=error"])
    assert f"{rows}, row 0, field 'prompt'" in msg
    assert "data.max_prompt_tokens=3" in msg and "data.overlong_prompts=filter" in msg


def test_every_prompt_overlong_names_the_files(tmp_path, capsys, tiny_config_data):
    rows = _jsonl_rows(tmp_path)
    path = _write(tmp_path, tiny_config_data())
    overrides = ["data.task=null", f"data.train_files=[{rows}]", "data.max_prompt_tokens=3"]
    msg = _user_error(capsys, ["train", path, *overrides])
    assert str(rows) in msg and "every train prompt" in msg and "max_prompt_tokens=3" in msg
