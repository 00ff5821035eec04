"""The driver (single controller): collect → prepare → advantages → update → sync, one stage per line.

Design decision: ``fit`` reads like the algorithm and holds no tensor math and no knowledge of
what is being trained. Experience comes from a *workflow* (single-turn, multi-turn with tools,
diffusion — ``groupflow.workflows``), training goes to a *policy* (its worker groups —
``groupflow.policies``), advantages from the shared credit stage (``groupflow.credit``); every
batch is validated against the stage contract at each boundary, so a broken reward function,
environment or custom estimator is reported where it happened. This file decides only *what
happens in which order*, plus validation, logging and checkpoints. With ``rollout.max_staleness``
the collect stage runs ahead in the background (``groupflow.async_rollout``) on the deterministic
schedule; the loop is otherwise the same.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from groupflow.async_rollout import AsyncRollout, schedule_version
from groupflow.batch import Batch
from groupflow.builders import resolve_hub_models
from groupflow.checkpoint import (
    capture_rng_state,
    find_latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from groupflow.config import Config
from groupflow.contracts import check_staleness, validate
from groupflow.credit import CreditAssignment
from groupflow.data import PromptLoader
from groupflow.health import CollapseMonitor
from groupflow.rundir import plain_config, prepare_run_dir
from groupflow.tracking import Tracker
from groupflow.utils.seeds import sample_seed
from groupflow.utils.timing import StageTimer
from groupflow.workflows import build_run, check_paths

log = logging.getLogger("groupflow")

__all__ = ["Trainer"]


class Trainer:
    """The driver. ``inference_run_dir``: build the workers to evaluate or sample a finished run
    (its tokenizer comes from that directory), leaving the directory as it is; such a trainer
    does not train. ``inputs``: reward callables and datasets as Python objects
    (``builders.PythonInputs``; ``groupflow.Run`` builds it)."""

    def __init__(self, cfg: Config, *, inference_run_dir: str | Path | None = None, inputs=None):
        self.cfg = cfg
        self.inference = inference_run_dir is not None
        self.run_dir = Path(inference_run_dir or Path(cfg.run.output_dir) / cfg.run.name)
        # Hub ids become local snapshot directories for building; self.cfg keeps the ids
        built_cfg = resolve_hub_models(cfg)
        check_paths(built_cfg)  # a missing model directory fails now, not mid-run
        # Fresh start or resume is decided before the tokenizer is read: a fresh run never
        # reuses an old run's files, a resume never continues under a different config.
        self.resume_from = None if self.inference else prepare_run_dir(cfg, self.run_dir)
        self._resumed_once = False
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.run.num_threads:
            torch.set_num_threads(cfg.run.num_threads)
        torch.manual_seed(cfg.run.seed)
        self.step = 0
        self.tracker: Tracker | None = None
        self.policy, self.workflow, self.data_stats = build_run(built_cfg, self.run_dir, inputs)
        self.contracts = self.workflow.contracts
        self.credit = CreditAssignment(cfg.algorithm, cfg.run.seed)
        # warns once if the policy dies (e.g. a far too high actor.lr)
        self.collapse = CollapseMonitor(cfg.actor.lr, getattr(self.policy, "max_entropy", None))
        self.loader = PromptLoader(
            self.workflow.train_rows, cfg.data.prompts_per_step, seed=cfg.run.seed,
            shuffle=cfg.data.shuffle, drop_last=cfg.data.drop_last,
        )  # fmt: skip
        # Asynchronous rollout (rollout.max_staleness = k >= 1): the batches of the next k steps
        # are generated in the background, each with the weights of its scheduled version.
        self.max_staleness = cfg.rollout.max_staleness
        self.rollouts: AsyncRollout | None = None
        self.snapshots: dict[int, dict] = {}  # version -> weights, while a batch in flight needs it
        # rollout.async_mode=eager: (version, weights) of the newest snapshot, read by the rollout
        # thread (one attribute, replaced whole: no lock needed)
        self.newest_snapshot: tuple[int, dict] | None = None

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
            self.policy.sync()
            if not resumed:
                self.tracker.log(self.before_training(), step=0)
            if self.max_staleness:
                self.start_rollouts()
            while self.step < cfg.run.total_steps:
                batch, last = self.train_step()
                if self._due(cfg.validation.every_steps) or self.step == cfg.run.total_steps:
                    last.update(self.workflow.validate(self.step))
                self.tracker.log(last, step=self.step)
                if self._due(cfg.run.samples_every):
                    keys = [
                        k for k in ("prompt", "completion", "trajectory", "rewards") if k in batch
                    ]
                    self.tracker.log_samples(self.step, batch.rows(keys)[:8])
                if self._due(cfg.run.save_every) or (
                    self.step == cfg.run.total_steps and cfg.run.save_final
                ):
                    self.save()
        finally:
            if self.rollouts is not None:
                self.rollouts.close()
                self.rollouts = None
            self.tracker.close()
        return last

    def train_step(self) -> tuple[Batch, dict[str, float]]:
        """One step: collect (rollout + rewards) → old/ref log-probs, values → advantages → update."""
        timer = StageTimer()
        with timer("step"):
            with timer("rollout_and_reward"):  # asynchronous: the wait for the batch
                if self.rollouts is None:
                    batch, sampling_metrics = self.collect(self.step)
                else:
                    batch, sampling_metrics = self.rollouts.result(self.step)
            check_staleness(batch, current=self.step, max_staleness=self.max_staleness)
            batch = self.policy.prepare(batch, timer)
            with timer("advantages"):
                batch = validate(self.credit(batch, self.step), self.contracts["advantaged"])
            with timer("update"):
                seed = sample_seed(self.cfg.run.seed, self.step, -1)
                batch = validate(batch, self.contracts["train_ready"])
                update_metrics = self.policy.update(batch, step=self.step, seed=seed)
            with timer("weight_sync"):
                if self.rollouts is None:
                    self.policy.sync()
                else:
                    self.submit_next()
        self.step += 1
        metrics = self.workflow.step_metrics(batch, timer.seconds("step"))
        metrics = {**metrics, **sampling_metrics, **update_metrics, **timer.metrics()}
        if self.max_staleness:
            metrics["async/staleness"] = self.step - 1 - float(batch["version"].float().mean())
        self.collapse.observe(metrics, batch["advantages"])
        return batch, metrics

    def collect(self, step: int, version: int | None = None) -> tuple[Batch, dict[str, float]]:
        """Rollout + reward for one step with the weights of ``version`` (default ``step``: the
        policy has taken ``step`` updates); with dynamic sampling, refill zero-signal groups (DAPO)
        — with the same weights, so refills count against the staleness bound."""
        cfg = self.cfg
        version = step if version is None else version
        batch = self.workflow.collect(self.loader.next_batch(), step, 0, version)
        if not cfg.algorithm.dynamic_sampling:
            return batch, {}
        kept, dropped, rounds = [], 0, 0
        while True:
            informative = informative_groups(batch)
            dropped += int(batch["group_ids"].unique().numel()) - len(informative)
            kept.append(batch.index(torch.isin(batch["group_ids"], torch.tensor(informative))))
            rounds += 1
            have = sum(int(b["group_ids"].unique().numel()) for b in kept)
            if have >= cfg.data.prompts_per_step or rounds >= cfg.algorithm.max_sampling_rounds:
                break
            rows = self.loader.take(cfg.data.prompts_per_step - have)
            batch = self.workflow.collect(rows, step, rounds, version)
        batch = Batch.concat([b for b in kept if len(b)] or [batch])
        batch = first_groups(batch, cfg.data.prompts_per_step)
        return batch, {
            "sampling/rounds": rounds,
            "sampling/dropped_groups": dropped,
            "sampling/kept_groups": int(batch["group_ids"].unique().numel()),
        }

    # ----- asynchronous rollout ------------------------------------------------------------------
    def start_rollouts(self) -> None:
        """Start the background rollout and submit the batches of steps step..step+k (after a
        resume: regenerated from the checkpoint's weight snapshots)."""
        k, total = self.max_staleness, self.cfg.run.total_steps
        self.policy.start_async()
        self.snapshots[self.step] = self.policy.snapshot()
        self.newest_snapshot = (self.step, self.snapshots[self.step])
        eager = self.cfg.rollout.async_mode == "eager"
        self.rollouts = AsyncRollout(
            self.collect, self.policy.push_snapshot, self.loader.state_dict,
            timeout_s=self.cfg.run.worker_timeout_s,
            newest=(lambda: self.newest_snapshot) if eager else None,
        )  # fmt: skip
        previous = None
        for t in range(self.step, min(self.step + k + 1, total)):
            v = schedule_version(t, k)
            if v not in self.snapshots:
                raise RuntimeError(
                    f"no weights of policy version {v} to generate the batch of step {t} "
                    f"(rollout.max_staleness={k}): the checkpoint resumed from keeps the "
                    "snapshots of the staleness it was written with; resume with that value"
                )
            self.rollouts.submit(t, v, self.snapshots[v] if v != previous else None)
            previous = v

    def submit_next(self) -> None:
        """After the update of step s (version s+1 now exists): snapshot it and submit the batch
        of step s+1+k with its scheduled version (s+1)."""
        k, version = self.max_staleness, self.step + 1
        self.snapshots[version] = self.policy.snapshot()
        self.newest_snapshot = (version, self.snapshots[version])
        for v in [v for v in self.snapshots if v < schedule_version(version, k)]:
            del self.snapshots[v]  # no batch in flight needs it
        t = version + k
        if t < self.cfg.run.total_steps:
            v = schedule_version(t, k)
            self.rollouts.submit(t, v, self.snapshots[v])

    def before_training(self) -> dict[str, float]:
        """Data statistics, the optional warm start, and the baseline validation."""
        metrics = dict(self.data_stats)
        warm = self.workflow.warm_start()
        metrics.update(warm)
        self.policy.begin(warm_started=bool(self.cfg.sft.steps))
        if self.cfg.validation.before_training:
            metrics.update(self.workflow.validate(self.step))
        return metrics

    def validate(self, return_records: bool = False, progress_label: str = "validation"):
        """Held-out metrics (and per-sample records); progress shows as ``progress_label``."""
        return self.workflow.validate(
            self.step, return_records=return_records, progress_label=progress_label
        )

    def shutdown(self) -> None:
        """Stop every worker group (Ray actors and their resource pools)."""
        self.policy.shutdown()

    def _due(self, every: int) -> bool:
        return bool(every) and self.step % every == 0

    # ----- checkpoints ----------------------------------------------------------------------------
    def save(self) -> Path:
        """Atomic checkpoint: policy (one file set, or every rank's shards), credit state, loader,
        RNG, step."""
        state, writers = self.policy.state()
        state.update(self.credit.state_dict())
        state["loader"] = self.loader.state_dict()
        if self.max_staleness and self.snapshots:
            # A resume draws the next k+1 batches again (in flight now, or not yet submitted at
            # the last step: a resume may raise run.total_steps), each with its version's
            # weights, kept here; the loader as the next step's batch found it.
            if self.rollouts is not None and self.step in self.rollouts.in_flight():
                state["loader"] = self.rollouts.loader_state_before(self.step)
            k = self.max_staleness
            versions = sorted({schedule_version(t, k) for t in range(self.step, self.step + k + 1)}
                              - {self.step})  # fmt: skip
            state["async_rollout"] = {"versions": versions}
            state.update({f"rollout_weights_v{v}": self.snapshots[v] for v in versions})
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
        self.loader.load_state_dict(state["loader"])
        restore_rng_state(state["rng"])
        self.step = int(state["trainer_state"]["step"])
        versions = state.get("async_rollout", {}).get("versions", [])
        self.snapshots = {int(v): state[f"rollout_weights_v{v}"] for v in versions}
        log.info("resumed from %s at step %d", path, self.step)
        return True


# ----- dynamic sampling helpers (pure) --------------------------------------------------------------


def informative_groups(batch: Batch) -> list[int]:
    """Groups whose rewards are not all equal (the rest carry no GRPO signal)."""
    gids, rewards = batch["group_ids"], batch["rewards"]
    out = []
    for g in gids.unique().tolist():
        r = rewards[gids == g]
        if r.numel() > 1 and float(r.max() - r.min()) > 0:
            out.append(g)
    return out


def first_groups(batch: Batch, k: int) -> Batch:
    order = list(dict.fromkeys(batch["group_ids"].tolist()))[:k]
    return batch.index(torch.isin(batch["group_ids"], torch.tensor(order)))
