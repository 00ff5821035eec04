"""End-to-end tests of the GRPO driver on the tiny reverse task (CPU, one thread).

Each test runs a real Trainer for a few steps of a 2-layer model (a step is ~0.1 s) and checks a
property that can be computed by hand or compared against a second run: files written, first
ratio 1, recomputed old log-probs, the reference model, dynamic sampling, micro-batch invariance,
bit-exact resume after SIGKILL, crash safety of checkpoints, the NaN guard and reward failures.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import yaml

from groupflow.config import config_from_dict, load_config
from groupflow.run import checkpoint as ckpt_module
from groupflow.run.rundir import RunDirError
from groupflow.run.tracking import read_metrics
from groupflow.trainer import Trainer
from groupflow.workers import actor as actor_module
from groupflow.workers.actor import ActorRolloutWorker
from groupflow.workers.common import NonFiniteLossError

REQUIRED_METRICS = (
    "reward/mean",
    "reward/std",
    "acc/train",
    "advantages/mean",
    "response_length/mean",
    "response_length/max",
    "response_length/clip_ratio",
    "actor/pg_loss",
    "actor/entropy",
    "actor/clipfrac_low",
    "actor/grad_norm",
    "actor/lr",
    "time/rollout_and_reward",
    "time/update",
    "perf/tokens_per_s",
)


def _steps(run_dir: Path) -> dict[int, dict[str, float]]:
    """Training steps' metrics by step (step 0, logged before training, left out)."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    return {int(r["step"]): r for r in rows if r["step"] > 0}


def _all_steps(run_dir: Path) -> dict[int, dict[str, float]]:
    return {int(r["step"]): r for r in read_metrics(run_dir / "metrics.jsonl")}


def _spy_args(monkeypatch, obj, name: str) -> list:
    """Record the first positional argument of every call to ``obj.name``."""
    seen: list = []
    original = getattr(obj, name)

    def wrapper(arg, *args, **kwargs):
        seen.append(arg)
        return original(arg, *args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)
    return seen


# ----- files and metrics ----------------------------------------------------------------------


def test_three_steps_write_reloadable_config_and_finite_metrics(tiny_config):
    cfg = tiny_config(run__total_steps=3)
    trainer = Trainer(cfg)
    trainer.fit()

    saved = trainer.run_dir / "config.yaml"
    assert load_config(saved).to_dict() == cfg.to_dict()
    rows = _steps(trainer.run_dir)
    assert sorted(rows) == [1, 2, 3]
    for step, row in rows.items():
        missing = [k for k in REQUIRED_METRICS if k not in row]
        assert not missing, f"step {step} lacks {missing}"
        bad = {k: row[k] for k in REQUIRED_METRICS if not math.isfinite(row[k])}
        assert not bad, f"step {step} has non-finite metrics {bad}"
        # 4 prompts × 4 samples, responses of at most 8 tokens
        assert row["batch/samples"] == 16
        assert 1 <= row["response_length/mean"] <= row["response_length/max"] <= 8
        assert 0 <= row["response_length/clip_ratio"] <= 1
        assert row["actor/lr"] == pytest.approx(1e-3)  # constant schedule
    # GRPO advantages are zero-mean within each group, hence over the batch
    assert abs(rows[1]["advantages/mean"]) < 1e-6
    # validation runs after the last step
    assert "val/greedy/acc" in rows[3]


@pytest.mark.parametrize("token_ids", [False, True])
def test_sample_logs_carry_the_trained_token_ids_on_request(tiny_config, token_ids):
    import json

    cfg = tiny_config(run__total_steps=1, run__samples_every=1, run__samples_token_ids=token_ids)
    trainer = Trainer(cfg)
    trainer.fit()
    rows = [json.loads(line) for line in (trainer.run_dir / "samples.jsonl").open()]
    assert len(rows) == 8 and all(r["step"] == 1 for r in rows)
    tok = trainer.policy.tokenizer
    for row in rows:
        if not token_ids:
            assert "response_ids" not in row and "prompt_ids" not in row
            continue
        # the ids are the text the row shows: the prompt, then the completion as sampled
        assert tok.decode(row["prompt_ids"]) == row["prompt"]
        assert tok.decode(row["response_ids"], skip_special_tokens=True) == row["completion"]
        assert 1 <= len(row["response_ids"]) <= 8 and row["response_mask"] == [1] * len(
            row["response_ids"])  # fmt: skip


