"""The driver (single controller): rollout → reward → advantages → update, one stage per line.

Design decision: ``fit`` reads like the algorithm and holds no tensor math. Each stage is a method
that returns a Batch, and the Batch is validated against the stage contract at every boundary, so
a broken reward function or custom estimator is reported where it happened. Computation lives in
the worker (``ActorRolloutWorker``); math lives in ``groupflow.algorithms``; this file decides only
*what happens in which order*, plus validation, logging and checkpoints.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from groupflow import builders
from groupflow.algorithms import (
    ADVANTAGE_ESTIMATORS,
    build_kl_controller,
    compute_advantages,
    compute_gae,
    kl_in_reward,
    logprob_mismatch,
    place_outcome_reward,
    sequence_mean_kl,
)
from groupflow.algorithms.registry import option_names
from groupflow.batch import Batch
from groupflow.checkpoint import (
    capture_rng_state,
    find_latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from groupflow.config import ActorConfig, Config
from groupflow.contracts import CONTRACTS, validate
from groupflow.data import PromptLoader, PromptRow
from groupflow.evaluation import evaluate
from groupflow.rollout.hf import SamplingParams
from groupflow.sft import warm_start
from groupflow.tracking import Tracker
from groupflow.utils.timing import StageTimer
from groupflow.workers.actor import ActorRolloutWorker, ModelSpec, prompts_batch
from groupflow.workers.critic import CriticSpec, CriticWorker
from groupflow.workers.inference import InferenceWorker
from groupflow.workers.reward_model import (
    ModelRewardRunner,
    RewardModelWorker,
    check_reward_model_path,
)

log = logging.getLogger("groupflow")

__all__ = ["Trainer", "sample_seed"]


def sample_seed(run_seed: int, step: int, index: int) -> int:
    """Seed of one rollout sample: depends only on (run seed, step, sample slot), so resume replays it."""
    return (run_seed * 1_000_003 + step * 100_003 + index) % (2**63 - 1)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        check_role_paths(cfg)  # a missing model directory fails now, not mid-run
        if cfg.run.num_threads:
            torch.set_num_threads(cfg.run.num_threads)
        torch.manual_seed(cfg.run.seed)
        self.estimator_options = estimator_options(cfg)
        self.step = 0
        self.tracker: Tracker | None = None
        # The policy type is config: a non-LLM policy (a flow-matching generator) is an object
        # that supplies rollout, log-probs, update inputs, validation and step metrics; the loop
        # below is the same for both. None: the built-in LLM policy (this class's own stages).
        self.policy = builders.build_policy(cfg, self.run_dir)
        self.contracts = CONTRACTS
        self.critic = self.reward_model = self.reference = self.kl_ctrl = None
        if self.policy is not None:
            self.rollout = self.policy.actor
            self.actor, self.loader = self.policy.actor, self.policy.loader
            self.contracts = self.policy.contracts
            self.data_stats = self.policy.data_stats
            return
        engine = builders.build_rollout_engine(cfg)  # None: HF; fails fast if vLLM is missing
        train_rows, val_rows, self.data_stats = builders.build_data(cfg)
        self.tokenizer = builders.build_tokenizer(cfg, self.run_dir, train_rows + val_rows)
        self.train = builders.encode_prompts(train_rows, self.tokenizer, cfg, "train")
        self.val = (
            builders.encode_prompts(val_rows, self.tokenizer, cfg, "validation")
            if val_rows
            else None
        )
        rm_only = cfg.reward_model is not None and cfg.reward_model.only
        self.reward_fn = None if rm_only else builders.build_reward(cfg)
        if self.reward_fn is not None:
            self.reward_fn.check_fields({k for r in self.train.rows for k in r.fields})
        # Rows are tokenized once at load; rollout looks their ids and text up by identity.
        self._encoded = {
            id(r): (t, i) for r, t, i in zip(self.train.rows, self.train.texts, self.train.ids)
        }
        self.loader = PromptLoader(
            self.train.rows, cfg.data.prompts_per_step, seed=cfg.run.seed, shuffle=cfg.data.shuffle
        )
        # Workers build their own models in their own processes (local: this one). Rollout and
        # reference live inside the actor worker unless placement gives them pools of their own.
        spec = ModelSpec(cfg.model, str(builders.tokenizer_dir(cfg, self.run_dir)), cfg.run.seed)
        pl = cfg.placement
        needs_reference = cfg.actor.kl_coef > 0 or cfg.algorithm.kl_in_reward is not None
        self.actor = builders.role_group(
            cfg, "actor", ActorRolloutWorker, spec=spec, cfg=cfg.actor, total_steps=cfg.run.total_steps,
            pg_timeout_s=cfg.run.worker_timeout_s, reference=needs_reference and pl.reference == "colocated", engine=engine,
        )  # fmt: skip
        self.rollout = self.actor
        if pl.rollout != "colocated":
            self.rollout = builders.role_group(
                cfg, "rollout", InferenceWorker, spec=spec, cfg=cfg.actor, role="rollout"
            )
        self.reference = None
        if needs_reference:
            self.reference = self.actor
            if pl.reference != "colocated":
                self.reference = builders.role_group(
                    cfg, "reference", InferenceWorker, spec=spec, cfg=cfg.actor, role="reference"
                )
        self._add_ppo_roles(spec)
        r = cfg.rollout
        self.sampling = SamplingParams(
            temperature=r.temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            min_p=r.min_p,
            max_new_tokens=r.max_new_tokens,
            stop=tuple(r.stop),
            n=r.samples_per_prompt,
            static_kv_cache=r.static_kv_cache,
        )

    def _add_ppo_roles(self, policy_spec: ModelSpec) -> None:
        """The optional roles: critic (estimator gae), reward model, KL-in-reward controller."""
        cfg = self.cfg
        self.critic = self.reward_model = None
        if cfg.critic is not None:
            self.critic = builders.role_group(
                cfg, "critic", CriticWorker, spec=CriticSpec(cfg.critic, policy_spec, cfg.run.seed),
                total_steps=cfg.run.total_steps, pg_timeout_s=cfg.run.worker_timeout_s,
            )  # fmt: skip
        if cfg.reward_model is not None:
            rm = cfg.reward_model
            raw = {
                t: r.prompt
                for rows in (self.train, self.val)
                if rows
                for t, r in zip(rows.texts, rows.rows)
            }
            self.reward_model = builders.role_group(
                cfg,
                "reward_model",
                RewardModelWorker,
                cfg=rm,
                pg_timeout_s=cfg.run.worker_timeout_s,
            )
            self.reward_fn = ModelRewardRunner(
                self.reward_fn, self.reward_model, weight=rm.weight, label=rm.label, raw_prompts=raw
            )
        k = cfg.algorithm.kl_in_reward
        self.kl_ctrl = (
            build_kl_controller(k.controller, k.coef, k.target_kl, k.horizon)
            if k is not None
            else None
        )

    # ----- the loop -------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        cfg = self.cfg
        resumed = self.maybe_resume()
        self.tracker = Tracker(
            self.run_dir, backends=["jsonl", *cfg.run.loggers], run_name=cfg.run.name,
            config=cfg.to_dict(), console_every=cfg.run.console_every,
            total_steps=cfg.run.total_steps, resume_step=self.step if resumed else None,
        )  # fmt: skip
        last: dict[str, float] = {}
        try:
            self.sync_rollout()
            if not resumed:
                self.tracker.log(self.before_training(), step=0)
            while self.step < cfg.run.total_steps:
                batch, last = self.train_step()
                if self._due(cfg.validation.every_steps) or self.step == cfg.run.total_steps:
                    last.update(self.validate())
                self.tracker.log(last, step=self.step)
                if self._due(cfg.run.samples_every):
                    self.tracker.log_samples(
                        self.step, batch.rows(["prompt", "completion", "rewards"])[:8]
                    )
                if self._due(cfg.run.save_every) or (
                    self.step == cfg.run.total_steps and cfg.run.save_every
                ):
                    self.save()
        finally:
            self.tracker.close()
        return last

    def train_step(self) -> tuple[Batch, dict[str, float]]:
        """One GRPO step: rollout → reward → (old/ref log-probs) → advantages → update."""
        timer = StageTimer()
        with timer("step"):
            with timer("rollout_and_reward"):
                batch, sampling_metrics = self.collect(self.step)
            with timer("old_logprobs"):
                batch = self.add_logprobs(batch)
            if self.critic is not None:
                with timer("values"):
                    batch["values"] = self.critic.compute_values(_model_inputs(batch))["values"]
            with timer("advantages"):
                batch = validate(self.add_advantages(batch), self.contracts["advantaged"])
            with timer("update"):
                update_metrics = self.update(validate(batch, self.contracts["train_ready"]))
            with timer("weight_sync"):
                self.sync_rollout()
        self.step += 1
        if self.policy is not None:
            metrics = self.policy.step_metrics(batch, timer.seconds("step"))
            return batch, {**metrics, **sampling_metrics, **update_metrics, **timer.metrics()}
        tokens = float(batch["response_mask"].sum() + batch["prompt_mask"].sum())
        metrics = {**batch_metrics(batch), **sampling_metrics, **update_metrics, **timer.metrics()}
        metrics["perf/tokens_per_s"] = tokens / max(timer.seconds("step"), 1e-9)
        return batch, metrics

    def update(self, batch: Batch) -> dict[str, float]:
        """Critic update (if any), then the actor's — except during the critic warm-up steps."""
        seed = sample_seed(self.cfg.run.seed, self.step, -1)
        if self.policy is not None:
            return self.policy.update(batch, seed)
        metrics: dict[str, float] = {}
        if self.critic is not None:
            critic_keys = [*(k for k in _MODEL_KEYS if k in batch), "values", "returns"]
            metrics.update(
                self.critic.update_critic(batch.select(*critic_keys, meta=False), shuffle_seed=seed)
            )
            if self.step < self.cfg.critic.warmup_steps:
                return metrics
        metrics.update(
            self.actor.update(
                _model_inputs(batch), temperature=self.sampling.temperature, shuffle_seed=seed
            )
        )
        return metrics

    def before_training(self) -> dict[str, float]:
        """Data statistics, the optional supervised warm start, and the baseline validation."""
        cfg = self.cfg
        metrics = dict(self.data_stats)
        if cfg.sft.steps:
            metrics.update(
                warm_start(
                    self.actor, self.tokenizer, self.train, self.reward_fn, self.sampling,
                    cfg.sft, cfg.run.seed, cfg.sft.target_field, rollout=self.rollout,
                    sync=self.sync_rollout,
                )
            )  # fmt: skip
            self.sync_rollout()
            self.reset_reference()  # RL's reference is the warm-started policy, where RL begins
        if self.critic is not None and cfg.critic.path is None and cfg.critic.tiny is None:
            # "initialised from the policy" means from the policy that PPO starts from
            self.critic.load_backbone(self.actor.full_weights())
        if cfg.validation.before_training:
            metrics.update(self.validate())
        return metrics

    def sync_rollout(self) -> None:
        """Push the actor's current weights into a separately placed rollout pool (no-op colocated)."""
        if self.rollout is not self.actor:
            self.rollout.load_weights(self.actor.full_weights())

    def reset_reference(self) -> None:
        if self.reference is self.actor:
            self.actor.reset_reference()
        elif self.reference is not None:
            self.reference.load_weights(self.actor.full_weights())

    def shutdown(self) -> None:
        """Stop every worker group (Ray actors and their resource pools)."""
        roles = (self.actor, self.rollout, self.reference, self.critic, self.reward_model)
        for group in dict.fromkeys(g for g in roles if g is not None):
            group.shutdown()

    def _due(self, every: int) -> bool:
        return bool(every) and self.step % every == 0

    # ----- stages ---------------------------------------------------------------------------------
    def collect(self, step: int) -> tuple[Batch, dict[str, float]]:
        """Rollout + reward for one step; with dynamic sampling, refill zero-signal groups (DAPO)."""
        cfg = self.cfg
        rows = self.loader.next_batch()
        batch = self.rollout_and_reward(rows, step, round_=0)
        if not cfg.algorithm.dynamic_sampling:
            return batch, {}
        kept, dropped, rounds = [], 0, 0
        while True:
            informative = _informative_groups(batch)
            dropped += int(batch["group_ids"].unique().numel()) - len(informative)
            kept.append(batch.index(torch.isin(batch["group_ids"], torch.tensor(informative))))
            rounds += 1
            have = sum(int(b["group_ids"].unique().numel()) for b in kept)
            if have >= cfg.data.prompts_per_step or rounds >= cfg.algorithm.max_sampling_rounds:
                break
            batch = self.rollout_and_reward(
                self.loader.take(cfg.data.prompts_per_step - have), step, round_=rounds
            )
        batch = Batch.concat([b for b in kept if len(b)] or [batch])
        batch = _first_groups(batch, cfg.data.prompts_per_step)
        return batch, {
            "sampling/rounds": rounds,
            "sampling/dropped_groups": dropped,
            "sampling/kept_groups": int(batch["group_ids"].unique().numel()),
        }

    def rollout_and_reward(self, rows: list[PromptRow], step: int, round_: int) -> Batch:
        if self.policy is not None:
            return self.policy.rollout_and_reward(rows, step, round_)
        n = self.sampling.n
        base = round_ * 1_000_000  # distinct seeds and group ids for refill rounds
        seeds = [sample_seed(self.cfg.run.seed, step, base + i) for i in range(len(rows) * n)]
        texts, ids = zip(*(self._encoded[id(r)] for r in rows))
        prompts = prompts_batch(ids, [seeds[i * n : (i + 1) * n] for i in range(len(rows))],
                                [base + i for i in range(len(rows))])  # fmt: skip
        out = self.rollout.generate(prompts, self.sampling, max(len(i) for i in ids))
        batch = with_prompt_info(out, rows, list(texts), n, uid_prefix=f"{step}-{round_}")
        batch["completion"] = self.decode(batch)
        validate(batch, "rollout")
        return validate(self.add_rewards(batch), "rewarded")

    def add_rewards(self, batch: Batch) -> Batch:
        fields = _fields(batch["row"])
        lengths = batch["response_mask"].sum(1).tolist()
        result = self.reward_fn(
            list(batch["prompt"]), list(batch["completion"]), completion_lengths=lengths, **fields
        )
        batch["rewards"] = result.total.float()
        batch.meta["reward_metrics"] = result.metrics
        return batch

    def add_logprobs(self, batch: Batch) -> Batch:
        """Old log-probs (needed when there is more than one optimizer step per batch) and reference ones."""
        if self.policy is not None:
            return self.policy.add_logprobs(batch)
        a = self.cfg.actor
        need_old = recompute_old_logprobs(a, self.cfg.rollout.engine, len(batch))
        t = self.sampling.temperature
        if need_old:
            batch["old_logprobs"] = self.actor.compute_logprobs(
                _model_inputs(batch), temperature=t
            )["logprobs"]
            # How far the rollout engine's numerics are from the training forward's.
            diff = logprob_mismatch(
                batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"]
            )
            batch.meta["rollout_metrics"] = {
                "rollout/logprob_diff_max": diff["max"],
                "rollout/logprob_diff_mean": diff["mean"],
            }
        else:
            # μ = 1, one mini-batch: the sampling policy *is* the current policy, so the rollout's
            # log-probs serve (same numerics; see tests/rollout) and the first ratio is 1.
            batch["old_logprobs"] = batch["rollout_logprobs"]
        if self.reference is not None:
            batch["ref_logprobs"] = self.reference.compute_logprobs(
                _model_inputs(batch), temperature=t, reference=True
            )["logprobs"]
        return batch

    def add_advantages(self, batch: Batch) -> Batch:
        al = self.cfg.algorithm
        rewards = batch["rewards"]
        if al.kl_in_reward is not None or al.estimator == "gae":
            token_rewards = self.token_rewards(batch)
            if al.estimator == "gae":
                batch["advantages"], batch["returns"] = compute_gae(
                    token_rewards, batch["values"], batch["response_mask"],
                    al.gamma, al.lam, al.whiten_advantages,
                )  # fmt: skip
                return batch
            rewards = token_rewards.sum(-1)  # outcome estimators see r - β·ΣKL (as verl does)
        batch["advantages"] = compute_advantages(
            rewards,
            batch["group_ids"],
            al.estimator,
            adv_clip_max=al.adv_clip_max,
            reward_threshold=al.reward_threshold,
            **self.estimator_options,
        )
        if al.shuffle_advantages:  # the control run (see AlgorithmConfig.shuffle_advantages)
            g = torch.Generator().manual_seed(sample_seed(self.cfg.run.seed, self.step, -2))
            batch["advantages"] = batch["advantages"][torch.randperm(len(batch), generator=g)]
        return batch

    def token_rewards(self, batch: Batch) -> torch.Tensor:
        """The outcome reward on each sample's last valid token, minus β·KL when configured."""
        mask = batch["response_mask"]
        token_rewards = place_outcome_reward(batch["rewards"], mask)
        k = self.cfg.algorithm.kl_in_reward
        if k is None:
            return token_rewards
        beta = self.kl_ctrl.value
        token_rewards, kl = kl_in_reward(
            token_rewards, batch["old_logprobs"], batch["ref_logprobs"], mask, beta, k.kind
        )
        current = float(sequence_mean_kl(kl, mask))
        self.kl_ctrl.update(current, n_steps=len(batch))
        batch.meta.setdefault("reward_metrics", {}).update(
            {"kl_in_reward/kl": current, "kl_in_reward/coef": beta}
        )
        return token_rewards

    def decode(self, batch: Batch) -> list[str]:
        ids = [r[m.bool()].tolist() for r, m in zip(batch["responses"], batch["response_mask"])]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    # ----- validation -----------------------------------------------------------------------------
    def validate(self, return_records: bool = False):
        if self.policy is not None:
            return self.policy.validate(self.step)
        if self.val is None:
            return ({}, {}) if return_records else {}
        v = self.cfg.validation
        return evaluate(
            self.rollout,
            self.tokenizer,
            self.val,
            self.reward_fn,
            base_params=self.sampling,
            samples=v.samples_per_prompt,
            temperature=v.temperature,
            greedy=v.greedy,
            seed=self.cfg.run.seed,
            return_records=return_records,
        )

    # ----- checkpoints ----------------------------------------------------------------------------
    def save(self) -> Path:
        """Atomic checkpoint: model/optimizer (one file set, or every rank's shards), loader, RNG, step."""
        state = {
            "loader": self.loader.state_dict(),
            "rng": capture_rng_state(),
            "trainer_state": {"step": self.step},
        }
        writers = {}
        if self.cfg.run.num_workers == 1 or self.policy is not None:  # diffusion: replicated
            state.update(self.actor.state_dict())
        else:
            state["actor_state"] = self.actor.train_state()
            writers["shards"] = lambda path: self.actor.save_sharded(str(path))
        if self.reference is not None and self.cfg.sft.steps:
            # a warm-started reference is not the model the config builds: keep its weights
            state["reference"] = self.reference.reference_weights()
        if self.critic is not None and self.critic.world_size == 1:
            state.update({f"critic_{k}": v for k, v in self.critic.state_dict().items()})
        elif self.critic is not None:
            state["critic_train_state"] = self.critic.train_state()
            writers["critic_shards"] = lambda path: self.critic.save_sharded(str(path))
        if self.kl_ctrl is not None:
            state["kl_controller"] = self.kl_ctrl.state_dict()
        root = self.run_dir / "checkpoints"
        return save_checkpoint(
            root, self.step, state, keep_last=self.cfg.run.keep_last, writers=writers
        )

    def maybe_resume(self) -> bool:
        mode = self.cfg.run.resume
        if mode == "never":
            return False
        path = (
            find_latest_checkpoint(self.run_dir / "checkpoints") if mode == "auto" else Path(mode)
        )
        if path is None:
            return False
        if not path.is_dir():
            raise FileNotFoundError(f"run.resume: checkpoint directory '{path}' does not exist")
        state = load_checkpoint(path)
        load_actor_state(self.actor, state, 1 if self.policy else self.cfg.run.num_workers, path)
        if self.reference is not None and state.get("reference") is not None:
            self.reference.load_reference(state["reference"])
        load_ppo_state(self.critic, self.kl_ctrl, state, path)
        self.loader.load_state_dict(state["loader"])
        restore_rng_state(state["rng"])
        self.step = int(state["trainer_state"]["step"])
        log.info("resumed from %s at step %d", path, self.step)
        return True


