"""``groupflow eval --benchmark`` and ``validation.benchmarks`` on the tiny model (the built-in
``reverse`` benchmark): records, metrics recomputed from them, bad input."""

from __future__ import annotations

import json

import pytest
import yaml

from groupflow.cli import commands as cli
from groupflow.evals import BENCHMARKS, get_benchmark
from groupflow.evals.runner import select_rows


@pytest.fixture
def tiny_file(tiny_config_data, tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config_data()))
    return path


def test_unknown_benchmark_exits_2_listing_the_known_ones(tmp_path, capsys):
    assert cli.main(["eval", str(tmp_path / "never_read.yaml"), "--benchmark", "ifevel"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'ifevel'" in err
    assert all(name in err for name in BENCHMARKS) and "Traceback" not in err


def test_limit_out_of_range_is_a_clear_error():
    rows = get_benchmark("gsm8k").load().rows
    assert len(select_rows(rows, 3, "gsm8k")) == 3 and select_rows(rows, None, "gsm8k") == rows
    for bad in (0, 101, -1):
        with pytest.raises(ValueError, match=r"--limit .* out of range .* 100 gradable prompts"):
            select_rows(rows, bad, "gsm8k")


def test_eval_benchmark_writes_one_line_per_prompt_and_metrics_match(tiny_file, tmp_path, capsys):
    out = tmp_path / "reverse.jsonl"
    args = ["eval", str(tiny_file), "--benchmark", "reverse", "--limit", "6",
            "--max-new-tokens", "6", "--out", str(out)]  # fmt: skip
    assert cli.main(args) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 6 and {"key", "prompt", "response", "reward"} <= set(records[0])
    assert [r["key"] for r in records] == [str(i) for i in range(6)]
    assert all(r["new_tokens"] <= 6 for r in records)
    printed = dict(
        line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("reverse/")
    )
    assert float(printed["reverse/acc"]) == pytest.approx(
        sum(r["correct"] for r in records) / 6, abs=1e-4
    )
    assert float(printed["reverse/reward"]) == pytest.approx(
        sum(r["reward"] for r in records) / 6, abs=1e-4
    )
    assert float(printed["reverse/prompts"]) == 6


def test_sampled_eval_gives_mean_and_pass_at_k(tiny_file, tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    args = ["eval", str(tiny_file), "--benchmark", "reverse", "--limit", "3", "--samples", "2",
            "--max-new-tokens", "4", "--out", str(out)]  # fmt: skip
    assert cli.main(args) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["key"], r["sample"]) for r in records] == [(k, s) for k in "012" for s in (0, 1)]
    printed = dict(
        line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("reverse/")
    )
    correct = [r["correct"] for r in records]
    assert float(printed["reverse/mean@2"]) == pytest.approx(sum(correct) / 6, abs=1e-4)
    assert float(printed["reverse/pass@2"]) == pytest.approx(
        sum(any(correct[i : i + 2]) for i in (0, 2, 4)) / 3, abs=1e-4
    )


def test_batch_prompts_splits_the_calls_not_the_answers(tiny_file, tmp_path, monkeypatch):
    from groupflow.evals import runner

    calls = []
    real = runner._generate
    monkeypatch.setattr(
        runner, "_generate", lambda p, ids, *a: calls.append(len(ids)) or real(p, ids, *a)
    )
    outs = []
    for batch in ("4", "16"):
        out = tmp_path / f"b{batch}.jsonl"
        args = ["eval", str(tiny_file), "--benchmark", "reverse", "--limit", "6",
                "--max-new-tokens", "6", "--batch-prompts", batch, "--out", str(out)]  # fmt: skip
        assert cli.main(args) == 0
        outs.append([json.loads(line)["response"] for line in out.read_text().splitlines()])
    assert calls == [4, 2, 6]  # 6 prompts by 4, then all 6 at once; the greedy answers agree
    assert outs[0] == outs[1]


@pytest.mark.parametrize("bad", ["0", "-3", "many"])
def test_batch_prompts_must_be_positive(tiny_file, capsys, bad):
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", str(tiny_file), "--benchmark", "reverse", "--batch-prompts", bad])
    assert e.value.code == 2
    assert "--batch-prompts: expected a positive integer" in capsys.readouterr().err


def test_eval_limit_out_of_range_exits_2(tiny_file, capsys):
    assert cli.main(["eval", str(tiny_file), "--benchmark", "reverse", "--limit", "201"]) == 2
    assert "out of range for benchmark 'reverse'" in capsys.readouterr().err


def test_training_validation_logs_bench_metrics(tiny_config, tmp_path):
    from groupflow.run.tracking import read_metrics
    from groupflow.trainer import Trainer

    cfg = tiny_config(run__total_steps=1, validation__benchmarks=["reverse"],
                      validation__benchmark_limit=4, validation__benchmark_max_new_tokens=4)  # fmt: skip
    trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    last = read_metrics(trainer.run_dir / "metrics.jsonl")[-1]
    assert last["bench/reverse/prompts"] == 4.0
    assert 0.0 <= last["bench/reverse/acc"] <= 1.0 and "bench/reverse/tokens_per_s" in last


def test_an_unknown_validation_benchmark_fails_at_start(tiny_config):
    from groupflow.trainer import Trainer

    with pytest.raises(
        ValueError, match=r"validation.benchmarks: unknown benchmark 'gsm9k'; known"
    ):
        Trainer(tiny_config(validation__benchmarks=["gsm9k"]))


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_run_benchmark_refuses_a_bad_batch_size_before_generating(bad):
    from groupflow.evals.runner import run_benchmark

    # the Python API checks what the CLI's argparse type checks (no policy is touched first)
    with pytest.raises(ValueError, match="must be a positive integer"):
        run_benchmark(None, "reverse", batch_prompts=bad)
