"""Worker groups: the driver's handle on N workers, in-process (``local``), each in a child process
of its own (``process``, ``groupflow.distributed.process``) or as Ray actors (``ray``).

Design decision: one class, two tiny backends behind the same four-method surface (start a
worker, call a method on all of them, wait, shut down). Methods that a worker class marks with
``@register(mode)`` appear on the group as ordinary methods, so the driver writes
``actor.update(batch)`` whatever the backend. Every remote call has a timeout, and any failure —
an exception in a worker, a dead process, a timeout — becomes a ``WorkerError`` naming the worker
class, rank, method and the remote traceback: the driver never hangs and never shows a bare Ray
error.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

from groupflow.distributed.dispatch import collect, dispatch_mode, split_args
from groupflow.distributed.placement import PoolSpec, RayPool
from groupflow.distributed.process import ProcessHost, serve_worker

__all__ = ["WorkerGroup", "WorkerError", "RayOptions"]


class WorkerError(RuntimeError):
    """A worker method failed, its process died, or it timed out."""

    def __init__(self, worker: str, rank: int, method: str, detail: str):
        self.worker, self.rank, self.method, self.detail = worker, rank, method, detail
        super().__init__(f"{worker} rank {rank}: {method}() failed: {detail}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Host:
    """Holds one worker; runs methods and turns exceptions into (False, traceback text)."""

    def __init__(
        self,
        factory: Callable[..., Any],
        rank: int,
        world_size: int,
        env: dict[str, str],
        kwargs: dict,
    ):
        os.environ.update(env)
        # One torch thread per worker process: two busy processes with two threads each run ~3× slower
        # on a 2-core machine (measured). In-process (local) workers keep the driver's setting.
        if env.get("GROUPFLOW_WORKER_THREADS"):
            import torch

            torch.set_num_threads(int(env["GROUPFLOW_WORKER_THREADS"]))
        self.worker = factory(rank=rank, world_size=world_size, **kwargs)

    def call(self, method: str, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        try:
            return True, getattr(self.worker, method)(*args, **kwargs)
        except BaseException:  # noqa: BLE001 - shipped back to the driver with its traceback
            return False, traceback.format_exc()

    def ready(self) -> bool:
        return True

    def node_ip(self) -> str:
        try:
            import ray

            return ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001 - local backend or no Ray
            return "127.0.0.1"


class RayOptions:
    def __init__(
        self,
        address: str | None = None,
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float = 0.0,
    ):
        self.address = address
        self.num_cpus_per_worker = num_cpus_per_worker
        self.num_gpus_per_worker = num_gpus_per_worker


def ensure_ray(address: str | None, num_cpus: int | None = None):
    """Connect to ``address`` (else ``$RAY_ADDRESS``) or start a new local Ray instance bound to
    localhost."""
    os.environ.setdefault(
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"
    )  # bind 127.0.0.1 unless clustered
    import ray

    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")  # Ray's own variable, if a user set it
        if address:
            ray.init(address=address, include_dashboard=False, log_to_driver=True)
        else:
            # "local": a new instance even when a cluster started on this machine (`ray start`, or
            # another run's) left its address in /tmp/ray, which a bare ray.init() would join
            # and then refuse num_cpus for
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=True,
                _node_ip_address="127.0.0.1",
            )
    return ray


class WorkerGroup:
    """N workers of one class; decorated methods are exposed with their dispatch mode."""

    def __init__(
        self,
        factory: Callable[..., Any],
        world_size: int = 1,
        *,
        backend: str = "local",
        timeout_s: float = 600.0,
        startup_timeout_s: float = 300.0,
        ray_options: RayOptions | None = None,
        worker_threads: int | None = 1,
        pool: PoolSpec | None = None,
        placement_timeout_s: float | None = None,
        role_name: str | None = None,
        **kwargs: Any,
    ):
        if backend not in ("local", "process", "ray"):
            raise ValueError(f"unknown backend '{backend}'; valid: local, process, ray")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.name = getattr(factory, "__name__", str(factory))
        if role_name:  # errors name the role too: "InferenceWorker (rollout role) rank 0: ..."
            self.name = f"{self.name} ({role_name} role)"
        self.backend, self.world_size, self.timeout_s = backend, world_size, timeout_s
        cls, factory = (
            factory,
            getattr(factory, "create", factory),
        )  # a class may bring a factory classmethod
        self.startup_timeout_s = max(startup_timeout_s, timeout_s)
        self._factory, self._cls = factory, cls
        self._pool: RayPool | None = None
        self._node_ids: list[str] | None = None  # node_ids(), once placed
        # per rank: a _Host (local), a ProcessHost (process) or a Ray actor handle of one (ray)
        self._hosts: list[Any] = []
        env = {"GROUPFLOW_WORLD_SIZE": str(world_size)}
        if world_size > 1:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        if backend == "local":
            self._hosts = [
                _Host(factory, r, world_size, {**env, "GROUPFLOW_WORKER_THREADS": ""}, kwargs)
                for r in range(world_size)
            ]
        elif backend == "process":
            self._start_processes(factory, env, kwargs, worker_threads)
        else:
            self._start_ray(factory, env, kwargs, ray_options, pool, worker_threads,
                            placement_timeout_s)  # fmt: skip
        self._bind_methods()

    def _start_processes(self, factory, env: dict, kwargs: dict, worker_threads: int | None):
        env["GROUPFLOW_WORKER_THREADS"] = str(worker_threads or 1)
        self._hosts = []
        try:
            for r in range(self.world_size):
                target = serve_worker(_Host, factory, r, self.world_size, env, kwargs)
                self._hosts.append(ProcessHost(*target, self.startup_timeout_s))
        except (ChildProcessError, TimeoutError) as e:
            self.shutdown()
            raise WorkerError(self.name, len(self._hosts), "__init__", str(e)) from None

    def _start_ray(self, factory, env: dict, kwargs: dict, ray_options: RayOptions | None,
                   pool: PoolSpec | None, worker_threads: int | None,
                   placement_timeout_s: float | None):  # fmt: skip
        world_size = self.world_size
        opts = ray_options or RayOptions()
        spec = pool or PoolSpec(
            nodes=1, workers_per_node=world_size, cpus_per_worker=opts.num_cpus_per_worker,
            gpus_per_worker=opts.num_gpus_per_worker, name=self.name,
        )  # fmt: skip
        if spec.world_size != world_size:
            raise ValueError(
                f"pool '{spec.name}' holds {spec.world_size} workers "
                f"({spec.nodes} nodes × {spec.workers_per_node}), but world_size is {world_size}"
            )
        # Declare enough logical CPUs for every worker plus the probe: with Ray's default (the
        # core count) a third 1-CPU actor on a 2-core machine waits forever.
        needed = int(world_size * spec.cpus_per_worker) + 2
        ray = ensure_ray(opts.address, num_cpus=max(os.cpu_count() or 1, needed))
        if worker_threads:
            env["GROUPFLOW_WORKER_THREADS"] = str(worker_threads)
        self._pool = RayPool(spec, timeout_s=placement_timeout_s or self.startup_timeout_s)
        remote: Any = ray.remote(_Host)  # Ray types the actor class as a proxy of _Host
        self._hosts = []
        try:
            if world_size > 1:
                # the rendezvous address must be rank 0's node, which may be another machine
                where = self._pool.options(0)["scheduling_strategy"]
                probe = remote.options(num_cpus=0, scheduling_strategy=where).remote(
                    _Nothing, 0, 1, {}, {}
                )
                env["MASTER_ADDR"] = self._ray_get(
                    ray, [probe.node_ip.remote()], "node_ip", startup=True
                )[0]
                ray.kill(probe)
            self._hosts = [
                remote.options(**self._pool.options(r)).remote(
                    factory, r, world_size, {**env, "LOCAL_RANK": str(spec.slot(r)[1])}, kwargs
                )
                for r in range(world_size)
            ]
            # Constructors run concurrently (process-group rendezvous needs every rank); surface
            # their failures here rather than at the first call.
            self._ray_get(ray, [h.ready.remote() for h in self._hosts], "__init__", startup=True)
        except BaseException:
            # a failed start must not leave actors or reserved bundles behind: the next
            # group's placement would wait for resources that are never freed
            self.shutdown()
            raise

    def _bind_methods(self) -> None:
        for attr in dir(self._cls):
            mode = dispatch_mode(getattr(self._cls, attr, None))
            if mode is not None and not attr.startswith("_"):
                setattr(self, attr, self._bind(attr, mode))

    # ----- copies in other processes --------------------------------------------------------
    def __getstate__(self) -> dict:
        """A Ray group travels to another process (the rollout loop's actor calls the same
        workers) as its handles: without the bound methods (rebound on arrival) and without the
        pool, which only the original releases (a copy's ``shutdown`` kills no reservation)."""
        if self.backend != "ray":
            raise TypeError(f"a {self.backend} worker group ({self.name}) cannot leave its process")
        state = {k: v for k, v in self.__dict__.items() if not hasattr(v, "__wrapped_method__")}
        return {**state, "_pool": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._bind_methods()

    def placement(self, rank: int = 0) -> dict[str, Any]:
        """Ray ``.options`` that put another actor next to worker ``rank`` (its bundle, on its
        node) without reserving resources of its own."""
        if self._pool is None:
            raise RuntimeError(f"{self.name} has no Ray pool (backend {self.backend}, or a copy)")
        return {**self._pool.options(rank), "num_cpus": 0, "num_gpus": 0}

    # ----- calling ------------------------------------------------------------------------------
    def _bind(self, method: str, mode: str) -> Callable:
        def call(*args, **kwargs):
            return self.execute(method, mode, *args, **kwargs)

        call.__name__ = method
        call.__wrapped_method__ = method  # what __getstate__ leaves out
        return call

    def execute(self, method: str, mode: str, *args, **kwargs) -> Any:
        return self._start(method, mode, *args, **kwargs)()

    def submit(self, method: str, *args, **kwargs) -> Callable[[], Any]:
        """Start a registered method on the workers without waiting; returns the function that
        waits (same timeout and errors) and gives what the method's call would have. On Ray the
        workers run meanwhile — e.g. a collective weight transfer whose other side the caller
        starts next; in-process backends run the method here, before returning."""
        mode = dispatch_mode(getattr(self._cls, method, None))
        if mode is None:
            raise AttributeError(f"{self.name} has no registered method '{method}'")
        return self._start(method, mode, *args, **kwargs)

    def _start(self, method: str, mode: str, *args, **kwargs) -> Callable[[], Any]:
        per_rank, pad = split_args(mode, self.world_size, args, kwargs)
        ranks = [0] if mode == "one" else range(self.world_size)
        inputs = len(args[0]) if mode == "dp" else 0
        if self.backend == "ray":
            import ray

            futures = [self._hosts[r].call.remote(method, *per_rank[r]) for r in ranks]
            return lambda: collect(
                mode, self._ray_get(ray, futures, method), inputs=inputs, pad=pad
            )
        if self.backend == "local":
            results = [self._call_local(r, method, *per_rank[r]) for r in ranks]
        else:
            results = [self._call_process(r, method, *per_rank[r]) for r in ranks]
        out = collect(mode, results, inputs=inputs, pad=pad)
        return lambda: out

    def _call_local(self, rank: int, method: str, args: tuple, kwargs: dict) -> Any:
        # In-process: the original exception propagates (its type matters to callers), with a note
        # saying where it happened.
        try:
            return getattr(self._hosts[rank].worker, method)(*args, **kwargs)
        except Exception as e:
            e.add_note(f"(in {self.name} rank {rank}, method {method}())")
            raise

    def _call_process(self, rank: int, method: str, args: tuple, kwargs: dict) -> Any:
        try:
            ok, value = self._hosts[rank].call(method, args, kwargs, self.timeout_s)
        except (ChildProcessError, TimeoutError) as e:
            raise WorkerError(self.name, rank, method, str(e)) from None
        return self._check(rank, method, ok, value)

    def _check(self, rank: int, method: str, ok: bool, value: Any) -> Any:
        if not ok:
            raise WorkerError(
                self.name, rank, method, f"raised an exception; remote traceback:\n{value}"
            )
        return value

    def _ray_get(self, ray, futures: list, method: str, startup: bool = False) -> list:
        """Wait for every rank (one shared deadline) and report the root cause of a failure.

        When one rank dies, its peers usually fail too (a collective loses its partner); the
        dead rank is reported first because it is the cause, the others' errors are the effect.
        """
        import time

        from ray.exceptions import GetTimeoutError, RayActorError

        timeout = self.startup_timeout_s if startup else self.timeout_s
        deadline = time.monotonic() + timeout
        outcomes: list[tuple[str, Any]] = []
        for fut in futures:
            try:
                outcomes.append(("ok", ray.get(fut, timeout=max(0.0, deadline - time.monotonic()))))
            except GetTimeoutError:
                outcomes.append(("timeout", f"no answer within {timeout:g} s (timeout)"))
            except RayActorError as e:
                where = self.node_report(len(outcomes))
                outcomes.append(
                    ("died", f"the worker process died ({type(e).__name__}: {e}){where}")
                )
        for kind in ("died", "timeout"):
            for rank, (k, detail) in enumerate(outcomes):
                if k == kind:
                    raise WorkerError(self.name, rank, method, detail)
        return [self._check(rank, method, *value) if isinstance(value, tuple) else value
                for rank, (_, value) in enumerate(outcomes)]  # fmt: skip

    def node_ids(self) -> list[str]:
        """The node each rank runs on: Ray's node ids for a Ray pool (from its placement groups,
        looked up once: a placement group's bundles never move); one name for every rank of an
        in-process or local-process group (this host)."""
        if self._pool is None:
            return ["this-host"] * self.world_size
        if self._node_ids is None:
            from ray.util import placement_group_table

            tables, out = {}, []
            for rank in range(self.world_size):
                node, index = self._pool.spec.slot(rank)
                if node not in tables:
                    table = placement_group_table(self._pool.groups[node])
                    tables[node] = table["bundles_to_node_id"]
                out.append(str(tables[node][index]))
            self._node_ids = out
        return list(self._node_ids)

    def node_report(self, rank: int) -> str:
        """'; it ran on node <id> (<ip>[, now dead])' for a rank of this group's Ray pool, or ''
        if unknown (not on Ray, or the group travelled to another process): on a cluster the
        node is what a failure report needs first (a whole machine may be gone)."""
        if self._pool is None:
            return ""
        import ray
        from ray.util import placement_group_table

        try:
            node, index = self._pool.spec.slot(rank)
            node_id = placement_group_table(self._pool.groups[node])["bundles_to_node_id"][index]
            nodes = {n["NodeID"]: n for n in ray.nodes()}
        except Exception:  # noqa: BLE001 - a report of where must not hide the failure itself
            return ""
        info = nodes.get(node_id, {})
        state = "" if info.get("Alive", True) else ", now dead"
        return f"; it ran on node {node_id} ({info.get('NodeManagerAddress', '?')}{state})"

    def shutdown(self) -> None:
        if self.backend == "ray":
            import ray

            for h in self._hosts:
                ray.kill(h)
            if self._pool is not None:
                self._pool.remove()
                self._pool = None
        elif self.backend == "process":
            for h in self._hosts:
                h.close()
        self._hosts = []

    # local backend only: direct access for tests and single-process tools
    def local_worker(self, rank: int = 0) -> Any:
        if self.backend != "local":
            raise RuntimeError("local_worker() is only available with the local backend")
        return self._hosts[rank].worker

    def __getattr__(self, name: str) -> Any:
        # Inspection convenience (tests, tools): with in-process workers, read rank 0's attributes.
        hosts = self.__dict__.get("_hosts")
        if name.startswith("_") or not hosts:
            raise AttributeError(name)
        if self.__dict__.get("backend") == "local":
            return getattr(hosts[0].worker, name)
        raise AttributeError(
            f"WorkerGroup has no method '{name}'; worker attributes are only reachable in-process (backend=local)"
        )


class _Nothing:
    def __init__(self, **_: Any):
        pass