def load_actor_state(actor, state: dict, num_workers: int, path: Path) -> None:
    """Restore the actor from a single-worker checkpoint or from shards (any number of ranks)."""
    if "shards" in state:  # sharded: DCP reshards to however many workers load it
        actor.load_sharded(str(state["shards"]), state["actor_state"])
    elif num_workers == 1:
        actor.load_state_dict(state)
    else:  # one worker's full state, sharded over num_workers on load
        actor.load_full_state(state)


def check_role_paths(cfg: Config) -> None:
    """Model directories of the optional roles must exist before anything else starts."""
    from groupflow.models.causal_lm import ModelLoadError

    if cfg.reward_model is not None:
        check_reward_model_path(cfg.reward_model)
    if cfg.critic is not None and cfg.critic.path is not None:
        p = Path(cfg.critic.path).expanduser()
        if not (p / "config.json").is_file():
            raise ModelLoadError(
                f"critic.path: '{p}' is not a Hugging Face model directory (no config.json)"
            )


def load_ppo_state(critic, kl_ctrl, state: dict, path: Path) -> None:
    """Restore the critic (weights, optimizer, schedule) and the KL controller's β."""
    if critic is not None:
        if "critic_shards" in state:
            critic.load_sharded(str(state["critic_shards"]), state["critic_train_state"])
        elif "critic_model" in state:
            critic.load_state_dict(
                {k: state[f"critic_{k}"] for k in ("model", "optimizer", "scheduler")}
            )
        else:
            raise ValueError(f"checkpoint {path} has no critic state, but this run has a critic")
    if kl_ctrl is not None and "kl_controller" in state:
        kl_ctrl.load_state_dict(state["kl_controller"])


