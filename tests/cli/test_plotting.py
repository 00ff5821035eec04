import json
import math
import struct
from pathlib import Path

import pytest

from groupflow.cli.plotting import (
    PANELS,
    Panel,
    _draw_runs,
    _new_figure,
    _trailing_mean,
    plot_run,
    plot_runs,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, after checking the signature: a real PNG, not just a file."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    assert data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def _write_run(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row) + "\n" for row in rows)
    (run_dir / "metrics.jsonl").write_text(text)


def _rl_rows(n: int) -> list[dict]:
    rows = []
    for step in range(1, n + 1):
        row = {
            "step": step,
            "wall_time": step * 0.5,
            "reward/mean": step / n,
            "reward/std": 0.1,
            "reward/correct": step / n,
            "reward/format": 0.9,
            "reward/failed_count": 0,
            "acc/mean": step / n,
            "actor/kl": 0.01 * step if step != 3 else None,
            "actor/pg_loss": (-1) ** step * 0.1,
            "actor/entropy": 2.0 - step / n,
            "actor/grad_norm": 1.0,
            "response_length/mean": 10 + step,
            "time/step": 0.5,
        }
        rows.append(row)
        if step % 5 == 0:
            # validation on its own line (an LLM's accuracy, a diffusion policy's reward)
            rows.append({"step": step, "val/acc": step / n, "val/reward/mean": step / n})
    return rows


def test_plot_run_writes_every_panel_and_an_overview(tmp_path):
    _write_run(tmp_path, _rl_rows(30))
    paths = plot_run(tmp_path)
    names = [p.name for p in paths]
    assert names == [f"{panel.name}.png" for panel in PANELS] + ["overview.png"]
    assert all(p.parent == tmp_path / "plots" for p in paths)
    single_w, single_h = _png_size(paths[0])
    overview_w, overview_h = _png_size(paths[-1])
    assert single_w > 400 and single_h > 300
    assert overview_w > single_w and overview_h > single_h  # 3 x 3 grid of 8 panels


def test_missing_metrics_give_fewer_panels(tmp_path):
    _write_run(
        tmp_path,
        [{"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.3, "actor/kl": 0.01}],
    )
    out = tmp_path / "custom_out"
    paths = plot_run(tmp_path, out_dir=out)
    assert [p.name for p in paths] == ["reward.png", "kl.png", "overview.png"]
    for p in paths:
        assert p.parent == out
        _png_size(p)


def test_a_diffusion_run_of_0_steps_plots_its_validation_reward(tmp_path):
    """The online test runs before the first step: all a 0-step run logs besides data counts."""
    _write_run(tmp_path, [{"step": 0, "data/train_rows": 6, "val/reward/mean": 0.6,
                           "val/reward/target_color/mean": 0.6, "val/seconds": 0.1}])  # fmt: skip
    assert [p.name for p in plot_run(tmp_path)] == ["val_reward.png", "overview.png"]
    keys = next(p for p in PANELS if p.name == "val_reward").keys(
        ["val/reward/mean", "val/reward/std", "val/reward/target_color/mean", "val/sampled/reward"]
    )
    assert keys == ["val/reward/mean", "val/reward/target_color/mean"]


def test_custom_metric_patterns(tmp_path):
    _write_run(tmp_path, _rl_rows(5))
    paths = plot_run(tmp_path, metrics=["time/*", "actor/grad_norm"])
    assert [p.stem for p in paths] == ["time", "actor_grad_norm", "overview"]


def test_missing_or_empty_metrics_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl in .*groupflow run directory"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="is empty: the run has not logged any step yet"):
        plot_run(tmp_path)
    _write_run(tmp_path, [{"step": 1, "custom/thing": 1.0}])
    with pytest.raises(ValueError, match=r"logged metrics: \['custom/thing'\]\. Pass metrics="):
        plot_run(tmp_path)
    assert not (tmp_path / "plots").exists()


def test_panel_key_selection_order_and_exclusions():
    reward = PANELS[0]
    keys = [
        "reward/std",
        "reward/format",
        "reward/mean",
        "reward/correct",
        "reward/failed_count",
        "acc/mean",
    ]
    assert reward.keys(keys) == ["reward/mean", "reward/correct", "reward/format"]
    accuracy = Panel("accuracy", "Accuracy", ("acc/*", "val/*acc*"))
    assert accuracy.keys(["val/loss", "val/gsm8k/acc", "acc/mean", "val/accuracy"]) == [
        "acc/mean",
        "val/accuracy",
        "val/gsm8k/acc",
    ]


def test_trailing_mean_skips_nan():
    out = _trailing_mean([math.nan, 1.0, 3.0, math.nan, 5.0], window=2)
    assert math.isnan(out[0])
    assert out[1:] == [1.0, 2.0, 2.0, 4.0]


def test_plot_runs_draws_one_curve_per_run_for_each_metric(tmp_path):
    seed0, control = tmp_path / "seed0", tmp_path / "control"
    _write_run(seed0, _rl_rows(10))
    _write_run(control, [{"step": 1, "reward/mean": 0.2}, {"step": 2, "reward/mean": 0.1}])
    paths = plot_runs([seed0, control], tmp_path / "cmp")
    # val/acc (seed0 only), reward/mean (both), response_length/mean (seed0 only)
    assert [p.name for p in paths] == [
        "val_acc.png", "reward_mean.png", "response_length_mean.png", "overview.png",
    ]  # fmt: skip
    for p in paths:
        _png_size(p)
    ax = _new_figure(6, 4).add_subplot()
    _draw_runs(
        ax, [_rl_rows(10), [{"step": 1, "reward/mean": 0.2}]], ["seed0", "control"], "reward/mean"
    )
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"seed0", "control"}
    assert list(lines["seed0"].get_xdata()) == list(range(1, 11))
    assert list(lines["control"].get_ydata()) == [0.2]


def test_plot_runs_leaves_out_a_breakdown_that_repeats_its_total(tmp_path):
    def rows(per_source_b):
        return [
            {"step": s, "val/acc": a, "val/acc/src_a": a, "val/acc/src_b": b}
            for s, a, b in ((0, 0.1, per_source_b[0]), (20, 0.5, per_source_b[1]))
        ]

    # one run's src_b differs from the total: it stays; src_a repeats it in both runs: left out
    _write_run(tmp_path / "a", rows((0.1, 0.5)))
    _write_run(tmp_path / "b", rows((0.1, 0.4)))
    names = [p.name for p in plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "cmp")]
    assert names == ["val_acc.png", "val_acc_src_b.png", "overview.png"]


def test_plot_runs_bad_input(tmp_path):
    _write_run(tmp_path / "a", _rl_rows(3))
    with pytest.raises(ValueError, match="compares two or more runs"):
        plot_runs([tmp_path / "a"], tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl in .*missing"):
        plot_runs([tmp_path / "a", tmp_path / "missing"], tmp_path / "out")
    _write_run(tmp_path / "b", _rl_rows(3))
    with pytest.raises(
        ValueError, match=r"no metric of the runs matches the patterns \['nope/\*'\]"
    ):
        plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "out", metrics=["nope/*"])
