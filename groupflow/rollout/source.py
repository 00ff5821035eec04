"""Where the driver's batches come from: one interface, a synchronous and an asynchronous source.

Design decision: the driver's step is the same whether the batch of step s is collected right
now with the current weights or was collected ahead on the rollout side with an older scheduled
version (``rollout.max_staleness``). What differs — when collection happens, where the weights go
after an update, what a checkpoint must keep so that a resume regenerates the same batches — is
behind ``RolloutSource``:

    start(step)          before the first batch of a ``fit`` (asynchronous: submit k+1 jobs)
    batch(step)          -> (batch, metrics): the batch of ``step``, rollout and rewards done
    after_update(version) -> metrics: the weights of ``version`` (s+1 after the update of step s)
                         go where generation needs them; logs ``weights/bytes_via_driver``
    state(step) / load_state(state)   checkpoint entries (loader, in-flight versions' weights)
    close()              stop background work; state stays readable (a later save or fit)

so ``Trainer.train_step`` has no branch on which one it is.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from groupflow.batch import Batch
from groupflow.distributed.transport import tensors_nbytes
from groupflow.policies.base import Moved
from groupflow.rollout.hosts import AsyncRollout, ring_slots, schedule_version
from groupflow.rollout.ray_host import TicketStore
from groupflow.rollout.spec import LoaderSpec, RolloutSpec, workflow_part
from groupflow.workflows.collect import Sampling, collect_step

log = logging.getLogger("groupflow")

__all__ = ["RolloutSource", "SyncRollout", "AsyncRolloutSource", "build_rollout_source"]


def token_staleness(batch, step: int) -> dict[str, float]:
    """In-flight weight updates: how stale the batch's tokens are when trained at ``step`` (the
    mean, the largest, the share of each staleness) and the share of samples whose tokens span
    several versions. Nothing without ``token_versions``."""
    if "token_versions" not in batch:
        return {}
    versions, mask = batch["token_versions"], batch["response_mask"].bool()
    stale = (step - versions)[mask]
    if stale.numel() == 0:
        return {}
    out = {"async/token_staleness_mean": float(stale.float().mean()),
           "async/token_staleness_max": float(stale.max())}  # fmt: skip
    for k, n in zip(*torch.unique(stale, return_counts=True)):
        out[f"async/token_staleness_{int(k)}_frac"] = float(n) / stale.numel()
    spans = torch.where(mask, versions, versions.max()).min(1).values < versions.max(1).values
    out["async/samples_switched_frac"] = float(spans.float().mean())
    return out


class RolloutSource(Protocol):
    def start(self, step: int) -> None: ...

    def batch(self, step: int) -> tuple[Batch, dict[str, float]]: ...

    def after_update(self, version: int) -> dict[str, float]: ...

    def state(self, step: int) -> dict[str, Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def transfer_metrics(moved: Moved) -> dict[str, float]:
    return {"weights/bytes_via_driver": float(moved.via_driver),
            "weights/bytes_between_nodes": float(moved.between_nodes)}  # fmt: skip


class SyncRollout:
    """Collect the batch of step s now, with the policy's current weights (version s); after an
    update, ``policy.sync`` pushes them to a separately placed rollout pool."""

    def __init__(self, policy, workflow, loader, sampling: Sampling):
        self.policy, self.workflow, self.loader, self.sampling = policy, workflow, loader, sampling

    def start(self, step: int) -> None:
        pass  # fit's policy.sync() already gave the rollout group the current weights

    def batch(self, step: int) -> tuple[Batch, dict[str, float]]:
        return collect_step(self.workflow, self.loader, self.sampling, step, step)

    def after_update(self, version: int) -> dict[str, float]:
        return transfer_metrics(self.policy.sync(version))

    def state(self, step: int) -> dict[str, Any]:
        return {"loader": self.loader.state_dict()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])

    def close(self) -> None:
        pass


class AsyncRolloutSource:
    """The batch of step s was collected on the rollout side (``groupflow.rollout.hosts``) with
    version max(0, s − k); after the update of step s the new version is published and the batch
    of step s+1+k submitted. The trainer's ``loader`` is the rollout side's replica's state when
    the side stops; the weights that batches to come need are kept here while no side holds them
    (from a checkpoint, or when one stopped). ``workflow``: what the side gets of the trainer's
    workflow (``rollout.spec.workflow_part``); with ``sampling`` and the loader's state it
    makes the side's ``RolloutSpec``."""

    def __init__(self, workflow, policy, loader, *, max_staleness: int, total_steps,
                 async_worker: str, async_mode: str, timeout_s: float,
                 sampling: Sampling | None = None):  # fmt: skip
        self.workflow, self.sampling, self.async_mode = workflow, sampling, async_mode
        self.policy, self.loader, self.k = policy, loader, max_staleness
        self.total_steps = total_steps  # a callable: a resume may raise run.total_steps
        self.process, self.eager = async_worker == "process", async_mode in ("eager", "in_flight")
        self.timeout_s = timeout_s
        self.rollouts: AsyncRollout | None = None
        self.snapshots: dict[int, dict] = {}  # version -> weights, while no side holds them
        self.step = 0  # the step whose batch comes next (what close keeps snapshots for)
        self.route: RingRoute | PoolRoute | None = None  # chosen by start (see there)

    def start(self, step: int) -> None:
        """Start the rollout side, publish the weights the next k+1 batches need (after a resume:
        the checkpoint's snapshots) and submit those batches.

        Two routes: by default the side runs in a child process (or thread) of the driver with a
        frozen model copy, and versions are copied into a shared-memory ring (one host). With a
        Ray rollout pool (``policy.async_on_pool``) the side runs in a Ray actor on the pool's
        node (``groupflow.rollout.ray_host``: workflow, loader replica, rewards), the pool's workers
        generate, and versions go to them as weight-transport tickets: the actor's rank sends,
        the pool fetches, the driver forwards only the ticket and receives finished batches."""
        k, total = self.k, self.total_steps()
        self.step = step
        jobs = {t: schedule_version(t, k) for t in range(step, min(step + k + 1, total))}
        for t, v in jobs.items():
            if v != step and v not in self.snapshots:
                raise RuntimeError(
                    f"no weights of policy version {v} to generate the batch of step {t} "
                    f"(rollout.max_staleness={k}): the checkpoint resumed from keeps the "
                    "snapshots of the staleness it was written with; resume with that value"
                )
        assert self.sampling is not None, "an asynchronous source that starts needs its sampling"
        spec = RolloutSpec(self.policy.start_async(), self.workflow, LoaderSpec.of(self.loader),
                           self.sampling, self.async_mode)  # fmt: skip
        on_pool = bool(getattr(self.policy, "async_on_pool", False))
        self.route = route = (PoolRoute if on_pool else RingRoute)(self.policy)
        self.rollouts = route.open(spec, max_staleness=k, process=self.process,
                                   timeout_s=self.timeout_s, eager=self.eager)  # fmt: skip
        needed = (self.needed_versions(step) & self.snapshots.keys()) - {step}
        route.publish_start(self.rollouts, step, {v: self.snapshots[v] for v in sorted(needed)})
        for t, v in jobs.items():
            self.rollouts.submit(t, v)
        self.snapshots = {}  # the rollout side's ring holds them now

    def batch(self, step: int) -> tuple[Batch, dict[str, float]]:
        assert self.rollouts is not None, "start() first"
        batch, metrics = self.rollouts.result(step)
        staleness = step - float(batch["version"].float().mean())
        return batch, {**metrics, "async/staleness": staleness, **token_staleness(batch, step)}

    def after_update(self, version: int, submit: bool = True) -> dict[str, float]:
        """Version ``version`` (= s+1 after the update of step s) exists: publish it and submit the
        batch of step s+1+k with its scheduled version."""
        self.step = version
        assert self.route is not None and self.rollouts is not None, "start() first"
        moved = self.route.publish_current(self.rollouts, version)
        t = version + self.k
        if submit and t < self.total_steps():
            self.rollouts.submit(t, schedule_version(t, self.k))
        return transfer_metrics(moved)

    def _held(self, version: int) -> dict:
        """A version's weights held by the running side (on a pool: fetched through the
        transport, into the driver — only for a checkpoint or when the side stops)."""
        assert self.route is not None and self.rollouts is not None
        return self.route.read(self.rollouts.ring.read(version))

    def needed_versions(self, step: int) -> set[int]:
        """The versions the batches of steps step..step+k are scheduled with (a checkpoint keeps
        all but the current one, ``step``, which is the policy itself)."""
        return {schedule_version(t, self.k) for t in range(step, step + self.k + 1)}

    def state(self, step: int) -> dict[str, Any]:
        """A resume collects the next k+1 batches again (in flight now, or not yet submitted at the
        last step: a resume may raise run.total_steps), each with its version's weights, kept
        here; the loader as the next step's batch found it."""
        versions = self.needed_versions(step) - {step}
        if self.rollouts is not None:
            loader = self.rollouts.loader_state
            held = versions & set(self.rollouts.ring.versions())
            weights = {v: self._held(v) for v in sorted(held)}
        else:
            loader = self.loader.state_dict()
            weights = {v: self.snapshots[v] for v in sorted(versions & self.snapshots.keys())}
        state: dict[str, Any] = {"loader": loader, "async_rollout": {"versions": sorted(weights)}}
        # copies: ring slots are views of one buffer, which safetensors refuses to write
        state.update({f"rollout_weights_v{v}": {n: t.clone() for n, t in w.items()}
                      for v, w in weights.items()})  # fmt: skip
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        versions = state.get("async_rollout", {}).get("versions", [])
        self.snapshots = {int(v): state[f"rollout_weights_v{v}"] for v in versions}

    def close(self) -> None:
        """Stop the rollout side; the loader and the snapshots that batches to come need stay
        here (a later ``fit`` or ``save`` continues from them)."""
        if self.rollouts is None:
            return
        rollouts = self.rollouts
        try:
            self.loader.load_state_dict(rollouts.loader_state)
            held = set(rollouts.ring.versions())
            try:
                self.snapshots = {v: {n: t.clone() for n, t in self._held(v).items()}
                                  for v in self.needed_versions(self.step) & held}  # fmt: skip
            except Exception as e:  # noqa: BLE001 - e.g. a dead actor rank: do not mask the error
                # that stopped the run; a checkpoint written now would lack these versions, and
                # resuming from it says so (the last complete checkpoint resumes exactly)
                log.warning("rollout: could not keep the in-flight weight versions (%s)", e)
                self.snapshots = {}
        finally:
            self.rollouts = None
            rollouts.close()