def test_gradient_checkpointing_gives_the_same_step(tiny_config, tmp_path):
    plain = Trainer(tiny_config(run__total_steps=1, run__name="plain"))
    plain.fit()
    ckpt = Trainer(
        tiny_config(run__total_steps=1, run__name="ckpt", model__gradient_checkpointing=True)
    )
    assert ckpt.policy.actor.model.is_gradient_checkpointing
    ckpt.fit()
    a, b = _steps(plain.run_dir)[1], _steps(ckpt.run_dir)[1]
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


def test_parameters_change_and_final_checkpoint_written(tiny_config):
    cfg = tiny_config(run__total_steps=2, run__save_every=2)
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.policy.actor.model.state_dict().items()}
    trainer.fit()
    after = trainer.policy.actor.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    ckpts = trainer.run_dir / "checkpoints"
    assert (ckpts / "step_2" / "manifest.json").is_file()
    assert (ckpts / "latest").read_text().strip() == "step_2"


@pytest.mark.gpu
def test_steps_on_the_gpu_are_finite_and_resume_replays_them(tiny_config):
    """On CUDA: the worker puts the model on the GPU, every step's metrics are finite, and a run
    resumed from a mid-run checkpoint (CUDA RNG state included) replays the later steps."""
    cfg = tiny_config(run__total_steps=4, run__save_every=2)
    trainer = Trainer(cfg)
    assert next(trainer.policy.actor.model.parameters()).device.type == "cuda"
    trainer.fit()
    rows = _steps(trainer.run_dir)
    assert sorted(rows) == [1, 2, 3, 4]
    for step, row in rows.items():
        bad = {k: row[k] for k in REQUIRED_METRICS if not math.isfinite(row[k])}
        assert not bad, f"step {step} has non-finite metrics {bad}"
    assert rows[1]["actor/grad_norm"] > 0
    ckpts = trainer.run_dir / "checkpoints"
    resumed = Trainer(tiny_config(run__total_steps=4, run__resume=str(ckpts / "step_2")))
    assert resumed.maybe_resume() and resumed.step == 2
    resumed.fit()
    again = _steps(resumed.run_dir)
    for step in (3, 4):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            # GPU reductions may differ in the last bits between two runs; the samples may not
            assert again[step][key] == pytest.approx(rows[step][key], rel=1e-3, abs=1e-6), key


# ----- ratios and log-probs -------------------------------------------------------------------


