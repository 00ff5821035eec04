"""The fused LM-head log-probs equal the autograd path's values, entropies and gradients.

The fused path (``models/head_logprob``) recomputes each chunk's logits in backward and writes
their gradient in place; the reference is the checkpointed autograd path (``fused=False``), and
for the bare function a plain ``log_softmax(head(h) / T).gather`` on the full logits. Chunks
smaller than the batch (7 positions) check the chunk boundaries; temperatures 1 (no division)
and 0.7; tied (the tiny Llama) and untied (Qwen2) heads; masked and padded positions.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from groupflow.models.head_logprob import fusable_head, fused_head_logprobs
from groupflow.models.logprobs import response_logprobs

_spec = importlib.util.spec_from_file_location(
    "logprob_cases", Path(__file__).with_name("test_logprobs.py")
)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model, batch, *, fused, temperature, chunk, entropy_grad=False):
    model.zero_grad(set_to_none=True)
    prompts, pmask, responses, rmask = batch
    logp, ent = response_logprobs(
        model, prompts, pmask, responses, rmask, temperature=temperature, chunk_tokens=chunk,
        with_entropy=True, fused=fused, entropy_grad=entropy_grad,
    )  # fmt: skip
    weights = torch.linspace(-1.0, 2.0, logp.numel()).view_as(logp)  # an uneven upstream grad
    (logp * weights * rmask).sum().backward()
    return logp.detach(), ent.detach(), _grads(model)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [7, 4096])
@pytest.mark.parametrize("arch", ["llama_tied", "qwen2_untied"])
def test_fused_values_entropy_and_gradients_equal_the_autograd_path(temperature, chunk, arch):
    model = cases.tiny_llama() if arch == "llama_tied" else cases.tiny_qwen(2)
    assert fusable_head(model.get_output_embeddings(), None)
    batch = cases.make_batch(3)
    mask = batch[3].bool()
    lp_f, ent_f, g_f = _run(model, batch, fused=True, temperature=temperature, chunk=chunk)
    lp_p, ent_p, g_p = _run(model, batch, fused=False, temperature=temperature, chunk=chunk)
    torch.testing.assert_close(lp_f[mask], lp_p[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_f[mask], ent_p[mask], atol=1e-5, rtol=1e-5)
    assert g_f.keys() == g_p.keys() and len(g_f) > 5
    for name in g_p:
        torch.testing.assert_close(g_f[name], g_p[name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_bare_function_matches_full_logits_in_float64():
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(8, 50, bias=False).double()
    hidden = torch.randn(3, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (3, 5), generator=g)
    up = torch.randn(3, 5, generator=g, dtype=torch.float64)

    logits = head(hidden) / 0.5
    ref = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    ref_ent = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    (ref * up).sum().backward()
    ref_gh, ref_gw = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = head.weight.grad = None

    # the function's logits are float32 (as the model path's ``.float()``): float32 tolerances
    lp, ent = fused_head_logprobs(
        hidden, head, targets, temperature=0.5, chunk=4, with_entropy=True
    )
    (lp * up).sum().backward()
    torch.testing.assert_close(lp.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.grad, ref_gh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.weight.grad, ref_gw, atol=1e-5, rtol=1e-5)
    assert not ent.requires_grad  # the entropy is a metric here


def test_entropy_with_gradient_takes_the_autograd_path():
    model = cases.tiny_llama()
    prompts, pmask, responses, rmask = cases.make_batch(1)
    _, ent = response_logprobs(
        model, prompts, pmask, responses, rmask, with_entropy=True, entropy_grad=True
    )
    assert ent.requires_grad
    _, ent = response_logprobs(
        model, prompts, pmask, responses, rmask, with_entropy=True, entropy_grad=False
    )
    assert not ent.requires_grad


def test_heads_the_fused_path_cannot_reproduce_are_not_fused():
    linear = nn.Linear(4, 9, bias=False)
    assert fusable_head(linear, None)
    assert not fusable_head(linear, lambda x: x)  # a final logit transform (soft-capping)
    assert not fusable_head(nn.Linear(4, 9), None)  # a bias

    class Wrapped(nn.Linear):  # e.g. a LoRA or quantised layer
        pass

    assert not fusable_head(Wrapped(4, 9, bias=False), None)
    assert not fusable_head(None, None)


def test_a_head_with_forward_hooks_is_not_fused():
    # the fused path calls F.linear on the weight, so a hook (a logit bias, an adapter) would be
    # skipped and the log-probs would no longer be the sampled distribution's
    for register in ("register_forward_hook", "register_forward_pre_hook"):
        linear = nn.Linear(4, 9, bias=False)
        hook = (lambda m, i, out: out + 1.0) if register == "register_forward_hook" else None
        handle = getattr(linear, register)(hook or (lambda m, i: None))
        assert not fusable_head(linear, None)
        handle.remove()
        assert fusable_head(linear, None)