# ----- batch assembly helpers (pure) ----------------------------------------------------------------


def recompute_old_logprobs(actor: ActorConfig, engine: str, num_samples: int) -> bool:
    """Whether the old log-probs are recomputed by the training forward (``actor.recompute_old_logprobs``).

    auto: yes when the batch takes several optimizer steps (the policy moves between them), or
    when the rollout engine is not our own decode loop (vLLM's kernels give slightly different
    log-probs, so its record is not the "old" policy of the PPO ratio).
    """
    if actor.recompute_old_logprobs != "auto":
        return actor.recompute_old_logprobs == "always"
    several_steps = actor.ppo_epochs > 1 or (actor.mini_batch_samples or num_samples) < num_samples
    return several_steps or engine != "hf"


def estimator_options(cfg: Config) -> dict[str, Any]:
    """The typed options (scale, eps) the chosen estimator declares, plus its free-form extras."""
    al = cfg.algorithm
    if al.estimator == "gae":  # token-level: gamma, lam, whiten_advantages are its options
        return {}
    accepted = option_names(ADVANTAGE_ESTIMATORS.get(al.estimator)) or ()
    typed = {k: getattr(al, k) for k in ("scale", "eps") if k in accepted}
    return {**typed, **al.estimator_options}


def with_prompt_info(
    out: Batch, rows: list[PromptRow], texts: list[str], n: int, uid_prefix: str
) -> Batch:
    """Attach uids, prompt text and dataset rows to generated samples (sample j of prompt i at i*n + j)."""
    b = len(rows) * n
    out["uid"] = [f"{uid_prefix}-{i}" for i in range(b)]
    out["prompt"] = [texts[i // n] for i in range(b)]
    out["row"] = [rows[i // n] for i in range(b)]
    return out


_MODEL_KEYS = (
    "prompt_ids",
    "prompt_mask",
    "responses",
    "response_mask",
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "rollout_logprobs",  # for truncated importance sampling (actor.tis_cap)
)


def _model_inputs(batch: Batch) -> Batch:
    """Only the tensors the workers need: dataset rows and texts stay on the driver."""
    return batch.select(*[k for k in _MODEL_KEYS if k in batch], meta=False)


def _fields(rows) -> dict[str, list]:
    """Per-sample dataset fields by name, for the reward functions (missing → None)."""
    keys = dict.fromkeys(k for r in rows for k in r.fields)
    return {k: [r.fields.get(k) for r in rows] for k in keys}


def _informative_groups(batch: Batch) -> list[int]:
    gids, rewards = batch["group_ids"], batch["rewards"]
    out = []
    for g in gids.unique().tolist():
        r = rewards[gids == g]
        if r.numel() > 1 and float(r.max() - r.min()) > 0:
            out.append(g)
    return out


def _first_groups(batch: Batch, k: int) -> Batch:
    order = list(dict.fromkeys(batch["group_ids"].tolist()))[:k]
    return batch.index(torch.isin(batch["group_ids"], torch.tensor(order)))


def batch_metrics(batch: Batch) -> dict[str, float]:
    rewards, adv = batch["rewards"], batch["advantages"]
    lengths = batch["response_mask"].sum(1).float()
    finished_by_length = sum(r == "length" for r in batch["finish_reason"]) / len(batch)
    m = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "reward/max": float(rewards.max()),
        "reward/min": float(rewards.min()),
        "acc/train": float((rewards >= 1.0).float().mean()),
        "advantages/mean": float(adv.mean()),
        "advantages/std": float(adv.std(unbiased=False)),
        "advantages/max": float(adv.max()),
        "advantages/min": float(adv.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(finished_by_length),
        "batch/samples": float(len(batch)),
    }
    m.update(batch.meta.get("rollout_metrics", {}))
    for k, v in batch.meta.get("reward_metrics", {}).items():
        if isinstance(v, (int, float)) and math.isfinite(v):
            m[k] = float(v)
    return m
