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
from groupflow.distributed.transport import bytes_between_nodes, ticket_nbytes
from groupflow.utils.timing import StageTimer

__all__ = [
    "DiffusionPolicyView",
    "LLMPolicyView",
    "Moved",
    "Policy",
    "PolicyView",
    "RolloutView",
    "published",
    "transfer_weights",
]


class PolicyView(Protocol):
    """The policy as a workflow uses it. ``rollout``: the group that generates (``generate`` for
    LLMs, ``generate``/``sample_images`` for diffusion) with the policy's current weights in the
    trainer, or the scheduled version's on the asynchronous rollout side; ``reward_model``: a
    reward model group or None."""

    contracts: dict[str, Any]
    rollout: Any
    reward_model: Any

    def sync(self, version: int = -1) -> Moved:
        """Make ``rollout`` hold the current weights; returns what that moved (``Moved``)."""
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

    def moved_by(self, ticket: Any) -> Moved:
        """What a published ticket moves once the rollout pool's workers fetch it."""
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

    def sync(self, version: int = -1) -> Moved:
        return Moved()  # versions arrive through load_weights

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


@dataclass(frozen=True)
class Moved:
    """What a weight transfer moved: the bytes that passed through the driver's process, and the
    bytes that crossed from one node to another (logged as ``weights/bytes_via_driver`` and
    ``weights/bytes_between_nodes``)."""

    via_driver: int = 0
    between_nodes: int = 0
    version_bytes: int = 0  # what one receiver got: the version's size


def transfer_weights(actor, group, receive, version: int, transport) -> Moved:
    """One version from the actor's ranks to ``group``'s workers through ``transport``;
    ``receive(ticket, transport)`` runs on every worker of ``group`` and answers the bytes it
    received. Crossing nodes: each receiver's bytes, from the sending rank's node (or, where
    every rank sends its shard, from each's), where it is not the receiver's own."""
    got: list = []
    ticket = transport.transfer(
        version, lambda: actor.submit("send_weights", version, transport),
        lambda t: got.append(receive(t, transport)),
    )  # fmt: skip
    received = got[0] if got and isinstance(got[0], list) else []
    nbytes = max((int(b) for b in received if b), default=0)
    between = bytes_between_nodes(nbytes, actor.node_ids(), group.node_ids(),
                                  transport.every_rank_sends)  # fmt: skip
    return Moved(ticket_nbytes(ticket), between, nbytes)


def published(ticket, actor, pool, version_bytes: int) -> Moved:
    """What a version published for an asynchronous rollout pool moves once each of the pool's
    workers fetches it (``Moved``): exact with the deterministic schedule, where every worker
    loads every version; an upper bound with eager or in-flight updates, where a worker skips a
    version a newer one overtook. ``version_bytes``: the size, where the ticket has no layout."""
    layout = ticket.get("layout") if isinstance(ticket, dict) else None
    nbytes = int(layout.total) if layout is not None else version_bytes
    return Moved(ticket_nbytes(ticket),
                 bytes_between_nodes(nbytes, actor.node_ids(), pool.node_ids(), False), nbytes)  # fmt: skip
