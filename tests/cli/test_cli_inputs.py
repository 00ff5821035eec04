"""Bad input the hardening pass found, through ``groupflow.cli.commands.main``: each is one clear message on
stderr and exit code 2, never a traceback (the promise of ``tests/cli/test_cli.py``, for these inputs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from groupflow.cli.commands import main


def _user_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith(f"groupflow {argv[0]}: error: "), err
    return err


def _config(tmp_path, tiny_config_data, **overrides) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config_data(**overrides)))
    return str(path)


@pytest.mark.parametrize(
    "files, expected",
    [
        ({}, "model.path: '{dir}' is not a Hugging Face model directory (it is empty)"),
        ({"config.json": "{}"}, "model.path: '{dir}' holds no tokenizer (none of tokenizer.json"),
        (
            {"config.json": "{}", "tokenizer_config.json": "{not json"},
            "model.path: cannot load the tokenizer in '{dir}'",
        ),
    ],
    ids=["empty", "no-tokenizer", "broken-tokenizer"],
)
def test_a_model_directory_that_is_not_one_is_named(
    tmp_path, capsys, tiny_config_data, files, expected
):
    model = tmp_path / "model"
    model.mkdir()
    for name, text in files.items():
        (model / name).write_text(text)
    config = _config(tmp_path, tiny_config_data)
    err = _user_error(capsys, ["train", config, "model.tiny=null", f"model.path={model}"])
    assert expected.format(dir=model) in err


def test_a_duplicate_section_names_both_lines(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(
        "actor: {lr: 0.1}\nmodel: {tiny: {}}\ndata: {task: {name: add}}\nactor: {lr: 0.2}\n"
    )
    err = _user_error(capsys, ["train", str(path)])
    assert "duplicate key 'actor' (first at line 1, again at line 4)" in err


def test_a_bool_where_an_int_belongs_is_an_error(tmp_path, capsys, tiny_config_data):
    err = _user_error(
        capsys, ["train", _config(tmp_path, tiny_config_data), "data.prompts_per_step=true"]
    )
    assert "'data.prompts_per_step': Input should be a valid integer (got True)" in err


def test_a_row_missing_its_rewards_field(tmp_path, capsys, tiny_config_data):
    rows = tmp_path / "train.jsonl"
    good = {"prompt": "reverse 1234 =", "answer": "4321", "data_source": "groupflow/reverse"}
    rows.write_text("".join(json.dumps(r) + "\n" for r in [good] * 5 + [{**good, "answer": None}]))
    err = _user_error(
        capsys,
        [
            "train",
            _config(tmp_path, tiny_config_data),
            "data.task=null",
            f"data.train_files=[{rows}]",
        ],
    )
    assert f"{rows}, row 5, field 'answer': reward 'reverse' needs field 'answer'" in err


class _Touch:
    def __init__(self, marker):
        self.marker = Path(marker)

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_resuming_from_a_crafted_checkpoint_is_refused_and_runs_nothing(
    tmp_path, capsys, tiny_config_data
):
    config = _config(tmp_path, tiny_config_data, run__total_steps=1, run__save_every=1)
    assert main(["train", config, "--no-plot"]) == 0
    step = tmp_path / "tiny" / "checkpoints" / "step_1"
    manifest = json.loads((step / "manifest.json").read_text())
    # replace the RNG state by a format-1 (torch.save) file whose unpickling would touch a file
    marker = tmp_path / "pwned"
    (step / "rng.safetensors").unlink()
    torch.save(_Touch(marker), step / "rng.pt")
    manifest["components"]["rng"] = {
        "file": "rng.pt",
        "format": "torch",
        "bytes": (step / "rng.pt").stat().st_size,
    }
    (step / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    err = _user_error(capsys, ["train", config, "--no-plot"])  # the same run: it resumes
    assert f"{step / 'rng.pt'}: refusing to load it" in err
    assert not marker.exists()


@pytest.mark.parametrize("value", ["0", "-1", "true"])
def test_bad_reward_time_limits_are_rejected(tmp_path, capsys, tiny_config_data, value):
    err = _user_error(
        capsys, ["train", _config(tmp_path, tiny_config_data), f"reward.timeout_s={value}"]
    )
    assert "'reward.timeout_s'" in err