def test_first_ratio_is_one_with_one_epoch_and_one_mini_batch(tiny_config, monkeypatch, spy):
    trainer = Trainer(tiny_config(run__total_steps=1, rollout__temperature=0.7))
    prepared = spy(trainer.policy, "prepare")
    trainer.fit()
    batch = prepared[0][0]
    # μ = 1, one mini-batch: the rollout's log-probs are used as the old ones, unchanged
    assert batch["old_logprobs"] is batch["rollout_logprobs"]
    row = _steps(trainer.run_dir)[1]
    assert row["actor/ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert row["actor/ratio_min"] == pytest.approx(1.0, abs=1e-6)
    assert row["actor/clipfrac_low"] == 0.0


def test_old_logprobs_recomputed_with_two_epochs_match_rollout(tiny_config, monkeypatch, spy):
    """The log-probs recorded at generation match the training forward (end to end)."""
    # T != 1: both sides must divide the logits by the sampling temperature
    trainer = Trainer(
        tiny_config(run__total_steps=1, actor__ppo_epochs=2, rollout__temperature=0.7)
    )
    prepared = spy(trainer.policy, "prepare")
    trainer.fit()
    batch = prepared[0][0]
    assert batch["old_logprobs"] is not batch["rollout_logprobs"]
    mask = batch["response_mask"].bool()
    diff = (batch["old_logprobs"] - batch["rollout_logprobs"])[mask].abs().max()
    assert float(diff) < 1e-5
    # masked positions are exactly 0 in both
    assert float(batch["old_logprobs"][~mask].abs().sum()) == 0.0


def test_recompute_old_logprobs_always(tiny_config, monkeypatch, spy):
    trainer = Trainer(tiny_config(run__total_steps=1, actor__recompute_old_logprobs="always"))
    prepared = spy(trainer.policy, "prepare")
    trainer.fit()
    assert prepared[0][0]["old_logprobs"] is not prepared[0][0]["rollout_logprobs"]


# ----- KL and the reference model ---------------------------------------------------------------


def test_no_reference_model_without_kl(tiny_config, monkeypatch, spy):
    trainer = Trainer(tiny_config(run__total_steps=1, actor__kl_coef=0.0))
    assert trainer.policy.actor.reference is None
    prepared = spy(trainer.policy, "prepare")
    trainer.fit()
    assert "ref_logprobs" not in prepared[0][0]
    assert "actor/kl_loss" not in _steps(trainer.run_dir)[1]


def test_reference_model_with_kl_is_frozen_and_kl_starts_at_zero(tiny_config):
    trainer = Trainer(tiny_config(run__total_steps=2, actor__kl_coef=0.1))
    ref = trainer.policy.actor.reference.model
    assert ref is not None and ref is not trainer.policy.actor.model
    assert not any(p.requires_grad for p in ref.parameters())
    ref_before = {k: v.clone() for k, v in ref.state_dict().items()}
    trainer.fit()
    rows = _steps(trainer.run_dir)
    # policy == reference at step 1, so every KL estimator is 0 (up to float noise)
    assert rows[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    assert rows[2]["actor/kl_loss"] > 0  # the policy moved, the reference did not
    assert all(torch.equal(ref_before[k], v) for k, v in ref.state_dict().items())


# ----- dynamic sampling ------------------------------------------------------------------------


def test_dynamic_sampling_drops_constant_reward_groups(
    tiny_config, helpers_on_path, monkeypatch, spy
):
    cfg = tiny_config(
        run__total_steps=1,
        algorithm__dynamic_sampling=True,
        algorithm__max_sampling_rounds=4,
        reward__functions=[{"function": "reward_helpers:constant_when_even"}],
    )
    trainer = Trainer(cfg)
    rounds = spy(trainer.workflow, "collect")
    trained = _spy_args(monkeypatch, trainer.policy, "prepare")  # the batch that goes on to update
    trainer.fit()

    def constant_groups(batch) -> int:
        gids, rewards = batch["group_ids"], batch["rewards"]
        return sum(int(rewards[gids == g].max() == rewards[gids == g].min()) for g in gids.unique())

    batch = trained[0]
    assert constant_groups(batch) == 0
    n_groups = int(batch["group_ids"].unique().numel())
    dropped = sum(constant_groups(b) for b, _ in rounds)
    assert dropped >= 1, "the helper reward should make some groups constant"
    row = _steps(trainer.run_dir)[1]
    assert row["sampling/rounds"] == len(rounds)
    assert row["sampling/dropped_groups"] == dropped
    assert row["sampling/kept_groups"] == n_groups
    informative = sum(len(b["group_ids"].unique()) for b, _ in rounds) - dropped
    assert n_groups == min(4, informative)
    assert len(batch) == 4 * n_groups  # whole groups only
    assert row["batch/samples"] == len(batch)


# ----- micro-batch invariance ------------------------------------------------------------------


def _train_ready_batch(trainer: Trainer):
    batch, _ = trainer.collect(0)
    batch, _ = trainer.policy.prepare(batch)
    return trainer.credit(batch, 0)[0]


def _grads_of_one_update(trainer: Trainer, model0, batch, **actor_overrides):
    """Gradients (after clipping) that one update would apply, from a fresh copy of ``model0``."""
    cfg = trainer.cfg.actor.model_copy(update=actor_overrides)
    worker = ActorRolloutWorker(
        copy.deepcopy(model0),
        trainer.policy.tokenizer,
        cfg,
        total_steps=1,
        pad_id=trainer.policy.tokenizer.pad_token_id,
        eos_ids=trainer.policy.actor.eos_ids,
    )
    grads = []
    worker.optimizer.step = lambda *a, **k: grads.append(
        {n: p.grad.clone() for n, p in worker.model.named_parameters() if p.grad is not None}
    )
    metrics = worker.update(batch, temperature=1.0)
    assert len(grads) == 1
    return grads[0], metrics


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize(
    "loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
)
def test_gradient_is_micro_batch_invariant_end_to_end(tiny_config, loss_agg):
    trainer = Trainer(tiny_config(actor__loss_agg=loss_agg, actor__kl_coef=0.05))
    model0 = copy.deepcopy(trainer.policy.actor.model)
    batch = _train_ready_batch(trainer)
    lengths = batch["response_mask"].sum(1)
    assert lengths.min() < lengths.max(), "needs responses of different lengths to mean anything"
    # grad_clip off: compare the raw accumulated gradient
    ref, ref_metrics = _grads_of_one_update(trainer, model0, batch, grad_clip=None)
    assert max(float(g.abs().max()) for g in ref.values()) > 1e-4  # a real gradient
    for split in (
        {"micro_batch_samples": 4},
        {"micro_batch_samples": 2},
        {"micro_batch_samples": 3},  # uneven: 3+3+3+3+3+1
        {"micro_batch_tokens": 60},
    ):
        grads, metrics = _grads_of_one_update(trainer, model0, batch, grad_clip=None, **split)
        assert _max_diff(grads, ref) < 1e-6, split
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), (key, split)


def test_local_token_mean_is_not_micro_batch_invariant(tiny_config):
    """Documents the deliberate exception: the per-micro-batch token mean (TRL "bnpo")."""
    trainer = Trainer(tiny_config(actor__loss_agg="local_token_mean"))
    model0 = copy.deepcopy(trainer.policy.actor.model)
    batch = _train_ready_batch(trainer)
    ref, _ = _grads_of_one_update(trainer, model0, batch, grad_clip=None)
    grads, _ = _grads_of_one_update(trainer, model0, batch, grad_clip=None, micro_batch_samples=2)
    assert _max_diff(grads, ref) > 1e-4


def test_response_length_metrics_count_model_tokens_not_gap_tokens():
    from groupflow.batch import Batch
    from groupflow.workflows.llm import llm_step_metrics

    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1], [1, 0, 1, 0, 0, 0, 0]])  # tool tokens in the gaps
    batch = Batch(
        {"response_mask": mask, "rewards": torch.tensor([1.0, 0.0]),
         "advantages": torch.tensor([0.5, -0.5])},
        {"finish_reason": ["stop", "length"]},
    )  # fmt: skip
    m = llm_step_metrics(batch, 1.0)
    assert m["response_length/mean"] == 3.5 and m["response_length/max"] == 5.0