class RingRoute:
    """One host: the side runs in a child process (or thread) with a frozen copy of its own, and
    the driver — which holds the actor — copies every version into the shared-memory ring."""

    def __init__(self, policy):
        self.policy, self.current = policy, None

    def open(self, spec: RolloutSpec, *, max_staleness: int, process: bool, timeout_s: float,
             eager: bool) -> AsyncRollout:  # fmt: skip
        # the ring's layout, and the first version publish_start sends (one gather, not two)
        self.current = self.policy.snapshot(copy=False)
        return AsyncRollout(spec, self.current, max_staleness=max_staleness, process=process,
                            timeout_s=timeout_s, eager=eager)  # fmt: skip

    def publish_start(self, rollouts: AsyncRollout, step: int, held: dict[int, dict]) -> None:
        """The versions the first batches need, oldest first: a checkpoint's snapshots (``held``)
        and the policy's weights as ``step``."""
        current, self.current = {step: self.current}, None  # publish copies it
        for v, weights in sorted({**held, **current}.items()):
            rollouts.publish(v, weights)

    def publish_current(self, rollouts: AsyncRollout, version: int) -> Moved:
        """The policy's weights as ``version``; the driver's process copied them (one host)."""
        weights = self.policy.snapshot(copy=False)  # publish copies
        rollouts.publish(version, weights)
        return Moved(tensors_nbytes(weights))

    def read(self, held: dict) -> dict:
        return held


