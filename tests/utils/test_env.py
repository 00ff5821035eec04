import os

import pytest

from groupflow.utils.env import (
    REDACTED,
    DotenvError,
    MissingSecretError,
    is_secret_name,
    load_dotenv_file,
    parse_dotenv,
    redact_secrets,
    require_env,
    scrub_text,
    secret_values_from_env,
)


def test_parse_dotenv_handles_quotes_comments_and_export():
    text = "\n".join(
        [
            "# a comment",
            "",
            "PLAIN=abc",
            "export EXPORTED=1",
            "SPACED = value with spaces  # trailing comment",
            "HASH=a#b",
            'DQ="line1\\nline2 # not a comment"',
            "SQ='raw\\n'  # comment",
            "EMPTY=",
        ]
    )
    assert parse_dotenv(text) == {
        "PLAIN": "abc",
        "EXPORTED": "1",
        "SPACED": "value with spaces",
        "HASH": "a#b",
        "DQ": "line1\nline2 # not a comment",
        "SQ": "raw\\n",
        "EMPTY": "",
    }


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("NOEQUALS", "expected KEY=VALUE"),
        ("1BAD=x", "expected KEY=VALUE"),
        ('K="open', "unterminated"),
    ],
)
def test_parse_dotenv_bad_lines_name_file_and_line(line, message):
    with pytest.raises(DotenvError, match=rf"my.env:2: .*{message}"):
        parse_dotenv(f"OK=1\n{line}", source="my.env")


def test_parse_dotenv_rejects_text_after_closing_quote():
    with pytest.raises(DotenvError, match="after the closing quote"):
        parse_dotenv('K="a" b')


def test_load_dotenv_never_overrides_existing(tmp_path, monkeypatch):
    monkeypatch.setenv("GF_TEST_SET", "from-env")
    monkeypatch.delenv("GF_TEST_NEW", raising=False)
    path = tmp_path / ".env"
    path.write_text("GF_TEST_SET=from-file\nGF_TEST_NEW=new\n")
    applied = load_dotenv_file(path)
    assert applied == {"GF_TEST_NEW": "new"}
    assert os.environ["GF_TEST_SET"] == "from-env"
    assert os.environ["GF_TEST_NEW"] == "new"
    monkeypatch.delenv("GF_TEST_NEW")


def test_load_dotenv_missing_file_is_empty_and_dir_is_error(tmp_path):
    assert load_dotenv_file(tmp_path / "nope.env") == {}
    with pytest.raises(DotenvError, match="not a file"):
        load_dotenv_file(tmp_path)


def test_require_env(monkeypatch):
    monkeypatch.setenv("GF_TEST_KEY", "v")
    assert require_env("GF_TEST_KEY") == "v"
    monkeypatch.delenv("GF_TEST_KEY")
    with pytest.raises(
        MissingSecretError, match=r"GF_TEST_KEY is not set \(needed for the judge\).*\.env"
    ):
        require_env("GF_TEST_KEY", "the judge")


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("OPENAI_API_KEY", True),
        ("openai_api_key", True),
        ("reward.judge.api_key", True),
        ("HF_TOKEN", True),
        ("aws_secret", True),
        ("DB_PASSWORD", True),
        ("password", True),
        ("token", True),
        ("pad_token", False),
        ("data.prompt_key", False),
        ("max_new_tokens", False),
        ("key", False),
        ("monkey", False),
        ("lr", False),
    ],
)
def test_is_secret_name(name, secret):
    assert is_secret_name(name) is secret


def test_redact_secrets_by_name_and_by_env_value(monkeypatch):
    monkeypatch.setenv("GF_TEST_API_KEY", "sk-verysecretvalue")
    config = {
        "lr": 0.1,
        "reward": {"api_key": "abc", "url": "https://x?key=sk-verysecretvalue", "hf_token": None},
        "data": {"prompt_key": "prompt", "files": ["a", "sk-verysecretvalue"]},
        "pair": ("x", "y"),
    }
    out = redact_secrets(config)
    assert out == {
        "lr": 0.1,
        "reward": {"api_key": REDACTED, "url": f"https://x?key={REDACTED}", "hf_token": None},
        "data": {"prompt_key": "prompt", "files": ["a", REDACTED]},
        "pair": ("x", "y"),
    }
    assert config["reward"]["api_key"] == "abc"  # the input is not modified


def test_secret_values_from_env_ignores_short_and_non_secret_values():
    env = {
        "A_KEY": "short",
        "B_TOKEN": "long-enough-1",
        "C_TOKEN": "long-enough-1-and-more",
        "PATH": "/usr/bin:/bin",
    }
    assert secret_values_from_env(env) == ["long-enough-1-and-more", "long-enough-1"]
    assert (
        scrub_text("x long-enough-1-and-more y", secret_values_from_env(env)) == f"x {REDACTED} y"
    )