def test_parameters_after_one_adamw_step_are_micro_batch_invariant(tiny_config):
    trainer = Trainer(tiny_config())
    model0 = copy.deepcopy(trainer.policy.actor.model)
    batch = _train_ready_batch(trainer)
    params = []
    for split in ({}, {"micro_batch_samples": 2}, {"micro_batch_tokens": 60}):
        worker = ActorRolloutWorker(
            copy.deepcopy(model0),
            trainer.policy.tokenizer,
            trainer.cfg.actor.model_copy(update=split),
            total_steps=1,
            pad_id=trainer.policy.tokenizer.pad_token_id,
            eos_ids=trainer.policy.actor.eos_ids,
        )
        worker.update(batch, temperature=1.0)
        params.append({k: v.clone() for k, v in worker.model.state_dict().items()})
    moved = max(float((params[0][k] - v).abs().max()) for k, v in model0.state_dict().items())
    assert moved > 1e-4
    for other in params[1:]:
        assert _max_diff(other, params[0]) < 1e-5


# ----- resume ----------------------------------------------------------------------------------

_TIME_KEYS = ("time/", "perf/", "wall_time")


def _non_time(row: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in row.items() if not k.startswith(_TIME_KEYS)}


def _same_metrics(a: dict[str, float], b: dict[str, float]) -> bool:
    a, b = _non_time(a), _non_time(b)
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a
    )


