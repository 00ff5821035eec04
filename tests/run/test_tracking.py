import dataclasses
import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from groupflow.run import tracking
from groupflow.run.tracking import (
    BACKENDS,
    MissingBackendPackageError,
    Tracker,
    UnknownBackendError,
    format_metrics_table,
    read_metrics,
    register_backend,
    save_config,
    truncate_jsonl_after,
)


def _strict_rows(path: Path) -> list[dict]:
    """Parse JSONL refusing NaN/Infinity tokens, i.e. as a strict JSON reader would."""

    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_jsonl_rows_have_step_wall_time_and_coerced_values(tmp_path):
    with Tracker(tmp_path, backends=()) as t:
        t.log(
            {
                "a": 1,
                "b": torch.tensor(0.5),
                "c": np.float32(0.25),
                "d": np.array([2.0]),
                "e": True,
            },
            step=0,
        )
        t.log({"a": float("nan"), "b": float("inf")}, step=1)
    rows = _strict_rows(tmp_path / "metrics.jsonl")
    assert [set(r) for r in rows] == [
        {"step", "wall_time", "a", "b", "c", "d", "e"},
        {"step", "wall_time", "a", "b"},
    ]
    assert {k: rows[0][k] for k in "abcde"} == {"a": 1.0, "b": 0.5, "c": 0.25, "d": 2.0, "e": 1.0}
    assert rows[1]["a"] is None and rows[1]["b"] is None  # non-finite -> null, still valid JSON
    assert 0 <= rows[0]["wall_time"] <= rows[1]["wall_time"]


def test_non_numeric_metric_is_skipped_with_one_warning(tmp_path):
    with Tracker(tmp_path, backends=()) as t:
        with pytest.warns(UserWarning) as record:
            t.log({"ok": 1.0, "text": "hello", "vec": torch.ones(3)}, step=1)
            t.log({"ok": 2.0, "text": "again"}, step=2)
    messages = [str(w.message) for w in record]
    assert len([m for m in messages if "'text' has a non-numeric value of type str" in m]) == 1
    assert len([m for m in messages if "'vec' has a non-numeric value of type Tensor" in m]) == 1
    rows = read_metrics(tmp_path)
    assert [r["ok"] for r in rows] == [1.0, 2.0] and all("text" not in r for r in rows)


def test_bad_log_input(tmp_path):
    with Tracker(tmp_path, backends=()) as t:
        t.log({"x": 1.0}, step=5)
        with pytest.raises(ValueError, match="step 4 is before step 5"):
            t.log({"x": 1.0}, step=4)
        with pytest.raises(ValueError, match="step must be an integer >= 0"):
            t.log({"x": 1.0}, step=-1)
        with pytest.raises(ValueError, match="step must be an integer"):
            t.log({"x": 1.0}, step=6.0)
        with pytest.raises(ValueError, match="'step' is reserved"):
            t.log({"step": 1.0}, step=6)
        with pytest.raises(TypeError, match="metric names must be non-empty strings"):
            t.log({3: 1.0}, step=6)
        with pytest.raises(TypeError, match="metrics must be a dict"):
            t.log([1.0], step=6)
        t.log({"y": 2.0}, step=5)  # same step again is fine (e.g. validation after training)
    t.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        t.log({"x": 1.0}, step=7)
    assert read_metrics(tmp_path)[0] == {
        "step": 5.0,
        "wall_time": pytest.approx(0, abs=60),
        "x": 1.0,
        "y": 2.0,
    }


