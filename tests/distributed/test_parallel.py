"""The process-group backend: CPU scalars must be reducible on GPU workers too.

The trainer's collectives on Python numbers (loss denominators, metrics, the ranks' shared
decisions) reduce CPU tensors; an nccl-only group rejects those, so GPU workers get a mixed
group (gloo for CPU tensors, nccl for CUDA ones). The GPU half runs where CUDA and nccl exist.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from groupflow.distributed.parallel import process_group_backend


def test_backend_is_gloo_on_cpu_and_mixed_on_gpus():
    assert process_group_backend(False) == "gloo"
    assert process_group_backend(True) == "cpu:gloo,cuda:nccl"


def _reduce_in_group(backend: str, tmp_path, device: str) -> tuple[float, float]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        cpu = torch.tensor(2.5, dtype=torch.float64)
        dev = torch.tensor([1.5], device=device)
        dist.all_reduce(cpu)
        dist.all_reduce(dev)
        return float(cpu), float(dev.cpu())
    finally:
        dist.destroy_process_group()


def test_a_cpu_group_reduces_cpu_tensors(tmp_path):
    assert _reduce_in_group(process_group_backend(False), tmp_path, "cpu") == (2.5, 1.5)


@pytest.mark.gpu
@pytest.mark.skipif(not dist.is_nccl_available(), reason="needs nccl")
def test_a_gpu_group_reduces_cpu_and_cuda_tensors(tmp_path):
    torch.cuda.set_device(0)
    assert _reduce_in_group(process_group_backend(True), tmp_path, "cuda") == (2.5, 1.5)