@pytest.mark.slow
def test_resume_after_sigkill_replays_identical_metrics(
    tiny_config_data, tmp_path, helpers_on_path, train_until_sigkill
):
    reward = {"function": "reward_helpers:pausing_reverse_reward", "label": "reverse"}
    # a warm-up + cosine schedule, so a scheduler restored at the wrong step would show
    common = dict(
        run__total_steps=6,
        run__save_every=2,
        run__keep_last=3,
        actor__lr_schedule="cosine",
        actor__warmup_steps=2,
    )

    # Run A: uninterrupted, in this process.
    data_a = tiny_config_data(run__name="a", reward__functions=[reward], **common)
    Trainer(config_from_dict(data_a)).fit()
    run_a = tmp_path / "a"

    # Run B: a subprocess held inside step 5 once the step-4 checkpoint is complete, then killed.
    run_b = tmp_path / "b"
    marker = run_b / "checkpoints" / "step_4" / "manifest.json"
    paused = {**reward, "kwargs": {"pause_if_exists": str(marker)}}
    data_b = tiny_config_data(run__name="b", reward__functions=[paused], **common)
    config_file = tmp_path / "b.yaml"
    config_file.write_text(yaml.safe_dump(data_b))
    train_until_sigkill(config_file, marker)
    assert max(_steps(run_b)) <= 4  # killed before step 5 was logged
    # step_4, or step_2 if the kill landed before `latest` was switched: both are valid
    latest = ckpt_module.find_latest_checkpoint(run_b / "checkpoints")
    assert latest is not None and latest.name in ("step_2", "step_4")

    # Resume B in this process (the pause disabled: a reward change the resume must be told
    # to accept) and finish steps 5..6.
    resumed = {**reward, "kwargs": {"pause_if_exists": ""}}
    data_b2 = tiny_config_data(
        run__name="b", run__resume="auto", reward__functions=[resumed],
        run__allow_config_changes=["reward.functions.0.kwargs"], **common,
    )  # fmt: skip
    Trainer(config_from_dict(data_b2)).fit()

    a, b = _all_steps(run_a), _all_steps(run_b)
    assert sorted(a) == sorted(b) and sorted(_steps(run_a)) == [1, 2, 3, 4, 5, 6]
    differing = {
        step: sorted(k for k in _non_time(a[step]) if a[step][k] != b[step].get(k))
        for step in a
        if not _same_metrics(a[step], b[step])
    }
    assert not differing, f"metrics differ after resume: {differing}"
    model_a = ckpt_module.load_checkpoint(run_a / "checkpoints" / "step_6")["model"]
    model_b = ckpt_module.load_checkpoint(run_b / "checkpoints" / "step_6")["model"]
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)


