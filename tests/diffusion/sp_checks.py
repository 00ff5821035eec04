"""The checks the sequence-parallel tests of every diffusion kind share: one training step's
velocity, loss and gradients on two gloo ranks (torch.multiprocessing, one torch thread each)
against the single-process model's. Each test file supplies its own models and inputs as a
module-level ``steps(sp) -> {variant: step(...)}`` (picklable by name for the spawned ranks)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from groupflow.distributed.ulysses import SequenceGroup, sequence_groups

Steps = Callable[[SequenceGroup | None], dict]


def step(model, out: torch.Tensor, weights: torch.Tensor) -> dict:
    """A weighted loss of ``out`` (the model's velocity) backpropagated; what the ranks compare."""
    loss = (out * weights).mean()
    loss.backward()
    return {"out": out.detach(), "loss": float(loss.detach()),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "params": sum(1 for p in model.parameters() if p.requires_grad)}  # fmt: skip


def _rank(rank: int, world: int, store: str, out: str, steps: Steps) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        results = steps(sequence_groups(rank, world, world))
        for r in results.values():
            for g in r["grads"].values():  # the members' shares add up (FSDP2 does it there)
                dist.all_reduce(g)
        if rank == 0:
            torch.save(results, out)
        dist.barrier()  # neither rank tears gloo down while its peer still talks
    finally:
        dist.destroy_process_group()


def check_two_ranks_equal_one(steps: Steps, tmp_path) -> None:
    """``steps`` on two sequence-parallel ranks gives the single process's velocity, loss and
    every gradient (a real one: most parameters move)."""
    out = tmp_path / "results.pt"
    mp.spawn(_rank, args=(2, str(tmp_path / "store"), str(out), steps), nprocs=2)
    got, wants = torch.load(out, weights_only=False), steps(None)
    assert got.keys() == wants.keys()
    for name, want in wants.items():
        g = got[name]
        assert torch.allclose(g["out"], want["out"], rtol=1e-5, atol=1e-6), name
        assert g["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-8), name
        assert g["grads"].keys() == want["grads"].keys()
        for k, v in want["grads"].items():
            assert torch.allclose(g["grads"][k], v, rtol=1e-4, atol=1e-7), (name, k)
        moved = [k for k, v in want["grads"].items() if v.abs().sum() > 0]
        assert len(moved) > want["params"] // 2  # a real gradient, not zeros everywhere


# a Ray run whose 2 workers form one sequence-parallel group (FSDP2-sharded)
SP_RAY = {"run.name": "sp", "run.backend": "ray", "run.num_workers": 2, "diffusion.fsdp": True,
          "parallel.sequence_parallel": 2}  # fmt: skip


def check_ray_group_equals_one_worker(one_cfg, sp_cfg, *, atol: float, only: str = "") -> None:
    """Through the whole driver: ``sp_cfg`` (``one_cfg`` with :data:`SP_RAY`) trains like 1
    worker — the same rewards (so the same samples), grad norms and losses at every step after
    the first, a real gradient, and the same final weights (those whose names contain ``only``)."""
    from groupflow.run.tracking import read_metrics
    from tests.diffusion.test_fsdp import _fit

    one, s1 = _fit(one_cfg)
    two, s2 = _fit(sp_cfg)
    a, b = read_metrics(one.run_dir / "metrics.jsonl"), read_metrics(two.run_dir / "metrics.jsonl")
    assert len(a) == len(b) > 1
    for ra, rb in zip(a[1:], b[1:], strict=True):
        assert rb["reward/mean"] == pytest.approx(ra["reward/mean"], rel=1e-5)  # same samples
        for key in ("actor/grad_norm", "actor/pg_loss", "actor/kl_loss", "actor/loss"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-7), key
    assert b[-1]["actor/grad_norm"] > 0
    weights = [k for k in s1["model"] if only in k]
    assert weights
    for k in weights:
        assert torch.allclose(s1["model"][k], s2["model"][k], atol=atol), k
