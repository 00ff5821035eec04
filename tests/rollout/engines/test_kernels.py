"""The decode's LM-head kernel: oneDNN where safe and equal to ``F.linear`` to float rounding,
the module itself everywhere else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from groupflow.rollout.engines import kernels
from groupflow.rollout.engines.kernels import head_kernel, onednn_linear_available

needs_onednn = pytest.mark.skipif(
    not onednn_linear_available(), reason="this PyTorch build has no oneDNN linear"
)


@pytest.fixture(autouse=True)
def _small_heads_qualify(monkeypatch):
    """The tests' heads are small; the size threshold has its own test."""
    monkeypatch.setattr(kernels, "MIN_HEAD_ELEMENTS", 0)


def _head(vocab=300, hidden=48, bias=False, dtype=torch.float32) -> nn.Linear:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Linear(hidden, vocab, bias=bias).to(dtype)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(16, 48), (3, 1, 48)])
def test_a_plain_cpu_fp32_head_gets_the_onednn_kernel_with_the_same_outputs(bias, shape):
    head = _head(bias=bias)
    kernel = head_kernel(head)
    assert kernel is not head
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(kernel(x), F.linear(x, head.weight, head.bias))


@needs_onednn
def test_the_kernel_sees_in_place_weight_updates():
    """An optimizer step changes the weight in place between calls: no stale packed copy."""
    head = _head()
    kernel = head_kernel(head)
    x = torch.randn(4, 48)
    kernel(x)
    with torch.no_grad():
        head.weight.mul_(-2.0).add_(0.5)
    torch.testing.assert_close(kernel(x), F.linear(x, head.weight))


class _Wrapped(nn.Linear):
    """A subclass standing for a LoRA or quantised wrapper whose forward differs."""

    def forward(self, x):
        return super().forward(x) + 1.0


def _hooked() -> nn.Linear:
    head = _head()
    head.register_forward_hook(lambda module, args, out: out * 2)
    return head


@pytest.mark.parametrize(
    "make",
    [
        _hooked,
        lambda: _Wrapped(48, 300),
        lambda: _head(dtype=torch.bfloat16),
        lambda: nn.Sequential(_head()),
    ],
    ids=["forward-hook", "subclass", "bf16", "not-a-linear"],
)
def test_anything_else_keeps_the_module(make):
    head = make()
    assert head_kernel(head) is head


def test_a_global_forward_hook_keeps_the_module():
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, out: out)
    try:
        head = _head()
        assert head_kernel(head) is head
    finally:
        handle.remove()


def test_a_head_below_the_size_threshold_keeps_the_module(monkeypatch):
    """oneDNN's per-call overhead loses on small heads (a demo model's few dozen tokens)."""
    monkeypatch.setattr(kernels, "MIN_HEAD_ELEMENTS", 300 * 48 + 1)
    head = _head()
    assert head_kernel(head) is head
    monkeypatch.setattr(kernels, "MIN_HEAD_ELEMENTS", 300 * 48)
    assert (head_kernel(head) is head) is not onednn_linear_available()


def test_without_the_op_the_module_is_used(monkeypatch):
    monkeypatch.setattr(kernels, "onednn_linear_available", lambda: False)
    head = _head()
    assert head_kernel(head) is head


@pytest.mark.parametrize(
    "bad_kernel",
    [
        lambda weight, bias: lambda x: F.linear(x, weight) + 1e-2,  # disagrees with F.linear
        lambda weight, bias: lambda x: (_ for _ in ()).throw(RuntimeError("no ISA")),
    ],
    ids=["disagrees", "raises"],
)
def test_a_kernel_that_fails_the_probe_is_not_used(monkeypatch, bad_kernel):
    monkeypatch.setattr(kernels, "onednn_linear_available", lambda: True)
    monkeypatch.setattr(kernels, "_onednn_linear", bad_kernel)
    head = _head()
    assert head_kernel(head) is head
