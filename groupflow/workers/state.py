"""A trained module's checkpointable state: its optimizer, LR schedule and non-finite guard.

Design decision: the actor, the critic and the diffusion worker each train one root (FSDP2-sharded
or not) with AdamW, a learning-rate schedule and — actor and diffusion — a guard that skips
non-finite steps. What a checkpoint takes from them is the same for all three: the small,
rank-identical train state (schedule, guard), every rank's DCP shards (model, optimizer, frozen
copies that are part of the training state), and a single worker's whole state. It lives here
once, and each worker has one (composition: a worker holds a ``TrainedState``, it is not one),
so the three resume alike and a change to what a checkpoint holds is made in one place.
``CheckpointMethods`` is the matching half of their dispatch surface (the methods a policy's
checkpoint code calls through a WorkerGroup), the one base class a trained worker has.
"""

from __future__ import annotations

from torch import nn

from groupflow.distributed import register
from groupflow.distributed.parallel import load_sharded_state, save_sharded_state
from groupflow.utils.optim import apply_configured_hyperparameters
from groupflow.workers.common import NonFiniteGuard

__all__ = ["TrainedState", "CheckpointMethods"]


class TrainedState:
    """``root`` (the module the optimizer steps), its optimizer and schedule, the guard (None: the
    worker has none) and ``extra`` frozen modules saved beside the root's shards."""

    def __init__(
        self,
        root: nn.Module,
        optimizer,
        scheduler,
        nonfinite: NonFiniteGuard | None = None,
        *,
        sharded: bool = False,
        extra: dict[str, nn.Module] | None = None,
    ):
        self.root, self.optimizer, self.scheduler = root, optimizer, scheduler
        self.nonfinite, self.sharded, self.extra = nonfinite, sharded, extra or {}

    def train_state(self) -> dict:
        """The small, rank-identical part: the schedule's position and the guard's counts."""
        out = {"scheduler": self.scheduler.state_dict()}
        if self.nonfinite is not None:
            out["nonfinite"] = self.nonfinite.state()
        return out

    def load_train_state(self, state: dict) -> None:
        """Restore :meth:`train_state` (or a whole state holding it). The configured
        hyperparameters win over the checkpoint's, so a resumed run can change them."""
        self.scheduler.load_state_dict(state["scheduler"])
        apply_configured_hyperparameters(self.optimizer, self.scheduler)
        if self.nonfinite is not None:
            self.nonfinite.load(state.get("nonfinite", [0, 0]))  # older checkpoints: none

    def local_state(self, model: nn.Module) -> dict:
        """One worker's whole state: ``model``'s weights (a copy), the optimizer's by index."""
        if self.sharded:
            raise RuntimeError("state_dict() is for one worker; sharded workers use save_sharded()")
        return {
            "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            **self.train_state(),
        }

    def load_local_state(self, model: nn.Module, state: dict) -> None:
        """Restore :meth:`local_state` into ``model`` and the optimizer."""
        model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_train_state(state)

    def save_sharded(self, path: str) -> None:
        """Every rank writes its shards of the root, the optimizer and the extra modules."""
        save_sharded_state(self.root, self.optimizer, path, self.extra)

    def load_sharded(self, path: str, train_state: dict | None) -> None:
        """Load shards written by any number of ranks (DCP reshards), then the train state."""
        load_sharded_state(self.root, self.optimizer, path, self.extra)
        if train_state:
            self.load_train_state(train_state)


class CheckpointMethods:
    """A trained worker's checkpoint methods, each delegating to its ``trained`` state;
    :meth:`_loaded` runs after every load (a worker with copies of its weights refreshes them)."""

    trained: TrainedState
    model: nn.Module  # what a single worker's state holds (the unwrapped model)

    def _loaded(self) -> None:
        """Called after any load; nothing to refresh by default."""

    @register("rank0")
    def state_dict(self) -> dict:
        return self.trained.local_state(self.model)

    @register("rank0")
    def load_state_dict(self, state: dict) -> None:
        self.trained.load_local_state(self.model, state)
        self._loaded()

    @register("rank0")
    def train_state(self) -> dict:
        """The small, rank-identical part of the training state (schedule, guard)."""
        return self.trained.train_state()

    @register("rank0")
    def save_sharded(self, path: str) -> None:
        """Every rank writes its shards of model and optimizer (torch.distributed.checkpoint)."""
        self.trained.save_sharded(path)

    @register("rank0")
    def load_sharded(self, path: str, train_state: dict | None = None) -> None:
        """Load a sharded checkpoint written by any number of ranks (DCP reshards on load)."""
        self.trained.load_sharded(path, train_state)
        self._loaded()