class PoolRoute:
    """The policy's Ray rollout pool: the side runs in a Ray actor there, and versions travel as
    weight-transport tickets — the actor's rank sends, the pool's workers fetch, the driver
    forwards only the ticket."""

    def __init__(self, policy):
        self.policy, self.transport = policy, policy.transport

    def open(self, spec: RolloutSpec, *, max_staleness: int, process: bool, timeout_s: float,
             eager: bool) -> AsyncRollout:  # fmt: skip
        return AsyncRollout(
            spec, {}, max_staleness=max_staleness, process=False, timeout_s=timeout_s,
            eager=eager, ring=TicketStore(ring_slots(max_staleness)),
            pool=self.policy.rollout_pool,
        )  # fmt: skip

    def publish_start(self, rollouts: AsyncRollout, step: int, held: dict[int, dict]) -> None:
        """The actor's current weights as ``step`` (its rank sends), then a checkpoint's
        snapshots (``held``; these pass through the driver once, at a resume)."""
        self.publish_current(rollouts, step)
        for v, weights in held.items():
            rollouts.publish(v, self.transport.send(v, weights))

    def publish_current(self, rollouts: AsyncRollout, version: int) -> Moved:
        """The actor's current weights as ``version``; what the ticket moves (``moved_by``: the
        bytes inside it, and across nodes once the pool's workers fetch it)."""
        ticket = self.policy.publish(version)
        rollouts.publish(version, ticket)
        return self.policy.moved_by(ticket)

    def read(self, ticket) -> dict:
        return self.transport.receive(ticket, role="checkpoint")


def build_rollout_source(cfg, built_cfg, run_dir, policy, workflow, loader, inputs):
    """The synchronous source, or with ``rollout.max_staleness >= 1`` the asynchronous one.
    ``built_cfg``: the config the run was built from (hub ids resolved), which the rewards'
    description, and a user's workflow class that does not travel as built (``RebuiltWorkflow``),
    come from."""
    r = cfg.rollout
    sampling = Sampling.from_config(cfg)
    if not r.max_staleness:
        return SyncRollout(policy, workflow, loader, sampling)
    rewards = tuple(inputs.rewards if inputs else ())
    return AsyncRolloutSource(
        workflow_part(built_cfg, run_dir, workflow, rewards), policy, loader,
        max_staleness=r.max_staleness, total_steps=lambda: cfg.run.total_steps,
        async_worker=r.async_worker, async_mode=r.async_mode, timeout_s=cfg.run.worker_timeout_s,
        sampling=sampling,
    )  # fmt: skip