def test_crash_while_saving_keeps_previous_checkpoint(tiny_config, monkeypatch):
    cfg = tiny_config(run__total_steps=6, run__save_every=2)
    write_component = ckpt_module._write_component

    class DiskFull(OSError):
        pass

    def failing_write(directory, name, value):
        # mid-save: the model file of step 4 is written, the optimizer's is not
        if directory.name.startswith(".tmp_step_4_") and name == "optimizer":
            raise DiskFull("no space left on device (simulated)")
        return write_component(directory, name, value)

    monkeypatch.setattr(ckpt_module, "_write_component", failing_write)
    first = Trainer(cfg)
    with pytest.raises(DiskFull):
        first.fit()
    ckpts = first.run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_2"]
    logged = _steps(first.run_dir)
    assert sorted(logged) == [1, 2, 3, 4]

    monkeypatch.setattr(ckpt_module, "_write_component", write_component)
    second = Trainer(cfg)  # run.resume defaults to auto
    assert second.maybe_resume() is True
    assert second.step == 2
    second.fit()
    rows = _steps(second.run_dir)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]  # steps 3..4 re-run, not logged twice
    # the re-run steps replay exactly what the crashed run logged
    for step in (3, 4):
        assert _same_metrics(rows[step], logged[step]), step
    assert (ckpts / "latest").read_text().strip() == "step_6"


def test_resume_with_explicit_checkpoint_dir_and_never(tiny_config):
    cfg = tiny_config(run__total_steps=4, run__save_every=2, run__keep_last=2)
    Trainer(cfg).fit()
    ckpts = Path(cfg.run.output_dir) / cfg.run.name / "checkpoints"
    explicit = Trainer(tiny_config(run__total_steps=4, run__resume=str(ckpts / "step_2")))
    assert explicit.maybe_resume() and explicit.step == 2
    # a fresh run into this directory must say that it replaces the run there
    with pytest.raises(RunDirError, match="run.resume=never"):
        Trainer(tiny_config(run__total_steps=4, run__resume="never"))
    never = Trainer(tiny_config(run__total_steps=4, run__resume="never", run__overwrite=True))
    assert never.maybe_resume() is False and never.step == 0
    assert not ckpts.exists()  # the earlier run's checkpoints went with it
    with pytest.raises(FileNotFoundError, match="step_99"):
        Trainer(tiny_config(run__resume=str(ckpts / "step_99")))


# ----- non-finite losses -----------------------------------------------------------------------


