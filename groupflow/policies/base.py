"""What a policy is to the driver (``Policy``) and to a workflow (``PolicyView``).

Design decision: the driver and the workflows see the same policy object through two narrow,
typed interfaces. The driver trains it (``prepare``/``update``/``sync``, checkpoints); a workflow
only generates with it and reads what generation needs — it never reaches into the worker groups
that learn (no ``policy.actor``), so the same workflow runs unchanged over the trainer's policy or
over the asynchronous rollout side's frozen copy (``RolloutPolicy``). Stage metrics travel back as
return values (``prepare`` returns them beside the batch), never inside ``batch.meta``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from groupflow.batch import Batch
from groupflow.utils.timing import StageTimer

__all__ = ["Policy", "PolicyView", "weights_nbytes"]


class PolicyView(Protocol):
    """The policy as a workflow uses it. ``rollout``: the group that generates (``generate`` for
    LLMs, ``generate``/``sample_images`` for diffusion) with the policy's current weights in the
    trainer, or the scheduled version's on the asynchronous rollout side; ``reward_model``: a
    reward model group or None. An LLM policy also has ``tokenizer`` and ``sampling``."""

    contracts: dict[str, Any]
    rollout: Any
    reward_model: Any

    def sync(self, version: int = -1) -> int:
        """Make ``rollout`` hold the current weights; returns the bytes that passed through this
        (the driver's) process."""
        ...

    def sft_step(self, batch: Batch, lr: float) -> float:
        """LLM policies: one supervised step of the learning model (a workflow's warm start)."""
        ...


class Policy(PolicyView, Protocol):
    """The policy as the driver trains it. ``async_on_pool``: the asynchronous rollout runs on
    the policy's own Ray rollout pool (``rollout_pool``, a ``WorkerGroup``: the rollout loop in
    an actor there, ``groupflow.rollout.ray_host``), fed versions as transport tickets
    (``publish``)."""

    async_on_pool: bool

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
        """A picklable callable that builds the rollout side's frozen copy of this policy."""
        ...

    def snapshot(self, copy: bool = True) -> dict[str, Any]: ...

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]: ...

    def load(self, state: dict[str, Any], path: Path) -> None: ...

    def shutdown(self) -> None: ...


def weights_nbytes(weights: dict[str, Any]) -> int:
    """Bytes of a name → tensor dict (what a weight transfer moved)."""
    return sum(int(t.numel()) * t.element_size() for t in weights.values())
