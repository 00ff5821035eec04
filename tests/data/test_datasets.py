"""Tests for groupflow.data's datasets (loading), rows (validation) and templating (templating,
over-long filtering)."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from groupflow.data.datasets import check_row_fields, load_prompt_rows
from groupflow.data.rows import DataError, PromptRow, normalize_row
from groupflow.data.templating import filter_overlong, render_prompt
from groupflow.data.tokenizer import train_char_tokenizer

PLAIN_ROWS = [
    {"prompt": "what is 2+2?", "answer": "4", "meta": {"level": 1, "tags": ["easy"]}},
    {"prompt": "what is 3+3?", "answer": "6", "meta": {"level": 2, "tags": []}},
]
VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "Natalia sold 48 clips..."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0, "answer": "... #### 72", "question": "N?"},
    },
    {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "Weng earns $12..."},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "10"},
        "extra_info": {"split": "train", "index": 1, "answer": "... #### 10", "question": "W?"},
    },
]


@pytest.fixture(scope="module")
def tok():
    return train_char_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# ---- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("writer,suffix", [(write_jsonl, ".jsonl"), (write_parquet, ".parquet")])
def test_plain_rows_round_trip(tmp_path, writer, suffix):
    path = writer(tmp_path / f"plain{suffix}", PLAIN_ROWS)
    ds = load_prompt_rows(path)
    assert len(ds) == 2 and ds.num_skipped == 0
    assert ds[0] == PromptRow(
        prompt="what is 2+2?",
        fields={"answer": "4", "meta": {"level": 1, "tags": ["easy"]}},
        source=str(path),
        index=0,
    )
    assert ds[1].fields["meta"] == {"level": 2, "tags": []}
    assert type(ds[1].fields["meta"]) is dict and type(ds[0].fields["meta"]["tags"]) is list


@pytest.mark.parametrize("writer,suffix", [(write_jsonl, ".jsonl"), (write_parquet, ".parquet")])
def test_verl_rows_round_trip(tmp_path, writer, suffix):
    path = writer(tmp_path / f"verl{suffix}", VERL_ROWS)
    ds = load_prompt_rows(path)
    row = ds[1]
    assert row.is_chat and row.index == 1
    assert row.prompt == VERL_ROWS[1]["prompt"]
    assert all(type(m) is dict for m in row.prompt)
    assert row.fields["ground_truth"] == "10"
    assert row.fields["reward_model"] == {"style": "rule", "ground_truth": "10"}
    assert row.fields["data_source"] == "openai/gsm8k"
    assert row.fields["ability"] == "math"
    assert row.fields["extra_info"] == VERL_ROWS[1]["extra_info"]
    assert "prompt" not in row.fields


def test_in_memory_and_list_of_paths(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", PLAIN_ROWS)
    b = write_parquet(tmp_path / "b.parquet", VERL_ROWS)
    ds = load_prompt_rows([a, str(b)])
    assert [(r.source, r.index) for r in ds] == [(str(a), 0), (str(a), 1), (str(b), 0), (str(b), 1)]
    assert ds.sources == [str(a), str(b)]
    mem = load_prompt_rows(PLAIN_ROWS)
    assert mem[1].source == "<in-memory>" and mem[1].fields["answer"] == "6"


def test_json_lines_blank_lines_and_json_array(tmp_path):
    p = tmp_path / "rows.json"
    p.write_text("\n" + json.dumps(PLAIN_ROWS[0]) + "\n\n" + json.dumps(PLAIN_ROWS[1]) + "\n")
    assert [r.fields["answer"] for r in load_prompt_rows(p)] == ["4", "6"]
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps(PLAIN_ROWS))
    assert [r.index for r in load_prompt_rows(arr)] == [0, 1]


def test_missing_file_and_bad_extension(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompt_rows(tmp_path / "nope.jsonl")
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match=r"unsupported .*'\.csv'.*\.parquet, \.jsonl, \.json"):
        load_prompt_rows(csv)
    with pytest.raises(TypeError, match="got int"):
        load_prompt_rows(3)
    with pytest.raises(ValueError, match="on_bad_row must be one of"):
        load_prompt_rows(PLAIN_ROWS, on_bad_row="ignore")


# ---- malformed rows ------------------------------------------------------------------------

BAD_ROWS = [
    ({"answer": "4"}, "prompt", "missing prompt"),
    ({"prompt": None}, "prompt", "missing prompt"),
    ({"prompt": "   "}, "prompt", "empty prompt string"),
    ({"prompt": 42}, "prompt", "got int"),
    ({"prompt": []}, "prompt", "empty list of chat messages"),
    ({"prompt": ["hi"]}, "prompt[0]", "must be a dict, got str"),
    ({"prompt": [{"content": "hi"}]}, "prompt[0].role", "missing 'role'"),
    (
        {"prompt": [{"role": "user", "content": "a"}, {"role": "user"}]},
        "prompt[1].content",
        "missing 'content'",
    ),
    ({"prompt": [{"role": "", "content": "hi"}]}, "prompt[0].role", "non-empty string"),
    # content parts (groupflow.data.images) are dicts
    ({"prompt": [{"role": "user", "content": ["x"]}]}, "prompt[0].content[0]", "dict, got str"),
    ({"prompt": [{"role": "user", "content": " "}]}, "prompt", "every chat message has empty"),
    ({"prompt": "p", "data_source": 3}, "data_source", "must be a string, got int"),
    ({"prompt": "p", "ability": ["math"]}, "ability", "must be a string, got list"),
    ({"prompt": "p", "extra_info": "x"}, "extra_info", "must be a struct / dict, got str"),
    ({"prompt": "p", "reward_model": "72"}, "reward_model", "must be a struct"),
    (
        {"prompt": "p", "reward_model": {"style": "rule"}},
        "reward_model.ground_truth",
        "no ground_truth",
    ),
    (
        {"prompt": "p", "ground_truth": "1", "reward_model": {"ground_truth": "2"}},
        "ground_truth",
        "conflicts",
    ),
]


@pytest.mark.parametrize("bad,field,reason", BAD_ROWS)
def test_malformed_jsonl_row_names_file_row_line_field(tmp_path, bad, field, reason):
    path = tmp_path / "bad.jsonl"
    # Row 2 sits on line 4 because of a blank line: index and line number differ.
    path.write_text(
        json.dumps(PLAIN_ROWS[0])
        + "\n\n"
        + json.dumps(PLAIN_ROWS[1])
        + "\n"
        + json.dumps(bad)
        + "\n"
    )
    with pytest.raises(DataError) as info:
        load_prompt_rows(path)
    err = info.value
    assert (err.source, err.index, err.line, err.field) == (str(path), 2, 4, field)
    assert str(err).startswith(f"{path}, row 2 (line 4), field '{field}': ")
    assert reason in str(err)


def test_malformed_parquet_row_names_file_row_field(tmp_path):
    rows = [{"prompt": "ok", "answer": "1"}, {"prompt": "", "answer": "2"}]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(
        DataError, match=r"bad\.parquet, row 1, field 'prompt': empty prompt string"
    ):
        load_prompt_rows(path)


def test_parquet_missing_ground_truth_in_struct(tmp_path):
    rows = [
        dict(VERL_ROWS[0]),
        dict(VERL_ROWS[1], reward_model={"style": "rule", "ground_truth": None}),
    ]
    path = write_parquet(tmp_path / "verl.parquet", rows)
    with pytest.raises(DataError) as info:
        load_prompt_rows(path)
    assert (info.value.index, info.value.field) == (1, "reward_model.ground_truth")


def test_invalid_json_line_and_non_object_row(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(PLAIN_ROWS[0]) + "\n{not json\n[1, 2]\n")
    with pytest.raises(DataError, match=r"broken\.jsonl, row 1 \(line 2\): invalid JSON line"):
        load_prompt_rows(path)
    ds = load_prompt_rows(path, on_bad_row="skip")
    assert len(ds) == 1 and ds.num_skipped == 2
    assert "row 1 (line 2)" in ds.first_skip_reason


def test_in_memory_error_names_source(tmp_path):
    with pytest.raises(DataError, match=r"<in-memory>, row 1, field 'prompt\[0\]\.role'"):
        load_prompt_rows([PLAIN_ROWS[0], {"prompt": [{"content": "x"}]}])
    with pytest.raises(
        DataError, match=r"<in-memory>, row 0: row must be a JSON object / dict, got str"
    ):
        normalize_row("hello")


def test_skip_mode_counts_and_warns(tmp_path, caplog):
    rows = [PLAIN_ROWS[0], {"prompt": ""}, PLAIN_ROWS[1], {"answer": "x"}, {"prompt": 1}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="groupflow.data.datasets"):
        ds = load_prompt_rows(path, on_bad_row="skip")
    assert [r.index for r in ds] == [0, 2]
    assert ds.num_skipped == 3
    assert ds.first_skip_reason == f"{path}, row 1 (line 2), field 'prompt': empty prompt string"
    assert len(caplog.records) == 1
    assert "skipped 3 malformed prompt rows (kept 2)" in caplog.records[0].getMessage()


def test_all_rows_bad_or_empty_is_an_error(tmp_path):
    with pytest.raises(DataError, match="all 2 rows were malformed"):
        load_prompt_rows([{"prompt": ""}, {"x": 1}], on_bad_row="skip")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no prompt rows"):
        load_prompt_rows(empty)


# ---- templating and over-long filter -------------------------------------------------------


def test_render_prompt(tok):
    chat = normalize_row(VERL_ROWS[1])
    assert render_prompt(chat, tok) == "system: be brief\nuser: Weng earns $12...\nassistant:"
    plain = normalize_row({"prompt": "reverse 12 ="})
    assert render_prompt(plain, tok) == "reverse 12 ="
    assert render_prompt(plain, tok, use_chat_template=True) == "user: reverse 12 =\nassistant:"
    with pytest.raises(
        ValueError, match="row 0: prompt is a list of chat messages but use_chat_template=False"
    ):
        render_prompt(chat, tok, use_chat_template=False)


def test_render_prompt_without_chat_template(tok):
    bare = train_char_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template.*plain string prompts"):
        render_prompt([{"role": "user", "content": "hi"}], bare)
    assert render_prompt("hi", bare) == "hi"


def test_filter_overlong_counts_by_templated_length(tok):
    rows = load_prompt_rows(
        [
            {"prompt": "abcde"},  # 5 tokens
            {"prompt": "abcdef"},  # 6 tokens
            {"prompt": [{"role": "user", "content": "a"}]},  # "user: a\nassistant:" = 18 tokens
        ]
    )
    kept, n = filter_overlong(rows, tok, max_prompt_tokens=5)
    assert [r.index for r in kept] == [0] and n == 2
    kept, n = filter_overlong(rows, tok, max_prompt_tokens=18, batch_size=2)
    assert len(kept) == 3 and n == 0
    kept, n = filter_overlong(rows, tok, max_prompt_tokens=17)
    assert [r.index for r in kept] == [0, 1] and n == 1
    # Wrapping plain strings in the template lengthens them: "user: abcde\nassistant:" = 22.
    kept, n = filter_overlong(rows, tok, max_prompt_tokens=22, use_chat_template=True)
    assert [r.index for r in kept] == [0, 2] and n == 1


def test_filter_overlong_error_mode_and_bad_options(tok):
    rows = load_prompt_rows([{"prompt": "abc"}, {"prompt": "abcdefgh"}, {"prompt": "abcdefghij"}])
    with pytest.raises(
        DataError,
        match=r"row 1, field 'prompt': prompt has 8 tokens .* max_prompt_tokens=4 \(2 over-long",
    ):
        filter_overlong(rows, tok, 4, mode="error")
    kept, n = filter_overlong(rows, tok, 10, mode="error")
    assert len(kept) == 3 and n == 0
    with pytest.raises(ValueError, match=r"one of \('filter', 'error'\)"):
        filter_overlong(rows, tok, 4, mode="drop")
    with pytest.raises(ValueError, match="positive"):
        filter_overlong(rows, tok, 0)
    with pytest.raises(TypeError, match="int"):
        filter_overlong(rows, tok, 4.5)


# ----- whole-number floats ----------------------------------------------------------------------


def test_whole_number_floats_reach_rewards_as_ints_with_a_warning(tmp_path, caplog):
    # pandas writes an int column with a missing value as float64: 654321 became 654321.0
    rows = [
        {"prompt": "reverse 123456", "answer": 654321.0, "weight": 0.5, "reward_model": None},
        {"prompt": "reverse 000012", "answer": 210000.0, "weight": 2.0, "reward_model": None},
        {"prompt": "x", "answer": None, "weight": None, "reward_model": {"ground_truth": 7.0}},
    ]
    path = write_parquet(tmp_path / "floats.parquet", rows)
    with caplog.at_level(logging.WARNING):
        ds = load_prompt_rows(path)
    answers = [r.fields["answer"] for r in ds]
    assert answers == [654321, 210000, None] and isinstance(answers[0], int)
    assert str(answers[0]) == "654321"  # what a text-comparing reward sees, not "654321.0"
    assert [r.fields["weight"] for r in ds][:2] == [0.5, 2]  # a real float stays a float
    assert ds[2].fields["ground_truth"] == 7 and ds[2].fields["reward_model"]["ground_truth"] == 7
    warnings = [
        r.getMessage() for r in caplog.records if "whole numbers stored as floats" in r.message
    ]
    assert any(
        "floats.parquet: column 'answer'" in w and "2 row(s) (e.g. 654321.0)" in w for w in warnings
    )
    assert any("column 'weight'" in w and "1 row(s)" in w for w in warnings)
    assert len(warnings) == 3  # one per column: answer, weight, ground_truth


# ----- fields a consumer needs, per row ------------------------------------------------------------


def _needs_answer(fields):
    return (
        [] if fields.get("answer") is not None else [("answer", "reward 'r' needs field 'answer'")]
    )


def test_a_row_missing_a_needed_field_is_an_error_naming_file_row_and_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    rows = list(load_prompt_rows(path))
    with pytest.raises(DataError, match=r"d\.jsonl, row 1, field 'answer': reward 'r' needs field"):
        check_row_fields(rows, _needs_answer)


def test_rows_missing_a_needed_field_are_skipped_and_counted(tmp_path, caplog):
    rows = list(load_prompt_rows([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]))
    kept, skipped = check_row_fields(rows, _needs_answer, on_bad_row="skip", split="validation")
    assert [r.index for r in kept] == [0] and skipped == 1
    assert "validation data: skipped 1 row(s) lacking a field" in caplog.text
    with pytest.raises(DataError, match="no train rows left: all 1 lack"):
        check_row_fields(rows[1:], _needs_answer, on_bad_row="skip")
