"""The asynchronous rollout's side: the whole collect stage, away from the trainer.

Design decision (profiled, see ``benchmarks/README.md``): when only generation ran in a child
process, the trainer's process still decoded completions, computed rewards, assembled batches,
unpickled results and served one file descriptor per weight tensor to the child — Python in
threads that waited for the training loop's GIL at every step, so on a small model the two sides
barely overlapped. Here the rollout side holds *everything a workflow's collect needs*: a frozen
copy of the model (a policy's ``RolloutView``: its own rollout worker, tokenizer, sampling
parameters and, when configured, its own reward-model copy), its own copy of the trainer's
workflow and its own prompt loader. The trainer only sends small messages and publishes weights
into a shared ``WeightRing``; it receives finished, contract-checked batches.

The side is built from a ``RolloutSpec`` (``groupflow.rollout.spec``) of *built* parts — the
trainer's workflow without its policy (encoded prompts, options), a description of its rewards,
the loader's options and state, the sampling plan, the async mode — and attaches its own policy
view to that workflow; it reads no config section (review of 2026-12-01, Debt 3). Every
built-in workflow, the agent workflow included, travels so; only a user's workflow class that
does not declare ``travels_as_built`` is rebuilt from the config there, behind
``rollout.spec.RebuiltWorkflow``.

Prompts stay bit-identical to a synchronous run because the side's loader is a replica of the
trainer's: it starts from the trainer's loader state and draws in step order (refills included),
and every result carries the loader state after it, which is what a checkpoint saves.

Protocol (one pipe; the same ``serve`` loop runs in a spawned child process, in a thread of
the trainer's process for ``rollout.async_worker: thread`` and as the fallback when the spec
cannot be pickled, or in a Ray actor on a rollout pool, ``groupflow.rollout.ray_host``): the trainer sends ``("weights", v)`` after writing version ``v`` into the
ring, ``("job", step, v)`` to collect a step's batch with version ``v`` and ``None`` to stop;
the side answers every job, in order, with a pickled ``("result", step, batch, metrics,
loader_state)`` or ``("error", step, payload)``. A shared status (phase, step, version) says what
the side is doing, so that a timeout can name it (loading weights vs collecting).
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import traceback
from collections import deque
from collections.abc import Callable

import torch

from groupflow.rollout.spec import RolloutSpec
from groupflow.workflows import close_run
from groupflow.workflows.collect import collect_step

__all__ = ["RolloutSpec", "RolloutSide", "serve", "process_main", "IDLE", "LOADING", "COLLECTING"]

IDLE, LOADING, COLLECTING = 0, 1, 2  # the status's phase
SPEC_UNPICKLABLE = "the rollout spec cannot be unpickled in the child process"


class RolloutSide:
    """A workflow, a prompt loader and a frozen model: ``collect(step, version)`` as the trainer's
    synchronous loop would, with the weights last given to ``load``. Built from a
    ``RolloutSpec`` of built parts: it reads no config section."""

    def __init__(self, spec: RolloutSpec):
        self.policy, self.workflow, self.loader = spec.build()
        self.sampling = spec.sampling
        self.async_mode = spec.async_mode

    @property
    def in_flight(self) -> bool:
        """rollout.async_mode=in_flight: versions also reach the engine between decode steps."""
        return self.async_mode == "in_flight"

    def take_updates_in_flight(self, updates) -> None:
        self.policy.take_updates_in_flight(updates)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        self.policy.load_weights(weights)

    def collect(self, step: int, version: int) -> tuple:
        return collect_step(self.workflow, self.loader, self.sampling, step, version)

    def close(self) -> None:
        close_run(getattr(self, "workflow", None), self.policy)


def serve(conn, side: RolloutSide, ring, status: torch.Tensor, eager: bool,
          updates: Callable | None = None) -> None:  # fmt: skip
    """Answer jobs until ``None`` or the pipe closes. ``eager``: a job takes the newest version
    published when it starts (at least its scheduled one). With ``side.in_flight``
    (rollout.async_mode=in_flight) the engine also takes each version published while the job
    runs, between two decode steps: read from ``ring`` here (``in_flight_updates``), or, on a Ray
    rollout pool whose workers decode in processes of their own, ``updates``
    (``ray_host.BoardUpdates``: each worker fetches the ticket it answers through the weight
    transport; the status does not show those loads). After a failure every later job is
    answered with the same error: it must not run on a side in an unknown state."""
    held, newest, failed = None, -1, None
    pending: deque = deque()
    job = [0]  # the step being collected (what a status written mid-job names)
    # the agent workflow's server calls in_flight_updates on its decode thread, which may still
    # decode (a late call) while this loop waits on the pipe: one reader at a time
    pipe = threading.Lock()

    def take_published() -> int:
        """The newest version published so far (jobs and the stop that arrive meanwhile wait)."""
        nonlocal newest
        while conn.poll():
            m = conn.recv()
            if m is not None and m[0] == "weights":
                newest = max(newest, m[1])
            else:
                pending.append(m)
        return newest

    def in_flight_updates() -> tuple[int, dict | None]:
        nonlocal held
        assert held is not None, "a job loads its version before it decodes"
        if not pipe.acquire(blocking=False):  # the loop waits for its next job: nothing new
            return held, None
        try:
            version = take_published()
            if version <= held:
                return held, None
            status[:] = torch.tensor([LOADING, job[0], version])
            weights = ring.read(version)
            held = version
            status[:] = torch.tensor([COLLECTING, job[0], version])
            return version, weights
        finally:
            pipe.release()

    try:
        if side.in_flight:
            side.take_updates_in_flight(in_flight_updates if updates is None else updates)
    except BaseException as e:  # noqa: BLE001 - answered to the trainer with the first job
        failed = e
    while True:
        try:
            with pipe:
                msg = pending.popleft() if pending else conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        if msg[0] == "weights":
            newest = max(newest, msg[1])
            continue
        _, step, version = msg
        job[0] = step
        try:
            if failed is not None:
                raise failed
            if eager:  # what was published while the previous job ran
                with pipe:
                    version = max(version, take_published())
            if version != held:
                status[:] = torch.tensor([LOADING, step, version])
                side.load(ring.read(version))
                held = version
            status[:] = torch.tensor([COLLECTING, step, version])
            batch, metrics = side.collect(step, version)
            reply = ("result", step, batch, metrics, side.loader.state_dict())
        except BaseException as e:  # noqa: BLE001 - answered to the trainer, re-raised there
            failed = failed or e
            reply = ("error", step, error_payload(failed, traceback.format_exc()))
        status[0] = IDLE
        try:
            conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:  # the trainer closed its end (it stopped us): nobody to answer
            return


def error_payload(error: BaseException, text: str) -> tuple:
    """``("exception", pickled, traceback)`` when the error survives a pickle round trip (its type
    matters to callers), else ``("text", "Type: message", traceback)``."""
    try:
        data = pickle.dumps(error)
        pickle.loads(data)
        return ("exception", data, text)
    except Exception:  # noqa: BLE001 - many exception classes cannot be rebuilt from their args
        return ("text", f"{type(error).__name__}: {error}", text)


def process_main(conn, spec_bytes: bytes, ring, status: torch.Tensor, eager: bool) -> None:
    """The child process: build the side from the pickled spec, answer ``(ok, value)``, serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops us
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # no tokenizer thread pool beside the trainer
    _exit_with_parent()
    try:
        spec = pickle.loads(spec_bytes)
    except BaseException:  # noqa: BLE001 - e.g. a reward defined in a notebook: not importable here
        conn.send((False, f"{SPEC_UNPICKLABLE}:\n{traceback.format_exc()}"))
        return
    torch.set_num_threads(spec.threads)
    try:
        side = RolloutSide(spec)
    except BaseException:  # noqa: BLE001 - the trainer reports it with the traceback
        conn.send((False, traceback.format_exc()))
        return
    conn.send((True, None))
    try:
        serve(conn, side, ring, status, eager)
    finally:
        side.close()


def _exit_with_parent() -> None:
    """A trainer killed with SIGKILL cannot stop us: leave when the parent is gone, even when a
    job is blocked (a reward or an environment that hangs)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="groupflow-parent-watch", daemon=True).start()