def _nan_policy_loss(monkeypatch, nan_on_calls: set[int]):
    """Make the policy loss NaN on the given (0-based) optimizer-step calls."""
    real = actor_module.policy_loss
    calls = {"n": -1}
    real_step = ActorRolloutWorker._optimizer_step

    def counting_step(self, mini, temperature):
        calls["n"] += 1
        return real_step(self, mini, temperature)

    def maybe_nan(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return (loss * float("nan") if calls["n"] in nan_on_calls else loss), metrics

    monkeypatch.setattr(ActorRolloutWorker, "_optimizer_step", counting_step)
    monkeypatch.setattr(actor_module, "policy_loss", maybe_nan)


def test_nonfinite_loss_skips_the_step_and_is_counted(tiny_config, monkeypatch, spy):
    _nan_policy_loss(monkeypatch, nan_on_calls={0, 2})
    trainer = Trainer(tiny_config(run__total_steps=3, actor__max_nonfinite_steps=2))
    updates = spy(trainer.policy.actor, "update")
    trainer.fit()
    rows = _steps(trainer.run_dir)
    assert [rows[s]["actor/nonfinite_skipped"] for s in (1, 2, 3)] == [1.0, 0.0, 1.0]
    assert rows[3]["actor/nonfinite_skipped_total"] == 2.0
    assert trainer.policy.actor.nonfinite.in_a_row == 1  # reset by the finite step 2
    assert len(updates) == 3
    # the last (skipped) step leaves no gradient behind
    assert all(p.grad is None for p in trainer.policy.actor.model.parameters())


def test_skipped_step_does_not_change_parameters(tiny_config, monkeypatch):
    _nan_policy_loss(monkeypatch, nan_on_calls={0})
    trainer = Trainer(tiny_config(run__total_steps=1))
    before = {k: v.clone() for k, v in trainer.policy.actor.model.state_dict().items()}
    trainer.fit()
    after = trainer.policy.actor.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert _steps(trainer.run_dir)[1]["actor/nonfinite_skipped"] == 1.0


def test_too_many_nonfinite_steps_in_a_row_raise(tiny_config, monkeypatch):
    _nan_policy_loss(monkeypatch, nan_on_calls=set(range(100)))
    trainer = Trainer(tiny_config(run__total_steps=5, actor__max_nonfinite_steps=2))
    with pytest.raises(NonFiniteLossError, match=r"2 consecutive.*actor\.max_nonfinite_steps"):
        trainer.fit()
    rows = _steps(trainer.run_dir)
    assert sorted(rows) == [1]  # step 1 skipped and logged; step 2 raised
    assert rows[1]["actor/nonfinite_skipped"] == 1.0


# ----- reward failures -------------------------------------------------------------------------


def test_reward_failing_for_one_sample_does_not_stop_the_step(tiny_config, helpers_on_path):
    reward = {"function": "reward_helpers:fails_on_one_sample", "failure_value": -1.0}
    trainer = Trainer(tiny_config(run__total_steps=2, reward__functions=[reward]))
    trainer.fit()
    rows = _steps(trainer.run_dir)
    for step in (1, 2):
        assert rows[step]["reward/fails_on_one_sample/failures"] == 1.0
        # the failed sample gets the failure value; every other reward is in [0, 1]
        assert rows[step]["reward/min"] == -1.0
        assert rows[step]["reward/max"] <= 1.0
        assert math.isfinite(rows[step]["actor/pg_loss"])


# ----- placement: roles in their own pools ----------------------------------------------------


def test_rollout_and_reference_in_their_own_pools_give_the_colocated_numbers(tiny_config):
    colocated = Trainer(tiny_config(run__name="colo", run__total_steps=2, actor__kl_coef=0.1))
    colocated.fit()
    apart = Trainer(
        tiny_config(
            run__name="apart",
            run__total_steps=2,
            actor__kl_coef=0.1,
            placement__rollout={"workers_per_node": 1},
            placement__reference={"workers_per_node": 1},
        )
    )
    p = apart.policy
    assert p.rollout is not p.actor and p.reference is not p.actor
    assert p.actor.reference is None  # the reference lives only in its own worker
    apart.fit()
    a, c = _steps(apart.run_dir), _steps(colocated.run_dir)
    for step in (1, 2):
        assert a[step]["reward/mean"] == c[step]["reward/mean"]  # the same tokens were sampled
        # log-probs from another (identical) model object: equal up to float summation order
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
            assert a[step][k] == pytest.approx(c[step][k], rel=1e-5, abs=1e-7), (step, k)
    # the rollout worker holds the actor's updated weights, the reference the initial ones
    trained = apart.policy.actor.model.state_dict()
    assert all(
        torch.equal(v, trained[k]) for k, v in apart.policy.rollout.model.state_dict().items()
    )
    assert not all(
        torch.equal(v, trained[k]) for k, v in apart.policy.reference.model.state_dict().items()
    )
    assert "time/weight_transfer" in a[1]
    # the driver received the full weights and pushed them to the pool: every byte passed it
    nbytes = sum(v.numel() * v.element_size() for v in trained.values())
    assert a[1]["weights/bytes_via_driver"] == nbytes
    assert c[1]["weights/bytes_via_driver"] == 0  # colocated: nothing moves


def test_reference_is_the_warm_started_policy_and_survives_resume(tiny_config, tmp_path):
    overrides = dict(actor__kl_coef=0.1, sft__steps=5, sft__batch_samples=16)
    full = Trainer(tiny_config(run__name="full", run__total_steps=3, **overrides))
    full.fit()
    rows = _steps(full.run_dir)
    # RL starts from the warm-started policy and so does the reference: KL is 0 at step 1
    assert rows[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    part = tiny_config(run__name="part", run__total_steps=2, run__save_every=2, **overrides)
    Trainer(part).fit()
    Trainer(tiny_config(run__name="part", run__total_steps=3, **overrides)).fit()
    resumed = _steps(tmp_path / "part")
    for k in ("actor/kl_loss", "actor/pg_loss", "reward/mean"):
        assert resumed[3][k] == rows[3][k], k
