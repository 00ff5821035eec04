"""Packed forwards equal padded ones: log-probs, entropy and values, and their gradients, on
rows of skewed lengths with a gap in a response, an empty response and tiny logit chunks; with
LoRA adapters; the packed row's layout by hand; a response without a prompt is refused."""

from __future__ import annotations

import pytest
import torch

from groupflow.config import LoraConfig
from groupflow.models.causal_lm import build_tiny_llama
from groupflow.models.logprobs import response_logprobs
from groupflow.models.packing import pack, packed_hidden, packed_logprobs, packed_values
from groupflow.models.value import response_values, value_model_from_config
from groupflow.workers.lora import apply_lora

VOCAB = 40
P_LEN, R_LEN = [6, 3, 1, 4, 2], [9, 2, 5, 0, 7]


def _model():
    return build_tiny_llama(VOCAB, hidden_size=32, num_layers=2, num_heads=4, max_positions=64)


def _rows():
    g = torch.Generator().manual_seed(0)
    b, p, t = len(P_LEN), max(P_LEN), max(R_LEN)
    prompt_ids = torch.zeros(b, p, dtype=torch.long)
    prompt_mask = torch.zeros(b, p, dtype=torch.long)
    responses = torch.zeros(b, t, dtype=torch.long)
    response_mask = torch.zeros(b, t, dtype=torch.long)
    for i, (pl, rl) in enumerate(zip(P_LEN, R_LEN)):
        prompt_ids[i, p - pl :] = torch.randint(2, VOCAB, (pl,), generator=g)
        prompt_mask[i, p - pl :] = 1
        responses[i, :rl] = torch.randint(2, VOCAB, (rl,), generator=g)
        response_mask[i, :rl] = 1
    response_mask[0, 3] = 0  # a gap (an observation token): attended, not an action
    return prompt_ids, prompt_mask, responses, response_mask


def _span(response_mask):
    span = torch.zeros_like(response_mask, dtype=torch.bool)
    for i, rl in enumerate(R_LEN):
        span[i, :rl] = True
    return span


def test_the_packed_row_by_hand():
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    responses = torch.tensor([[10, 11, 0], [12, 0, 0]])
    response_mask = torch.tensor([[1, 0, 0], [1, 0, 0]])  # 11 sits after the last action: dropped
    packed = pack(prompt_ids, prompt_mask, responses, response_mask)
    assert packed.input_ids.tolist() == [[5, 6, 10, 7, 8, 9, 12]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert packed.source.tolist() == [1, 5]  # the states of 6 and 9 predict 10 and 12
    assert packed.targets.tolist() == [10, 12]


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_logprobs_entropy_and_gradients_equal_the_padded_forward(entropy_grad):
    rows = _rows()
    span = _span(rows[3])
    weights = torch.randn(span.shape, generator=torch.Generator().manual_seed(1))
    out = {}
    for name in ("padded", "packed"):
        model = _model()
        kw = {
            "temperature": 0.7,
            "chunk_tokens": 5,
            "with_entropy": True,
            "entropy_grad": entropy_grad,
        }
        if name == "padded":
            lp, ent = response_logprobs(model, *rows, share_prompt=False, **kw)
        else:
            lp, ent = packed_logprobs(model, *rows, **kw)
        loss = (torch.where(span, lp, 0) * weights).sum()
        if entropy_grad:
            loss = loss + torch.where(span, ent, 0).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out[name] = (lp.detach()[span], ent.detach()[span], grads)
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = out["padded"], out["packed"]
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_b, ent_a, atol=1e-5, rtol=1e-5)
    for n in g_a:
        torch.testing.assert_close(g_b[n], g_a[n], atol=1e-5, rtol=1e-5, msg=n)
    assert (packed_logprobs(_model(), *rows)[0][~span] == 0).all()


def test_lora_adapters_packed_equal_padded_with_gradients():
    rows = _rows()
    span = _span(rows[3])
    grads = {}
    for name in ("padded", "packed"):
        model = apply_lora(_model(), LoraConfig(rank=4, alpha=8))
        for n, p in model.named_parameters():  # PEFT starts B at 0: make the adapters matter
            if "lora_B" in n:
                torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(len(n)))
        fn = (
            (lambda m, *r: response_logprobs(m, *r, share_prompt=False))
            if name == "padded"
            else packed_logprobs
        )
        lp, _ = fn(model, *rows)
        torch.where(span, lp, 0).sum().backward()
        grads[name] = (
            lp.detach()[span],
            {n: p.grad for n, p in model.named_parameters() if p.requires_grad},
        )
    torch.testing.assert_close(grads["packed"][0], grads["padded"][0], atol=1e-5, rtol=1e-5)
    assert grads["padded"][1] and all("lora" in n for n in grads["padded"][1])
    for n, g in grads["padded"][1].items():
        torch.testing.assert_close(grads["packed"][1][n], g, atol=1e-5, rtol=1e-5, msg=n)


def test_values_and_gradients_equal_the_padded_forward():
    rows = _rows()
    span = _span(rows[3])
    out = {}
    for name, fn in (("padded", response_values), ("packed", packed_values)):
        torch.manual_seed(3)
        critic = value_model_from_config(_model().config)
        v = fn(critic, *rows)
        torch.where(span, v, 0).pow(2).sum().backward()
        out[name] = (v.detach()[span], {n: p.grad.clone() for n, p in critic.named_parameters()})
    torch.testing.assert_close(out["packed"][0], out["padded"][0], atol=1e-5, rtol=1e-5)
    for n, g in out["padded"][1].items():
        torch.testing.assert_close(out["packed"][1][n], g, atol=1e-5, rtol=1e-5, msg=n)


def test_a_response_without_a_prompt_token_is_refused():
    rows = list(_rows())
    rows[1] = rows[1].clone()
    rows[1][2] = 0  # sample 2's prompt masked out, its response kept
    with pytest.raises(ValueError, match="sample 2 .* no prompt token"):
        packed_logprobs(_model(), *rows)


def test_segment_attention_equals_transformers_packed_sequence_masks():
    # what a flash/flex model gets: the packed position ids alone, transformers' own masks
    model, rows = _model(), _rows()
    packed = pack(*rows)
    # (transformers detects packed sequences only without a cache: use_cache=False, as training)
    native = model.get_decoder()(
        input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False
    )
    ours = packed_hidden(model, packed)
    torch.testing.assert_close(
        ours, native.last_hidden_state[0, packed.source], atol=1e-5, rtol=1e-5
    )
    assert model.config._attn_implementation == "sdpa"  # switched back after the call


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "flash_attention_2"])
def test_on_cuda_packed_equals_padded_with_the_varlen_path(attention):
    # flash-attention's varlen path (cu_seqlens from the restarting position ids) in bf16;
    # SDPA (through segment_attention) in fp32
    if attention == "flash_attention_2":
        pytest.importorskip("flash_attn")
    dtype = torch.bfloat16 if attention == "flash_attention_2" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    model = _model().to("cuda", dtype)
    model.config._attn_implementation = attention
    rows = [t.cuda() for t in _rows()]
    span = _span(rows[3].cpu()).cuda()
    padded, _ = response_logprobs(model, *rows, share_prompt=False)
    packed, _ = packed_logprobs(model, *rows)
    torch.testing.assert_close(packed[span], padded[span], atol=tol, rtol=tol)
