"""What a policy is to the driver (``Policy``), to a workflow (``PolicyView``) and to the
asynchronous rollout side (``RolloutView``).

Design decision: the driver and the workflows see the same policy object through two narrow,
typed interfaces. The driver trains it (``prepare``/``update``/``sync``, checkpoints); a workflow
only generates with it and reads what generation needs — it never reaches into the worker groups
that learn (no ``policy.actor``), so the same workflow runs unchanged over the trainer's policy or
over the asynchronous rollout side's frozen copy. That copy is one plain class for every model
kind and route (``RolloutView``): the groups differ (a frozen copy of the side's own, or the
trainer's Ray rollout pool), the surface does not. Stage metrics travel back as return values
(``prepare`` returns them beside the batch), never inside ``batch.meta``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from groupflow.batch import Batch
from groupflow.utils.timing import StageTimer

__all__ = [
    "DiffusionPolicyView",
    "LLMPolicyView",
    "Policy",
    "PolicyView",
    "RolloutView",
    "weights_nbytes",
]


class PolicyView(Protocol):
    """The policy as a workflow uses it. ``rollout``: the group that generates (``generate`` for
    LLMs, ``generate``/``sample_images`` for diffusion) with the policy's current weights in the
    trainer, or the scheduled version's on the asynchronous rollout side; ``reward_model``: a
    reward model group or None."""

    contracts: dict[str, Any]
    rollout: Any
    reward_model: Any

    def sync(self, version: int = -1) -> int:
        """Make ``rollout`` hold the current weights; returns the bytes that passed through this
        (the driver's) process."""
        ...


class LLMPolicyView(PolicyView, Protocol):
    """What an LLM workflow reads beside the view: the tokenizer, the sampling parameters and, for
    a warm start, one supervised step of the learning model (``sft_step``; the trainer's policy
    only — the rollout side never warm-starts)."""

    tokenizer: Any
    sampling: Any  # groupflow.rollout.engines.hf.SamplingParams

    def sft_step(self, batch: Batch, lr: float) -> float: ...


class DiffusionPolicyView(PolicyView, Protocol):
    """What the diffusion workflow reads beside the view: the tiny model's pretraining stats
    (logged once; empty for a real model)."""

    pretrain_stats: dict[str, float]


class Policy(PolicyView, Protocol):
    """The policy as the driver trains it. ``async_on_pool``: the asynchronous rollout runs on
    the policy's own Ray rollout pool (``rollout_pool``, a ``WorkerGroup``: the rollout loop in
    an actor there, ``groupflow.rollout.ray_host``), fed versions as transport tickets
    (``publish``)."""

    async_on_pool: bool
    transport: Any  # groupflow.distributed.transport.WeightTransport: how versions travel
    rollout_pool: Any  # the group the asynchronous rollout generates on with async_on_pool

    def publish(self, version: int) -> Any:
        """Send the current weights as ``version`` with the policy's weight transport; returns
        the ticket the driver forwards (``groupflow.distributed.transport``)."""
        ...

    def prepare(self, batch: Batch, timer: StageTimer | None = None) -> tuple[Batch, dict]:
        """Old/reference log-probs and values added to ``batch``; (batch, metrics)."""
        ...

    def update(self, batch: Batch, *, step: int, seed: int) -> dict[str, float]: ...

    def begin(self, warm_started: bool) -> None: ...

    def start_async(self) -> Any:
        """A picklable callable that builds the rollout side's ``RolloutView`` of this policy."""
        ...

    def snapshot(self, copy: bool = True) -> dict[str, Any]: ...

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]: ...

    def load(self, state: dict[str, Any], path: Path) -> None: ...

    def shutdown(self) -> None: ...


@dataclass
class RolloutView:
    """The policy as the asynchronous rollout side sees it (``groupflow.rollout.side``), for every
    kind and route: the group that generates with the scheduled version's weights, the contracts
    and what the kind's workflow reads (an LLM's ``tokenizer`` and ``sampling``, a diffusion run's
    ``pretrain_stats``). Nothing here trains, so ``sync`` moves nothing: versions arrive through
    ``load_weights``. ``transport`` set: ``rollout`` is the trainer's Ray rollout pool and a version
    arrives as that transport's ticket (the pool's workers fetch the buckets themselves); None:
    ``rollout`` is the side's own frozen copy and a version arrives as its weights. ``owns``:
    ``shutdown`` stops the groups (not the pool: the trainer's policy stops it)."""

    contracts: dict[str, Any]
    rollout: Any
    reward_model: Any = None
    tokenizer: Any = None
    sampling: Any = None
    pretrain_stats: dict[str, float] = field(default_factory=dict)
    transport: Any = None
    owns: bool = True

    def sync(self, version: int = -1) -> int:
        return 0  # versions arrive through load_weights

    def take_updates_in_flight(self, updates: Any) -> None:
        """rollout.async_mode=in_flight: ``updates`` answers versions between decode steps — as
        weights (a frozen copy), or as tickets this view's transport fetches (the pool)."""
        self.rollout.take_updates_in_flight(updates, self.transport)

    def load_weights(self, version_data: Any) -> None:
        """A version's weights (a frozen copy) or its transport ticket (the pool)."""
        if self.transport is None:
            self.rollout.load_weights(version_data)
        else:
            self.rollout.receive_weights(version_data, self.transport)

    def shutdown(self) -> None:
        if self.owns:
            for group in dict.fromkeys(
                g for g in (self.rollout, self.reward_model) if g is not None
            ):
                group.shutdown()


def weights_nbytes(weights: dict[str, Any]) -> int:
    """Bytes of a name → tensor dict (what a weight transfer moved)."""
    return sum(int(t.numel()) * t.element_size() for t in weights.values())
