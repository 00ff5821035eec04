"""The LM head's GEMM in the decode step, on the faster of two CPU kernels.

Design decision: on CPU, PyTorch's ``F.linear`` runs fp32 GEMMs through MKL, whose kernel for a
few rows against a vocabulary-sized weight is slow on the CPUs we measured (AMD EPYC, AVX-512):
SmolLM2's head (49,152 × 576) takes 28 ms for 16 rows on one core where oneDNN — which PyTorch
ships as well, and which its own compiler uses for CPU linears — takes 19 ms; Qwen2.5's
(151,936 × 896) 135 ms against 83 ms; 1.3–1.8× for 1 to 128 rows (``benchmarks/decode_paths.py``).
The head is a fifth of a decode step's GEMM time for a 135M model, so the decode calls it through
``torch.ops.mkldnn._linear_pointwise`` where that is safe, and through the module otherwise.

"Safe" (and worth it: a head of at least ``MIN_HEAD_ELEMENTS`` weights, as vocabulary-sized heads
are) is decided per head, once per generation, by ``head_kernel``: a plain ``nn.Linear`` (not a
LoRA or quantised wrapper, no forward hooks that calling the module would run), fp32 on the CPU,
an ordinary tensor weight (not an FSDP ``DTensor`` shard), the op present in this PyTorch build,
and its output on a probe equal to ``F.linear``'s to float rounding. Anything else gets the module
itself, so this is a speed path and never a requirement. The two kernels sum in different
orders, so logits differ by float rounding (up to 5e-5 on SmolLM2's logits of magnitude ~20):
the tolerance at which the static-cache decode already differs from HF's forward. oneDNN reads
the weight as it is at every call (no cached packed copy), so the optimizer's in-place updates
are seen (tested).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["head_kernel", "onednn_linear_available"]

Kernel = Callable[[torch.Tensor], torch.Tensor]

_PROBE_ROWS = 3
_PROBE_RTOL = 1e-4
# Below this many weight entries oneDNN's per-call overhead (~10 µs) outweighs its speed: a 40 ×
# 64 head took 17.5 µs against MKL's 6.0, a 1000 × 256 one the same 186 µs, SmolLM2's 49,152 × 576
# half the time.
MIN_HEAD_ELEMENTS = 1 << 20


def onednn_linear_available() -> bool:
    """Whether this PyTorch build has oneDNN's linear op (CPU builds with MKL-DNN)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Kernel:
    op = torch.ops.mkldnn._linear_pointwise
    # attr "none": no fused activation; the scalars and algorithm arguments are then unused.
    return lambda x: op(x, weight, bias, "none", [], "")


def _hooked(module: nn.Module) -> bool:
    from torch.nn.modules import module as module_globals

    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module_globals._global_forward_hooks
        or module_globals._global_forward_pre_hooks
    )


def _plain_cpu_fp32_linear(head: nn.Module) -> TypeGuard[nn.Linear]:
    if type(head) is not nn.Linear or _hooked(head):
        return False
    tensors = [head.weight] + ([head.bias] if head.bias is not None else [])
    # A DTensor (FSDP shard) or other tensor subclass would need the module's own dispatch.
    return all(
        type(t) in (torch.Tensor, nn.Parameter)
        and t.device.type == "cpu"
        and t.dtype == torch.float32
        for t in tensors
    )


@torch.no_grad()
def _agrees(kernel: Kernel, head: nn.Linear) -> bool:
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(_PROBE_ROWS, head.in_features, generator=gen)
    try:
        ours = kernel(probe)
    except RuntimeError:  # an op the build lists but cannot run (e.g. no ISA support)
        return False
    expected = F.linear(probe, head.weight, head.bias)
    scale = float(expected.abs().max().clamp(min=1.0))
    return ours.shape == expected.shape and bool(
        (ours - expected).abs().max() <= _PROBE_RTOL * scale
    )


def head_kernel(head: nn.Module) -> Kernel:
    """``head``'s forward, through oneDNN where that is safe (see the module docstring), else the
    module itself. For generation only: the oneDNN op has no autograd formula."""
    if not (_plain_cpu_fp32_linear(head) and onednn_linear_available()):
        return head
    if head.weight.numel() < MIN_HEAD_ELEMENTS:
        return head
    kernel = _onednn_linear(head.weight, head.bias)
    return kernel if _agrees(kernel, head) else head
