"""The LLM policy: every role that learns or is learned against — actor, rollout, reference, critic,
reward model — each a worker group placed as the config says.

Design decision: the trainer's loop is the same for every policy type; what an LLM adds is which
roles exist and how a rewarded batch becomes a trainable one. This object owns the roles and
answers the driver's four questions — ``prepare`` (old and reference log-probs, critic values),
``update`` (critic, then actor, one call each), ``sync`` (push new weights to a separately placed
rollout pool) and its checkpoint state — while the workflows (single- or multi-turn) use its
``rollout`` group, ``tokenizer`` and ``sampling`` parameters to produce experience. Tensor math
stays in the workers and ``groupflow.algorithms``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from groupflow.algorithms import logprob_mismatch
from groupflow.assembly.engines import build_rollout_engine, build_weight_transport
from groupflow.assembly.groups import role_group, snapshot_group
from groupflow.assembly.models import check_model_dir
from groupflow.assembly.tokenizers import build_tokenizer, check_teacher, tokenizer_dir
from groupflow.batch import Batch
from groupflow.config import ActorConfig, Config, ModelConfig, present
from groupflow.contracts import CONTRACTS
from groupflow.models.causal_lm import ModelLoadError
from groupflow.policies.base import Moved, RolloutView, published, transfer_weights
from groupflow.rollout.engines.base import HF, HFOptions
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.rollout.engines.vllm_engine import VLLMOptions
from groupflow.utils.timing import StageTimer
from groupflow.workers.actor import ActorRolloutWorker
from groupflow.workers.common import ModelSpec
from groupflow.workers.critic import CriticSpec, CriticWorker
from groupflow.workers.inference import InferenceWorker
from groupflow.workers.packing import balanced_rank_order, check_token_budget
from groupflow.workers.reward_model import RewardModelWorker, check_reward_model_path
from groupflow.workers.update import sample_tokens

log = logging.getLogger("groupflow")

__all__ = [
    "LLMPolicy",
    "frozen_view",
    "old_logprobs_source",
    "recompute_old_logprobs",
    "model_inputs",
    "sampling_params",
]

MODEL_KEYS = (
    "prompt_ids",
    "prompt_mask",
    "responses",
    "response_mask",
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "rollout_logprobs",  # for truncated importance sampling (actor.tis_cap)
    "vision",  # prompt images (models.vision.VisionInputs per sample), for a VLM
)


def model_inputs(batch: Batch) -> Batch:
    """Only the tensors the workers need: dataset rows and texts stay on the driver."""
    return batch.select(*[k for k in MODEL_KEYS if k in batch], meta=False)


def balanced_call(method, group, batch: Batch, packing: bool, **kwargs):
    """``method(batch, **kwargs)`` on a ``dp`` worker group; with ``packing`` and several workers
    the batch is first reordered so that each worker's share holds a near-equal number of tokens
    (``workers.packing.balanced_rank_order``), and a Batch result is put back in batch order."""
    if not packing or group.world_size == 1:
        return method(batch, **kwargs)
    order = balanced_rank_order(sample_tokens(batch), group.world_size)
    out = method(batch.index(order), **kwargs)
    if not isinstance(out, Batch):
        return out
    inverse = [0] * len(order)
    for pos, row in enumerate(order):
        inverse[row] = pos
    return out.index(inverse)


def old_logprobs_source(actor: ActorConfig, engine: str, num_samples: int,
                        kl_in_reward: bool = False) -> str:  # fmt: skip
    """Where the PPO ratio's old (proximal) log-probs come from (``actor.recompute_old_logprobs``):

    - ``"recompute"``: a forward pass before the update — when the batch takes several optimizer
      steps (the policy moves between them), or the rollout engine is not our own decode loop
      (vLLM's kernels give slightly different log-probs, so its record is not the "old" policy);
    - ``"forward"``: the update's own forward pass, detached — with an off-policy correction
      (``actor.off_policy``: tis, decoupled) and a single optimizer step, the weights of that
      forward *are* the proximal policy's, so a separate pass would compute the same numbers
      (asynchronous rollout's decoupled PPO costs no extra forward); not when the credit stage
      needs them before the update (``algorithm.kl_in_reward``);
    - ``"rollout"``: the rollout's own log-probs — one step, our decode loop, no correction: the
      sampling policy *is* the current policy, so the first ratio is exactly 1.
    """
    if actor.recompute_old_logprobs != "auto":
        return "recompute" if actor.recompute_old_logprobs == "always" else "rollout"
    several_steps = actor.ppo_epochs > 1 or (actor.mini_batch_samples or num_samples) < num_samples
    if several_steps:
        return "recompute"
    if actor.off_policy in ("tis", "decoupled"):  # both weigh the proximal against behaviour
        return "recompute" if kl_in_reward else "forward"
    return "recompute" if engine != "hf" else "rollout"


def recompute_old_logprobs(actor: ActorConfig, engine: str, num_samples: int) -> bool:
    """Whether a separate forward pass recomputes the old log-probs (``old_logprobs_source``)."""
    return old_logprobs_source(actor, engine, num_samples) == "recompute"


def sampling_params(cfg: Config) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, min_p=r.min_p,
        max_new_tokens=r.max_new_tokens, stop=tuple(r.stop), n=r.samples_per_prompt,
        static_kv_cache=r.static_kv_cache,
    )  # fmt: skip


def check_role_paths(cfg: Config) -> None:
    """Model directories of the optional roles must exist before anything else starts."""
    if cfg.model is not None and cfg.model.path is not None:
        check_model_dir(cfg.model.path, "model.path")
    if cfg.reward_model is not None:
        check_reward_model_path(cfg.reward_model)
    if cfg.teacher is not None:
        check_model_dir(cfg.teacher.path, "teacher.path")
    if cfg.critic is not None and cfg.critic.path is not None:
        p = Path(cfg.critic.path).expanduser()
        if not (p / "config.json").is_file():
            raise ModelLoadError(
                f"critic.path: '{p}' is not a Hugging Face model directory (no config.json)"
            )


class LLMPolicy:
    """Actor (+ colocated or separate rollout and reference), optional critic and reward model."""

    contracts = CONTRACTS

    def __init__(self, cfg: Config, run_dir: Path, corpus: list, extra_texts: Sequence[str] = ()):
        self.cfg = cfg
        check_role_paths(cfg)  # a missing model directory fails now, not mid-run
        engine = build_rollout_engine(cfg)  # fails fast if vLLM is missing
        self.tokenizer = build_tokenizer(cfg, run_dir, corpus, extra_texts)
        self.max_entropy = math.log(len(self.tokenizer))  # a uniform output's (CollapseMonitor)
        self.sampling = sampling_params(cfg)
        # Workers build their own models in their own processes (local: this one). Rollout and
        # reference live inside the actor worker unless placement gives them pools of their own.
        # a tokenizer trained by the run lives in the driver's run directory: it travels with the
        # spec, so a worker on another node does not need to see that directory
        m = present(cfg.model, "model")
        own_tokenizer = m.tiny is not None and m.tokenizer_path is None
        spec = (ModelSpec.carrying if own_tokenizer else ModelSpec)(
            cfg.model, str(tokenizer_dir(cfg, run_dir)), cfg.run.seed
        )
        self.spec, self.engine, self.run_dir = spec, engine, run_dir
        # How new weights reach a rollout pool, the reference and a critic (rollout.weight_transport)
        self.transport = build_weight_transport(cfg, run_dir)
        self._version_bytes = 0  # a version's size, as the last transfer's receivers got it
        pl = cfg.placement
        needs_reference = cfg.actor.kl_coef > 0 or cfg.algorithm.kl_in_reward is not None
        # With a rollout pool the actor never builds a vLLM engine (a full model and KV cache per
        # rank would undo FSDP2's sharding, issue 21 item 8): a synchronous pool does all the
        # generating, and with max_staleness >= 1 (the pool busy a version behind) the actor
        # validates the current weights with the HF engine, sharded ranks gathering layer by layer.
        pooled = pl.rollout != "colocated"
        self.actor = role_group(
            cfg, "actor", ActorRolloutWorker, spec=spec, cfg=cfg.actor, total_steps=cfg.run.total_steps,
            pg_timeout_s=cfg.run.worker_timeout_s, reference=needs_reference and pl.reference == "colocated",
            engine=HF if pooled else engine, sequence_parallel=cfg.parallel.sequence_parallel,
        )  # fmt: skip
        self.rollout = self.rollout_pool = self.actor
        if pl.rollout != "colocated":
            self.rollout = self.rollout_pool = role_group(
                cfg, "rollout", InferenceWorker, spec=spec, cfg=cfg.actor, role="rollout",
                role_name="rollout", engine=engine,  # errors name the role: the class serves two
            )  # fmt: skip
        # The reference and a critic (fed once) are outside the collective transport's group:
        # Ray's object store serves them; the group spans the actor's ranks and the rollout pool.
        self.transport.open(self.actor.world_size, self.rollout.world_size)
        self.side_transport = self.transport
        if self.transport.members_only:
            self.side_transport = build_weight_transport(cfg, run_dir, kind="ray")
        self.reference = None
        if needs_reference:
            self.reference = self.actor
            if pl.reference != "colocated":
                self.reference = role_group(
                    cfg, "reference", InferenceWorker, spec=spec, cfg=cfg.actor,
                    role="reference", role_name="reference",
                )  # fmt: skip
        self.teacher = None
        if cfg.teacher is not None:  # on-policy distillation: frozen, its own worker group
            tc = cfg.teacher
            check_teacher(tc.path, self.tokenizer)  # token ids must mean the same
            teacher_model = ModelConfig(path=tc.path, dtype=tc.dtype,
                                        trust_remote_code=tc.trust_remote_code)  # fmt: skip
            self.teacher = role_group(
                cfg, "teacher", InferenceWorker, role="teacher", cfg=cfg.actor,
                spec=ModelSpec(teacher_model, spec.tokenizer_dir, cfg.run.seed, spec.tokenizer_files),
                role_name="teacher",
            )  # fmt: skip
        self.critic = self.reward_model = None
        if cfg.critic is not None:
            self.critic = role_group(
                cfg, "critic", CriticWorker, spec=CriticSpec(cfg.critic, spec, cfg.run.seed),
                total_steps=cfg.run.total_steps, pg_timeout_s=cfg.run.worker_timeout_s,
            )  # fmt: skip
        if cfg.reward_model is not None:
            self.reward_model = role_group(
                cfg, "reward_model", RewardModelWorker, cfg=cfg.reward_model,
                pg_timeout_s=cfg.run.worker_timeout_s,
            )  # fmt: skip

    # ----- the driver's calls -----------------------------------------------------------------
    def prepare(self, batch: Batch, timer: StageTimer | None = None) -> tuple[Batch, dict]:
        """Old log-probs (recomputed when the batch gets several optimizer steps or comes from
        another engine), reference log-probs and critic values; (batch, metrics)."""
        timer = timer or StageTimer()
        metrics: dict[str, float] = {}
        a = self.cfg.actor
        self._check_packing_budgets(batch)
        t = self.sampling.temperature
        # the credit stage needs the sampling policy's log-probs before the update
        early = self.cfg.algorithm.kl_in_reward is not None or self.teacher is not None
        source = old_logprobs_source(a, self.cfg.rollout.engine, len(batch), early)
        with timer("old_logprobs"):
            if source == "recompute":
                batch["old_logprobs"] = balanced_call(
                    self.actor.compute_logprobs, self.actor, model_inputs(batch), a.packing,
                    temperature=t,
                )["logprobs"]  # fmt: skip
                # How far the rollout engine's numerics are from the training forward's.
                diff = logprob_mismatch(
                    batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"]
                )
                metrics["rollout/logprob_diff_max"] = diff["max"]
                metrics["rollout/logprob_diff_mean"] = diff["mean"]
            elif source == "rollout":
                # μ = 1, one mini-batch: the sampling policy *is* the current policy, so the
                # rollout's log-probs serve (same numerics; see tests/rollout): the first ratio is 1.
                batch["old_logprobs"] = batch["rollout_logprobs"]
            # "forward": no old_logprobs here; the update anchors the ratio at its own forward
            # (detached) and logs the rollout/logprob_diff_* gap from it
            if self.reference is not None:
                batch["ref_logprobs"] = balanced_call(
                    self.reference.compute_logprobs, self.reference, model_inputs(batch),
                    a.packing, temperature=t, reference=True,
                )["logprobs"]  # fmt: skip
        if self.teacher is not None:
            with timer("teacher_logprobs"):  # at the sampling temperature, as the student's
                batch["teacher_logprobs"] = self.teacher.compute_logprobs(
                    model_inputs(batch), temperature=t
                )["logprobs"]
        if self.critic is not None:
            with timer("values"):
                batch["values"] = balanced_call(
                    self.critic.compute_values, self.critic, model_inputs(batch),
                    present(self.cfg.critic, "critic").packing,
                )["values"]  # fmt: skip
        return batch, metrics

    def _check_packing_budgets(self, batch: Batch) -> None:
        """A sample over a packed token budget stops the step here, named by its uid (the
        workers see only model inputs)."""
        names = [str(u) for u in batch["uid"]] if "uid" in batch else None
        for section, cfg in (("actor", self.cfg.actor), ("critic", self.cfg.critic)):
            if cfg is not None and cfg.packing:
                check_token_budget(
                    sample_tokens(batch), cfg.micro_batch_tokens,
                    key=f"{section}.micro_batch_tokens", names=names,
                )  # fmt: skip

    def update(self, batch: Batch, *, step: int, seed: int) -> dict[str, float]:
        """Critic update (if any), then the actor's — except during the critic warm-up steps."""
        metrics: dict[str, float] = {}
        if self.critic is not None:
            critic_keys = [*(k for k in MODEL_KEYS if k in batch), "values", "returns"]
            metrics.update(
                balanced_call(
                    self.critic.update_critic, self.critic,
                    batch.select(*critic_keys, meta=False), present(self.cfg.critic, "critic").packing,
                    shuffle_seed=seed,
                )
            )  # fmt: skip
            if step < present(self.cfg.critic, "critic").warmup_steps:
                return metrics
        metrics.update(
            balanced_call(
                self.actor.update, self.actor, model_inputs(batch), self.cfg.actor.packing,
                temperature=self.sampling.temperature, shuffle_seed=seed,
            )
        )  # fmt: skip
        return metrics

    def sync(self, version: int = -1) -> Moved:
        """Push the actor's current weights into a separately placed rollout pool (no-op colocated;
        with asynchronous rollout the rollout side gets versions from the trainer instead);
        returns what that moved."""
        if self.rollout is self.actor:
            return Moved()
        return self._transfer(self.rollout, self.rollout.receive_weights, version)

    def publish(self, version: int):
        """Send the actor's current weights as ``version`` with the weight transport; the ticket
        (for Ray or the filesystem: references, not weights) is what the driver forwards."""
        return self.actor.send_weights(version, self.transport)

    def moved_by(self, ticket) -> Moved:
        """What a published ticket moves once the pool's workers fetch it (``published``)."""
        return published(ticket, self.actor, self.rollout_pool, self._version_bytes)

    def _transfer(self, group, receive, version: int, transport=None) -> Moved:
        """Actor → ``group``'s workers through the transport (``policies.base.transfer_weights``);
        the size of a version is remembered (``publish`` needs it for a ticket without one)."""
        moved = transfer_weights(self.actor, group, receive, version, transport or self.transport)
        self._version_bytes = max(self._version_bytes, moved.version_bytes)
        return moved

    def sft_step(self, batch: Batch, lr: float) -> float:
        """One supervised step of the actor (the workflow's warm start)."""
        return self.actor.sft_step(batch, lr)

    def begin(self, warm_started: bool) -> None:
        """Where RL starts: the reference is the (warm-started) policy, and a critic initialised
        "from the policy" copies that policy's backbone."""
        self.sync(0)
        if warm_started:
            if self.reference is self.actor:
                self.actor.reset_reference()
            elif self.reference is not None:
                self._transfer(self.reference, self.reference.receive_weights, 0,
                               self.side_transport)  # fmt: skip
        c = self.cfg.critic
        if self.critic is not None and c is not None and c.path is None and c.tiny is None:
            self._transfer(self.critic, self.critic.receive_backbone, 0, self.side_transport)

    # ----- asynchronous rollout (groupflow.rollout.hosts) -------------------------------------
    @property
    def async_on_pool(self) -> bool:
        """Whether the asynchronous rollout generates on this policy's Ray rollout pool (fed
        versions through the weight transport) rather than with a frozen copy in a child process."""
        return self.cfg.run.backend == "ray" and self.rollout_pool is not self.actor

    def start_async(self):
        """How the asynchronous rollout side builds its ``RolloutView`` (picklable): a frozen copy
        in the side's own process (``frozen_view``), or with a Ray rollout pool (``async_on_pool``)
        a view over that pool. From now on this process generates (validation,
        ``groupflow generate``) with the actor, i.e. the current weights."""
        pool = self.rollout_pool
        self.rollout = self.actor
        if self.async_on_pool:  # travels to the side's Ray actor with handles on the groups
            view = RolloutView(CONTRACTS, pool, self.reward_model, tokenizer=self.tokenizer,
                               sampling=self.sampling, transport=self.transport, owns=False)  # fmt: skip
            return partial(_identity, view)
        return partial(frozen_view, self.cfg, self.run_dir, self.spec, self.engine)

    def snapshot(self, copy: bool = True) -> dict[str, Any]:
        """The actor's current weights: a copy (later updates do not change it), or with
        ``copy=False`` possibly the live tensors, for a caller that copies them at once."""
        return self.actor.full_weights(copy=copy)

    # ----- checkpoints ------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(state for the checkpoint, writers of sharded parts: name -> fn(path))."""
        state: dict[str, Any] = {}
        writers = {}
        if self.cfg.run.num_workers == 1:
            state.update(self.actor.state_dict())
        else:
            state["actor_state"] = self.actor.train_state()
            writers["shards"] = lambda path: self.actor.save_sharded(str(path))
        if self.reference is not None and self.cfg.sft.steps:
            # a warm-started reference is not the model the config builds: keep its weights
            state["reference"] = self.reference.reference_weights()
        if self.critic is not None and self.critic.world_size == 1:
            state.update({f"critic_{k}": v for k, v in self.critic.state_dict().items()})
        elif (critic := self.critic) is not None:
            state["critic_train_state"] = critic.train_state()
            writers["critic_shards"] = lambda path: critic.save_sharded(str(path))
        return state, writers

    def load(self, state: dict[str, Any], path: Path) -> None:
        load_actor_state(self.actor, state, self.cfg.run.num_workers)
        if self.reference is not None and state.get("reference") is not None:
            self.reference.load_reference(state["reference"])
        if self.critic is not None:
            if "critic_shards" in state:
                self.critic.load_sharded(str(state["critic_shards"]), state["critic_train_state"])
            elif "critic_model" in state:
                self.critic.load_state_dict(
                    {k: state[f"critic_{k}"] for k in ("model", "optimizer", "scheduler")}
                )
            else:
                raise ValueError(
                    f"checkpoint {path} has no critic state, but this run has a critic"
                )

    def shutdown(self) -> None:
        """Stop every role's worker group (Ray actors and their resource pools)."""
        roles = (self.actor, self.rollout_pool, self.reference, self.teacher, self.critic,
                 self.reward_model)  # fmt: skip
        for group in dict.fromkeys(g for g in roles if g is not None):
            group.shutdown()
        self.transport.close()  # e.g. the collective transport's rendezvous store


def frozen_view(cfg: Config, run_dir: Path, spec: ModelSpec,
                engine: HFOptions | VLLMOptions = HF) -> RolloutView:  # fmt: skip
    """The rollout side's view with a frozen copy of the model in the side's own process (built
    there: this is the picklable recipe's callable): its own rollout worker, the run's saved
    tokenizer, the sampling parameters and — when configured — a reward model of its own (frozen:
    the same weights as the trainer's)."""
    tokenizer = build_tokenizer(cfg, Path(run_dir))  # the run's saved one
    rollout = snapshot_group(
        cfg, InferenceWorker, spec=spec, cfg=cfg.actor, role="rollout", engine=engine
    )
    reward_model = None
    if cfg.reward_model is not None:
        reward_model = snapshot_group(
            cfg, RewardModelWorker, role_name="reward_model", cfg=cfg.reward_model,
            pg_timeout_s=cfg.run.worker_timeout_s,
        )  # fmt: skip
    return RolloutView(CONTRACTS, rollout, reward_model, tokenizer=tokenizer,
                       sampling=sampling_params(cfg))  # fmt: skip


def _identity(x):
    return x


def load_actor_state(actor, state: dict, num_workers: int) -> None:
    """Restore the actor from a single-worker checkpoint or from shards (any number of ranks)."""
    if "shards" in state:  # sharded: DCP reshards to however many workers load it
        actor.load_sharded(str(state["shards"]), state["actor_state"])
    elif num_workers == 1:
        actor.load_state_dict(state)
    else:  # one worker's full state, sharded over num_workers on load
        actor.load_full_state(state)
