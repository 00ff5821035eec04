"""The driver (single controller): collect → prepare → advantages → update → sync, one stage per line.

Design decision: ``fit`` reads like the algorithm and holds no tensor math and no knowledge of
what is being trained. Experience comes from a *workflow* (single-turn, multi-turn with tools,
diffusion — ``groupflow.workflows``), training goes to a *policy* (its worker groups —
``groupflow.policies``), advantages from the shared credit stage (``groupflow.credit``); every
batch is validated against the stage contract at each boundary, so a broken reward function,
environment or custom estimator is reported where it happened. This file decides only *what
happens in which order*, plus validation, logging and checkpoints. Where a step's batch comes
from is a *rollout source* (``groupflow.rollout.source``): collected now with the current weights,
or — ``rollout.max_staleness`` — ahead on the rollout side with a scheduled older version; the
loop asks it for the batch of step s and tells it after each update, and never asks which it is.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from groupflow.assembly.models import resolve_hub_models
from groupflow.batch import Batch
from groupflow.config import Config
from groupflow.config.presets import preset_note, preset_report
from groupflow.contracts import check_staleness, validate
from groupflow.credit import CreditAssignment
from groupflow.evals import get_benchmark
from groupflow.evals.runner import run_benchmark
from groupflow.rollout.source import RolloutSource, build_rollout_source
from groupflow.run.checkpoint import (
    capture_rng_state,
    find_latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from groupflow.run.health import CollapseMonitor
from groupflow.run.rundir import plain_config, prepare_run_dir
from groupflow.run.tracking import Tracker
from groupflow.utils.main_guard import refuse_run_in_child
from groupflow.utils.seeds import sample_seed
from groupflow.utils.timing import StageTimer
from groupflow.workflows import close_run
from groupflow.workflows.build import build_run, check_paths
from groupflow.workflows.collect import Sampling, collect_step, prompt_loader

log = logging.getLogger("groupflow")

__all__ = ["Trainer"]


def sample_rows(batch: Batch, token_ids: bool = False, count: int = 8) -> list[dict]:
    """The first ``count`` samples as ``samples.jsonl`` logs them: prompt, completion (or the
    trajectory) and rewards; with ``token_ids`` also ``prompt_ids``, ``response_ids`` (the
    response through its last sampled token, tool observations included) and ``response_mask``
    (1: a sampled token) — exactly the ids the update trains on."""
    keys = [k for k in ("prompt", "completion", "trajectory", "rewards") if k in batch]
    rows = batch.rows(keys)[:count]
    if token_ids and "responses" in batch:
        for i, row in enumerate(rows):
            mask = batch["response_mask"][i].bool()
            end = int(mask.nonzero().max()) + 1 if mask.any() else 0
            if "prompt_ids" in batch:
                kept = batch["prompt_mask"][i].bool() if "prompt_mask" in batch else slice(None)
                row["prompt_ids"] = batch["prompt_ids"][i][kept].tolist()
            row["response_ids"] = batch["responses"][i][:end].tolist()
            row["response_mask"] = mask[:end].int().tolist()
    return rows


def check_benchmark_names(cfg: Config) -> None:
    """``validation.benchmarks`` names known benchmarks, on an LLM policy."""
    names = cfg.validation.benchmarks
    if names and not cfg.kind.writes_text:
        raise ValueError("validation.benchmarks: named benchmarks evaluate LLM policies only")
    for name in names:
        try:
            get_benchmark(name)
        except ValueError as e:
            raise ValueError(f"validation.benchmarks: {e}") from None


class Trainer:
    """The driver. ``inference_run_dir``: build the workers to evaluate or sample a finished run
    (its tokenizer comes from that directory), leaving the directory as it is; such a trainer
    does not train. ``inputs``: reward callables and datasets as Python objects
    (``assembly.data.PythonInputs``; ``groupflow.Run`` builds it)."""

    def __init__(self, cfg: Config, *, inference_run_dir: str | Path | None = None, inputs=None):
        refuse_run_in_child()  # a spawned child re-running the user's script: leave the run dir
        self.cfg = cfg
        self.inference = inference_run_dir is not None
        self.run_dir = Path(inference_run_dir or Path(cfg.run.output_dir) / cfg.run.name)
        check_benchmark_names(cfg)  # a misspelt validation.benchmarks name fails before any load
        # Hub ids become local snapshot directories for building; self.cfg keeps the ids
        built_cfg = resolve_hub_models(cfg)
        check_paths(built_cfg)  # a missing model directory fails now, not mid-run
        # Fresh start or resume is decided before the tokenizer is read: a fresh run never
        # reuses an old run's files, a resume never continues under a different config.
        self.resume_from = None if self.inference else prepare_run_dir(cfg, self.run_dir)
        if cfg.algorithm.preset and not self.inference:  # what the one key set, and what won
            name = cfg.algorithm.preset
            note = f" (not set by the preset: {preset_note(name)})" if preset_note(name) else ""
            log.info("algorithm.preset=%s: %s%s", name, "; ".join(preset_report(cfg)), note)
        self._resumed_once = False
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.run.num_threads:
            torch.set_num_threads(cfg.run.num_threads)
        torch.manual_seed(cfg.run.seed)
        self.step = 0
        self.tracker: Tracker | None = None
        self.policy, self.workflow, self.data_stats = build_run(built_cfg, self.run_dir, inputs)
        self.contracts = self.workflow.contracts
        # a diffusion teacher is a loss term in the actor (groupflow.diffusion.distillation)
        teacher = None if cfg.kind.teacher_in_actor else cfg.teacher
        self.credit = CreditAssignment(cfg.algorithm, cfg.run.seed, teacher)
        # warns once if the policy dies (e.g. a far too high actor.lr)
        self.collapse = CollapseMonitor(cfg.actor.lr, getattr(self.policy, "max_entropy", None))
        self.loader = prompt_loader(cfg, self.workflow.train_rows)
        # Where batches come from: collected now (synchronous), or ahead on the rollout side with
        # scheduled older weights (rollout.max_staleness = k >= 1; groupflow.rollout.source).
        self.max_staleness = cfg.rollout.max_staleness
        self.source: RolloutSource = build_rollout_source(
            cfg, built_cfg, self.run_dir, self.policy, self.workflow, self.loader, inputs
        )

    # ----- the loop -------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        cfg = self.cfg
        if self.inference:
            raise RuntimeError("a Trainer built with inference_run_dir does not train")
        resumed = self.maybe_resume()
        if resumed and self.step >= cfg.run.total_steps:
            log.warning(
                "run %s already reached run.total_steps=%d: nothing to train (raise run.total_steps "
                "to continue it, or set run.overwrite=true to start it again)",
                self.run_dir, cfg.run.total_steps,
            )  # fmt: skip
        self.tracker = Tracker(
            self.run_dir, backends=["jsonl", *cfg.run.loggers], run_name=cfg.run.name,
            config=cfg.to_dict(), console_every=cfg.run.console_every,
            total_steps=cfg.run.total_steps, resume_step=self.step if resumed else None,
        )  # fmt: skip
        last: dict[str, float] = {}
        try:
            self.policy.sync(self.step)
            if not resumed:
                self.tracker.log(self.before_training(), step=0)
            self.source.start(self.step)
            while self.step < cfg.run.total_steps:
                batch, last = self.train_step()
                if self._due(cfg.validation.every_steps) or self.step == cfg.run.total_steps:
                    last.update(self.validation_metrics())
                self.tracker.log(last, step=self.step)
                if self._due(cfg.run.samples_every):
                    self.tracker.log_samples(
                        self.step, sample_rows(batch, cfg.run.samples_token_ids)
                    )
                if self._due(cfg.run.save_every) or (
                    self.step == cfg.run.total_steps and cfg.run.save_final
                ):
                    self.save()
        finally:
            self.source.close()
            self.tracker.close()
        return last

    def train_step(self) -> tuple[Batch, dict[str, float]]:
        """One step: collect (rollout + rewards) → old/ref log-probs, values → advantages → update."""
        timer = StageTimer()
        with timer("step"):
            with timer("rollout_and_reward"):  # asynchronous: the wait for the batch
                batch, collect_metrics = self.source.batch(self.step)
            check_staleness(batch, current=self.step, max_staleness=self.max_staleness)
            batch, prepare_metrics = self.policy.prepare(batch, timer)
            with timer("advantages"):
                batch, credit_metrics = self.credit(batch, self.step)
                batch = validate(batch, self.contracts["advantaged"])
            with timer("update"):
                seed = sample_seed(self.cfg.run.seed, self.step, -1)
                batch = validate(batch, self.contracts["train_ready"])
                update_metrics = self.policy.update(batch, step=self.step, seed=seed)
            with timer("weight_transfer"):
                transfer_metrics = self.source.after_update(self.step + 1)
        self.step += 1
        metrics = self.workflow.step_metrics(batch, timer.seconds("step"))
        for stage in (collect_metrics, prepare_metrics, credit_metrics, update_metrics,
                      transfer_metrics, timer.metrics()):  # fmt: skip
            metrics.update(stage)
        self.collapse.observe(metrics, batch["advantages"])
        return batch, metrics

    def collect(self, step: int, version: int | None = None) -> tuple[Batch, dict[str, float]]:
        """Rollout + reward for one step with the weights of ``version`` (default ``step``: the
        policy has taken ``step`` updates), dynamic-sampling refills included."""
        version = step if version is None else version
        sampling = Sampling.from_config(self.cfg)
        return collect_step(self.workflow, self.loader, sampling, step, version)

    def before_training(self) -> dict[str, float]:
        """Data statistics, the optional warm start, and the baseline validation."""
        metrics = dict(self.data_stats)
        warm = self.workflow.warm_start()
        metrics.update(warm)
        self.policy.begin(warm_started=bool(self.cfg.sft.steps))
        if self.cfg.validation.before_training:
            metrics.update(self.validation_metrics())
        return metrics

    def validation_metrics(self) -> dict[str, float]:
        """The workflow's held-out metrics plus ``bench/<name>/<metric>`` of each of
        ``validation.benchmarks`` (greedy, on the policy's rollout engine)."""
        metrics = self.workflow.validate(self.step)
        v = self.cfg.validation
        for name in v.benchmarks:
            result = run_benchmark(self.policy, name, limit=v.benchmark_limit, seed=self.cfg.run.seed,
                                   max_new_tokens=v.benchmark_max_new_tokens,
                                   use_chat_template=self.cfg.data.use_chat_template,
                                   progress_label=f"bench {name}", leave=False)  # fmt: skip
            metrics.update({f"bench/{name}/{k}": val for k, val in result.metrics.items()})
        return metrics

    def validate(self, return_records: bool = False, progress_label: str = "validation"):
        """Held-out metrics (and per-sample records); progress shows as ``progress_label``."""
        return self.workflow.validate(
            self.step, return_records=return_records, progress_label=progress_label
        )

    def shutdown(self) -> None:
        """Close the workflow's own resources (the agent workflow's server and event loop), then
        stop every worker group (Ray actors and their resource pools)."""
        close_run(self.workflow, self.policy)

    def _due(self, every: int) -> bool:
        return bool(every) and self.step % every == 0

    # ----- checkpoints ----------------------------------------------------------------------------
    def save(self) -> Path:
        """Atomic checkpoint: policy (one file set, or every rank's shards), credit state, loader,
        RNG, step."""
        state, writers = self.policy.state()
        state.update(self.credit.state_dict())
        state.update(self.source.state(self.step))  # the loader (+ in-flight versions' weights)
        state["rng"] = capture_rng_state()
        state["trainer_state"] = {"step": self.step}
        state["config"] = plain_config(self.cfg)  # what a resume compares its config with
        root = self.run_dir / "checkpoints"
        return save_checkpoint(
            root, self.step, state, keep_last=self.cfg.run.keep_last, writers=writers
        )

    def maybe_resume(self) -> bool:
        """Load the checkpoint ``prepare_run_dir`` chose at construction; False: a fresh run.

        Called again (a second ``fit()`` of this trainer, e.g. after a failed step), it continues
        this trainer's own run from its newest checkpoint."""
        path = self.resume_from
        if self._resumed_once:
            path = find_latest_checkpoint(self.run_dir / "checkpoints")
        self._resumed_once = True
        if path is None:
            return False
        state = load_checkpoint(path)
        self.policy.load(state, path)
        self.credit.load_state_dict(state)
        self.source.load_state(state)
        restore_rng_state(state["rng"])
        self.step = int(state["trainer_state"]["step"])
        log.info("resumed from %s at step %d", path, self.step)
        return True