def test_resume_drops_later_steps_and_continues_wall_time(tmp_path):
    with Tracker(tmp_path, backends=()) as t:
        for step in range(1, 6):
            t.log({"x": float(step)}, step=step)
        t.log_samples(2, [{"prompt": "p2"}])
        t.log_samples(4, [{"prompt": "p4"}])
    last_kept_wall = _strict_rows(tmp_path / "metrics.jsonl")[2]["wall_time"]
    with Tracker(tmp_path, backends=(), resume_step=3) as t:
        assert [r["step"] for r in _strict_rows(tmp_path / "metrics.jsonl")] == [1, 2, 3]
        assert [r["step"] for r in _strict_rows(tmp_path / "samples.jsonl")] == [2]
        with pytest.raises(ValueError, match="after a resume"):
            t.log({"x": 3.0}, step=3)
        t.log({"x": 40.0}, step=4)
    rows = _strict_rows(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["x"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert rows[3]["wall_time"] >= last_kept_wall


def test_fresh_run_over_old_metrics_warns_and_empties(tmp_path):
    with Tracker(tmp_path, backends=()) as t:
        t.log({"x": 1.0}, step=1)
    with (
        pytest.warns(UserWarning, match="metrics of an earlier run"),
        Tracker(tmp_path, backends=()),
    ):
        pass
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_truncate_jsonl_repairs_a_crashed_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n{"step": 3, "x"')
    with pytest.warns(UserWarning, match="m.jsonl:3: dropping a truncated last line"):
        kept = truncate_jsonl_after(path, 10)
    assert kept == [{"step": 1, "x": 1}, {"step": 2, "x": 2}]
    assert path.read_text() == '{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n'
    # A complete last row without its newline would glue the next row onto it: also rewritten.
    path.write_text('{"step": 1}')
    truncate_jsonl_after(path, 10)
    assert path.read_text() == '{"step": 1}\n'
    assert truncate_jsonl_after(tmp_path / "missing.jsonl", 3) == []


def test_truncate_jsonl_rejects_corruption_in_the_middle(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match="m.jsonl:2: not valid JSON"):
        truncate_jsonl_after(path, 10)
    path.write_text('{"nostep": 1}\n')
    with pytest.raises(
        ValueError, match="m.jsonl:1: expected a JSON object with an integer 'step'"
    ):
        truncate_jsonl_after(path, 10)


def test_read_metrics_merges_lines_of_one_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 2, "wall_time": 1.0, "a": 1}\n{"step": 1, "a": 0.5}\n{"step": 2, "val/acc": null}\n'
    )
    rows = read_metrics(tmp_path)
    assert rows[0] == {"step": 1.0, "a": 0.5}
    assert rows[1]["a"] == 1.0 and math.isnan(rows[1]["val/acc"]) and rows[1]["wall_time"] == 1.0
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        read_metrics(tmp_path / "nope")


def test_backend_names_are_validated_and_jsonl_is_always_on(tmp_path):
    with pytest.raises(
        UnknownBackendError, match=r"'tensorbord'; valid backends: \['console', 'jsonl'"
    ):
        Tracker(tmp_path, backends=("jsonl", "tensorbord"))
    with pytest.raises(TypeError, match="must be strings"):
        Tracker(tmp_path, backends=(None,))
    with pytest.raises(ValueError, match="console_every must be an integer >= 1"):
        Tracker(tmp_path, backends=(), console_every=0)
    with Tracker(tmp_path, backends="console, console", console_file=io.StringIO()) as t:
        assert t.backend_names == ["jsonl", "console"]
    assert (tmp_path / "metrics.jsonl").exists()


def test_missing_backend_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `wandb` look uninstalled
    with pytest.raises(
        MissingBackendPackageError, match=r"'wandb'.*pip install 'groupflow\[loggers\]'"
    ):
        Tracker(tmp_path, backends=("wandb",))


def test_failing_backend_closes_the_ones_already_built(tmp_path, monkeypatch):
    closed = []

    class Recorder:
        def log(self, metrics, step):
            pass

        def close(self):
            closed.append("recorder")

    def broken(ctx):
        raise RuntimeError("cannot start")

    monkeypatch.setitem(BACKENDS, "recorder", lambda ctx: Recorder())
    monkeypatch.setitem(BACKENDS, "broken", broken)
    with pytest.raises(RuntimeError, match="cannot start"):
        Tracker(tmp_path, backends=("recorder", "broken"))
    assert closed == ["recorder"]


def test_register_backend_receives_clean_metrics_and_context(tmp_path, monkeypatch):
    seen = []

    class Recorder:
        def __init__(self, ctx):
            seen.append(("ctx", ctx.run_name, ctx.project, ctx.config, ctx.total_steps))

        def log(self, metrics, step):
            seen.append((step, metrics))

        def close(self):
            seen.append("closed")

    monkeypatch.setattr(tracking, "BACKENDS", dict(BACKENDS))
    register_backend("recorder", Recorder)
    with pytest.raises(ValueError, match="already registered"):
        register_backend("recorder", Recorder)
    config = {"lr": 0.1, "judge_api_key": "xyz"}
    with Tracker(tmp_path, ("recorder",), project="p", config=config, total_steps=3) as t:
        t.log({"a": torch.tensor(2.0)}, step=1)
    assert seen == [
        ("ctx", tmp_path.name, "p", {"lr": 0.1, "judge_api_key": "<redacted>"}, 3),
        (1, {"a": 2.0}),
        "closed",
    ]


def test_non_zero_rank_is_a_noop(tmp_path):
    run_dir = tmp_path / "run"
    t = Tracker(run_dir, backends=("console", "wandb"), rank=1, config={"a": 1})
    t.log({"x": 1.0}, step=1)
    t.log_samples(1, [{"p": "x"}])
    t.close()
    assert not t.active and t.backend_names == []
    assert not run_dir.exists()


def test_console_prints_bar_postfix_and_periodic_table(tmp_path):
    out = io.StringIO()
    with Tracker(tmp_path, ("console",), console_every=2, total_steps=3, console_file=out) as t:
        for step in (1, 2, 3):
            t.log({"reward/mean": step / 4, "acc/mean": 0.5, "other": 7.0}, step=step)
    text = out.getvalue()
    assert "step 1/3" not in text  # tables only every console_every steps ...
    assert "step 2/3\n  reward/mean 0.5   acc/mean    0.5" in text
    assert "step 3/3" in text  # ... and at the last step
    assert "3/3" in text and "reward=0.75" in text and "acc=0.5" in text  # bar and postfix


def test_format_metrics_table_layout():
    metrics = {"reward/mean": 0.25, "actor/kl": 1.5e-05, "time/step": 12.0, "zzz": 1.0}
    assert format_metrics_table(metrics, 7, 10, width=60) == (
        "step 7/10\n  reward/mean    0.25   actor/kl    1.5e-05\n  time/step        12"
    )
    # Nothing matches the patterns: every key is shown rather than an empty table.
    assert format_metrics_table({"b": 2.0, "a": 0.5}, 1) == "step 1\n  a 0.5   b   2"


def test_log_samples(tmp_path):
    with Tracker(tmp_path, backends=()) as t:
        t.log_samples(
            3,
            [
                {
                    "prompt": "1+1",
                    "reward": float("nan"),
                    "ids": torch.tensor([1, 2]),
                    "p": Path("a"),
                }
            ],
        )
        with pytest.raises(TypeError, match="samples row 0.bad: a object cannot be written"):
            t.log_samples(3, [{"bad": object()}])
        with pytest.raises(ValueError, match="samples row 1 has a 'step' key"):
            t.log_samples(3, [{"a": 1}, {"step": 1}])
        with pytest.raises(TypeError, match="rows must be a list of dicts"):
            t.log_samples(3, {"a": 1})
    rows = _strict_rows(tmp_path / "samples.jsonl")
    assert rows == [{"step": 3, "prompt": "1+1", "reward": None, "ids": [1, 2], "p": "a"}]


@dataclasses.dataclass
class _Cfg:
    name: str = "demo"
    out: Path = Path("runs/demo")
    betas: tuple = (0.9, 0.99)
    hf_token: str = "hf_abcdefghijklmnop"


def test_save_config_plain_yaml_with_secrets_redacted(tmp_path):
    path = save_config(tmp_path, {"run": _Cfg(), "data": {"prompt_key": "question"}})
    assert path == tmp_path / "config.yaml"
    assert yaml.safe_load(path.read_text()) == {
        "run": {"name": "demo", "out": "runs/demo", "betas": [0.9, 0.99], "hf_token": "<redacted>"},
        "data": {"prompt_key": "question"},
    }
    with pytest.raises(TypeError, match="config value at 'model.fn' has type function"):
        save_config(tmp_path, {"model": {"fn": lambda: 0}})
    with pytest.raises(TypeError, match="config must be a mapping"):
        save_config(tmp_path, [1, 2])


def test_tensorboard_backend_writes_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(tmp_path, ("tensorboard",)) as t:
        t.log({"reward/mean": 0.5}, step=1)
        t.log({"reward/mean": 0.75}, step=2)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.5), (2, 0.75)]


def _wandb_offline(monkeypatch, tmp_path: Path) -> None:
    """W&B in offline mode, its caches and settings in ``tmp_path``."""
    for var, sub in (
        ("WANDB_CACHE_DIR", "c"),
        ("WANDB_CONFIG_DIR", "cfg"),
        ("WANDB_DATA_DIR", "d"),
    ):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_wandb_offline_needs_no_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    _wandb_offline(monkeypatch, tmp_path)
    run_dir = tmp_path / "run"
    with Tracker(run_dir, ("wandb",), project="gf-test", config={"lr": 0.1}) as t:
        t.log({"reward/mean": 0.5}, step=1)
    assert b"reward/mean" in _wandb_record(run_dir, [b"reward/mean"])


def _wandb_record(run_dir: Path, expected: list[bytes], timeout_s: float = 60.0) -> bytes:
    """The offline run's record file once it holds ``expected``: W&B's service process writes it
    after ``finish()`` has returned (measured: header only at first, the data ~1 s later)."""
    import time

    run_id = (run_dir / "wandb_run_id.txt").read_text().strip()
    (record,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        data = record.read_bytes()
        if all(e in data for e in expected) or time.monotonic() > deadline:
            return data
        time.sleep(0.1)


def test_mlflow_local_file_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    config = {"actor": {"lr": 0.1}, "reward": {"judge_api_key": "secret-value"}}
    with Tracker(tmp_path, ("mlflow",), project="gf-test", config=config) as t:
        t.log({"reward/mean": 0.5}, step=1)
        t.log({"reward/mean": 0.75}, step=2)
    run_id = (tmp_path / "mlflow_run_id.txt").read_text()
    (run_dir,) = (tmp_path / "mlruns").glob(f"*/{run_id}")
    values = [
        line.split()[1:] for line in (run_dir / "metrics/reward/mean").read_text().splitlines()
    ]
    assert values == [["0.5", "1"], ["0.75", "2"]]
    assert (run_dir / "params/actor.lr").read_text() == "0.1"
    assert (run_dir / "params/reward.judge_api_key").read_text() == "<redacted>"


def test_mlflow_file_store_refused_by_mlflow_is_a_clear_error(tmp_path, monkeypatch, capsys):
    mlflow = pytest.importorskip("mlflow")
    from packaging.version import Version

    if Version(mlflow.__version__) < Version("3.17"):
        pytest.skip("MLflow < 3.17 accepts file stores without MLFLOW_ALLOW_FILE_STORE")
    from groupflow.cli.commands import main
    from groupflow.run.tracking_backends import BackendSetupError

    uri = (tmp_path / "store").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(BackendSetupError, match="set it .* or point MLFLOW_TRACKING_URI at a data"):
        Tracker(tmp_path / "run", ("mlflow",), project="gf-test", config={})
    # through the CLI: one paragraph, exit 2
    config = tmp_path / "c.yaml"
    config.write_text("model: {tiny: {hidden_size: 16, num_layers: 1, num_heads: 2}}\n"
                      "data: {task: {name: reverse, num_train: 16, num_val: 4}, prompts_per_step: 2}\n"
                      f"run: {{output_dir: {tmp_path}, loggers: [mlflow], total_steps: 1}}\n")  # fmt: skip
    assert main(["train", str(config), "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"MLFLOW_TRACKING_URI='{uri}' is a file store" in err
    assert "MLFLOW_ALLOW_FILE_STORE=true" in err and "sqlite:///" in err


# ----- every backend with every name the demos log ------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]


def _short_demo(name: str, tmp_path: Path, overrides: dict) -> Path:
    """A few steps of examples/<name>.yaml with every logger on; returns the run directory."""
    from groupflow.config import apply_overrides, config_from_dict
    from groupflow.trainer import Trainer

    data = yaml.safe_load((REPO_ROOT / "examples" / f"{name}.yaml").read_text())
    data = apply_overrides(
        data,
        {
            "run.output_dir": str(tmp_path / "runs"),
            "run.total_steps": 2,
            "run.loggers": ["tensorboard", "wandb", "mlflow"],
            "validation.every_steps": 1,
            **overrides,
        },
    )
    trainer = Trainer(config_from_dict(data, name))
    trainer.fit()
    trainer.shutdown()
    return trainer.run_dir


@pytest.mark.slow
def test_every_backend_takes_every_metric_name_of_both_demos(tmp_path, monkeypatch):
    """The names come from short real runs of the two demos (val/sampled/mean@4 among them):
    MLflow must accept all of them (translated), TensorBoard store them unchanged and W&B get
    its translation; metrics.jsonl keeps the originals."""
    for module in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(module)
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from groupflow.utils.metric_names import MLFLOW, WANDB, NameMap, backend_name

    _wandb_offline(monkeypatch, tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs = [
        _short_demo(
            "reverse_demo",
            tmp_path,
            {"data.task.num_train": 400, "data.task.num_val": 8, "data.prompts_per_step": 4,
             "rollout.samples_per_prompt": 4, "sft.steps": 2},
        ),
        _short_demo(
            "diffusion_demo",
            tmp_path,
            {"diffusion.model.path": str(tmp_path / "tiny-flow"), "diffusion.model.pretrain_steps": 5,
             "data.prompts_per_step": 2, "rollout.samples_per_prompt": 4},
        ),
    ]  # fmt: skip
    all_names = set()
    for run_dir in runs:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        in_order = [k for row in rows for k in row if k not in ("step", "wall_time")]
        names = set(in_order)
        all_names |= names
        mlflow_names = NameMap(MLFLOW)  # replayed in logging order, as the backend saw them
        expected_mlflow = {mlflow_names(n) for n in in_order}
        events = EventAccumulator(str(run_dir / "tensorboard"))
        events.Reload()
        assert set(events.Tags()["scalars"]) == names
        run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
        client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
        assert set(client.get_run(run_id).data.metrics) == expected_mlflow
        wandb_names = [backend_name(n, WANDB).encode() for n in names]
        logged = _wandb_record(run_dir, wandb_names)
        assert all(n in logged for n in wandb_names)
    assert {"val/sampled/mean@4", "val/reward/mean", "reward/mean"} <= all_names
