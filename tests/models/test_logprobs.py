"""The shared-prompt training forward gives the single-pass log-probs, entropy and gradients.

Rows repeat left-padded prompts of different lengths in shuffled order (GRPO's G samples), plus a
prompt seen once; responses have different lengths (right padding) and one has a masked token in
the middle (a tool output). Counting decoder calls tells which path ran: two (prompts, then
responses) when shared, one when it falls back.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from groupflow.models.causal_lm import (
    _to_rows,
    _unique_prompts,
    build_tiny_llama,
    response_hidden_states,
)
from groupflow.models.logprobs import response_logprobs

VOCAB, PAD = 40, 0
P, T = 6, 5
PROMPT_LENS = [6, 3, 4, 2]  # the last prompt appears once
REPEATS = [3, 3, 3, 1]
RESPONSE_LENS = [5, 2, 4, 1, 5, 3, 5, 2, 4, 3]


def make_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.full((len(PROMPT_LENS), P), PAD)
    masks = torch.zeros(len(PROMPT_LENS), P, dtype=torch.long)
    for i, n in enumerate(PROMPT_LENS):
        prompts[i, P - n :] = torch.randint(1, VOCAB, (n,), generator=g)
        masks[i, P - n :] = 1
    rows = torch.repeat_interleave(torch.arange(len(PROMPT_LENS)), torch.tensor(REPEATS))
    rows = rows[torch.randperm(len(rows), generator=g)]  # groups are not contiguous
    b = len(rows)
    responses = torch.full((b, T), PAD)
    response_mask = torch.zeros(b, T, dtype=torch.long)
    for i, n in enumerate(RESPONSE_LENS):
        responses[i, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        response_mask[i, :n] = 1
    response_mask[0, 2] = 0  # a masked token inside a response
    return prompts[rows], masks[rows], responses, response_mask


def tiny_llama():
    return build_tiny_llama(VOCAB, hidden_size=32, num_layers=2, num_heads=4, seed=1)


def tiny_qwen(version: int):
    import transformers

    name = "Qwen3" if version == 3 else "Qwen2"
    config_cls = getattr(transformers, f"{name}Config")
    model_cls = getattr(transformers, f"{name}ForCausalLM")
    config = config_cls(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(2)
    model = model_cls(config)
    with torch.no_grad():  # HF zero-initialises biases and norms; make them matter
        for name_, p in model.named_parameters():
            if name_.endswith("bias") or "norm" in name_:
                p.add_(0.3 * torch.randn_like(p))
    return model


class DecoderCalls:
    """Counts forward calls of the model's decoder stack."""

    def __init__(self, model):
        self.n = 0
        model.get_decoder().register_forward_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


def both_paths(model, batch, **kw):
    shared, _ = response_logprobs(model, *batch, share_prompt=True, **kw)
    single, _ = response_logprobs(model, *batch, share_prompt=False, **kw)
    return shared, single


def assert_valid_close(a, b, mask, tol=1e-5):
    torch.testing.assert_close(a * mask, b * mask, atol=tol, rtol=tol)


# ----- dedupe --------------------------------------------------------------------------------


def test_unique_prompts_maps_every_row_to_its_prompt():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [0, 5, 6], [7, 8, 9]])
    mask = (ids != 0).long()
    u_ids, u_mask, inverse = _unique_prompts(ids, mask)
    assert u_ids.shape == (2, 3)
    torch.testing.assert_close(u_ids[inverse], ids)
    torch.testing.assert_close(u_mask[inverse], mask)
    assert inverse[0] == inverse[2] == inverse[3] != inverse[1] == inverse[4]


def test_to_rows_expands_runs_and_selects_otherwise():
    x = torch.arange(6.0).reshape(3, 2).requires_grad_()
    # runs of equal length in any prompt order (expanded); uneven or split runs (selected)
    for inverse in ([0, 0, 1, 1, 2, 2], [1, 1, 2, 2, 0, 0], [0, 0, 0, 1, 2, 2], [0, 1, 0, 1, 2, 2]):
        index = torch.tensor(inverse)
        out = _to_rows(x, index)
        torch.testing.assert_close(out, x.detach().index_select(0, index))
        (grad,) = torch.autograd.grad((out * torch.arange(12.0).reshape(6, 2)).sum(), x)
        want = torch.zeros(3, 2).index_add_(0, index, torch.arange(12.0).reshape(6, 2))
        torch.testing.assert_close(grad, want)


def test_unique_prompts_tells_equal_ids_with_different_masks_apart():
    ids = torch.tensor([[0, 5], [0, 5]])
    mask = torch.tensor([[0, 1], [1, 1]])
    u_ids, u_mask, inverse = _unique_prompts(ids, mask)
    assert u_ids.shape[0] == 2 and inverse[0] != inverse[1]
    assert u_mask.dtype == mask.dtype


# ----- equality with the single pass ---------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prompt_logprobs_and_entropy_match_single_pass(temperature):
    model, batch = tiny_llama().eval(), make_batch()
    calls = DecoderCalls(model)
    with torch.no_grad():
        shared, ent_s = response_logprobs(
            model, *batch, temperature=temperature, with_entropy=True, share_prompt=True
        )
        assert calls.n == 2  # prompts once, then responses: the shared path ran
        single, ent_1 = response_logprobs(
            model, *batch, temperature=temperature, with_entropy=True, share_prompt=False
        )
    mask = batch[3]
    assert shared.shape == single.shape == (len(RESPONSE_LENS), T)
    assert_valid_close(shared, single, mask)
    assert_valid_close(ent_s, ent_1, mask)
    assert (single * mask).abs().sum() > 1.0  # real log-probs, not zeros on both sides


def test_shared_prompt_gradients_match_single_pass():
    model, batch = tiny_llama().train(), make_batch()
    mask = batch[3]
    grads = []
    for share in (True, False):
        model.zero_grad(set_to_none=True)
        lp, ent = response_logprobs(
            model, *batch, temperature=0.7, with_entropy=True, share_prompt=share, chunk_tokens=8
        )
        ((lp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    shared, single = grads
    assert shared.keys() == single.keys()
    for name in single:
        torch.testing.assert_close(shared[name], single[name], atol=1e-5, rtol=1e-5, msg=name)
    # A token seen only in prompts gets its embedding gradient only through the shared K/V.
    prompt_only = set(batch[0][batch[1].bool()].tolist()) - set(batch[2].flatten().tolist())
    assert prompt_only
    assert all(shared["model.embed_tokens.weight"][t].abs().sum() > 0 for t in prompt_only)


def test_shared_prompt_gradients_match_single_pass_with_contiguous_equal_groups():
    """GRPO's layout as the update orders it (each prompt's G rows consecutive): the K/V are
    expanded instead of index-selected; the gradients are still the single pass's."""
    model = tiny_llama().train()
    prompts, masks, responses, response_mask = make_batch()
    rows = torch.tensor([0, 0, 0, 4, 4, 4, 1, 1, 1])  # three prompts, G = 3
    batch = (prompts[rows], masks[rows], responses[:9], response_mask[:9])
    runs = _unique_prompts(batch[0], batch[1])[2].view(3, 3)
    assert (runs == runs[:, :1]).all() and len(set(runs[:, 0].tolist())) == 3  # the expand path
    grads = []
    for share in (True, False):
        model.zero_grad(set_to_none=True)
        lp, _ = response_logprobs(model, *batch, temperature=0.7, share_prompt=share)
        (lp * batch[3]).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("version", [2, 3])
def test_shared_prompt_matches_single_pass_on_qwen(version):
    model, batch = tiny_qwen(version).train(), make_batch(seed=5)
    mask = batch[3]
    calls = DecoderCalls(model)
    out = {}
    for share in (True, False):
        model.zero_grad(set_to_none=True)
        lp, _ = response_logprobs(model, *batch, share_prompt=share)
        (lp * mask).sum().backward()
        out[share] = (lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert calls.n == 3  # 2 shared + 1 single
    assert_valid_close(out[True][0], out[False][0], mask)
    for name, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], g, atol=1e-5, rtol=1e-5, msg=name)


def test_one_token_responses_need_only_the_prompt_pass():
    model = tiny_llama().eval()
    prompts, pmask, responses, rmask = make_batch()
    batch = (prompts, pmask, responses[:, :1], rmask[:, :1])
    calls = DecoderCalls(model)
    with torch.no_grad():
        shared, single = both_paths(model, batch)
    assert calls.n == 2  # one prompt pass (shared) + one single pass
    assert_valid_close(shared, single, batch[3])


# ----- fall-backs ----------------------------------------------------------------------------


def test_distinct_prompts_fall_back_to_one_pass():
    model = tiny_llama().eval()
    prompts, pmask, responses, rmask = make_batch()
    first = {}  # one row per distinct prompt
    for i, row in enumerate(prompts.tolist()):
        first.setdefault(tuple(row), i)
    rows = list(first.values())
    assert len(rows) == len(PROMPT_LENS)
    batch = (prompts[rows], pmask[rows], responses[rows], rmask[rows])
    calls = DecoderCalls(model)
    with torch.no_grad():
        shared, single = both_paths(model, batch)
    assert calls.n == 2  # one pass each
    torch.testing.assert_close(shared, single)


def test_gradient_checkpointing_in_training_falls_back_but_not_in_eval():
    model, batch = tiny_llama(), make_batch()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = DecoderCalls(model)
    model.train()
    lp, _ = response_logprobs(model, *batch, share_prompt=True)
    assert calls.n == 1  # HF would drop the cache: one pass
    (lp * batch[3]).sum().backward()
    model.eval()
    with torch.no_grad():
        shared, single = both_paths(model, batch)
    assert calls.n == 4  # eval without gradients: nothing is replayed, the prompt is shared
    assert_valid_close(shared, single, batch[3])
    assert_valid_close(lp.detach(), single, batch[3])


class _NoCacheDecoder(nn.Module):
    """A decoder whose forward takes no cache argument (as some custom-code models)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask, position_ids, use_cache=False):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=False)  # fmt: skip


class _NoCacheLM(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.decoder, self.head, self.config = (
            _NoCacheDecoder(lm.get_decoder()),
            lm.lm_head,
            lm.config,
        )

    def get_decoder(self):
        return self.decoder

    def get_output_embeddings(self):
        return self.head


def test_a_decoder_without_a_cache_argument_falls_back():
    lm = tiny_llama().eval()
    model, batch = _NoCacheLM(lm), make_batch()
    calls = DecoderCalls(model)
    with torch.no_grad():
        shared, _ = response_logprobs(model, *batch, share_prompt=True)
        reference, _ = response_logprobs(lm, *batch, share_prompt=False)
    assert calls.n == 1
    assert_valid_close(shared, reference, batch[3])


def test_sliding_window_attention_falls_back_when_the_window_can_bite():
    from transformers import MistralConfig, MistralForCausalLM

    def mistral(window):
        config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                               sliding_window=window)  # fmt: skip
        torch.manual_seed(0)
        return MistralForCausalLM(config).eval()

    batch = make_batch()
    for window, expected_calls in ((4, 2), (64, 3)):  # P + T = 11 tokens
        model = mistral(window)
        calls = DecoderCalls(model)
        with torch.no_grad():
            shared, single = both_paths(model, batch)
        assert calls.n == expected_calls, window
        assert_valid_close(shared, single, batch[3])


def test_share_prompt_false_runs_one_pass():
    model, batch = tiny_llama().eval(), make_batch()
    calls = DecoderCalls(model)
    with torch.no_grad():
        hidden = response_hidden_states(model, *batch, share_prompt=False)
    assert calls.n == 1 and hidden.shape == (len(RESPONSE_LENS), T, 32)


def test_an_unknown_share_prompt_value_is_refused():
    from groupflow.models.causal_lm import response_hidden_states

    model = build_tiny_llama(16, hidden_size=16, num_layers=1, num_heads=2, seed=0)
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="share_prompt must be True, False or 'always'"):
        response_hidden_states(model, ids, torch.ones_like(ids), ids, torch.ones_like(ids),
                               share_prompt="sometimes")  # fmt: skip


def test_a_model_without_an_lm_head_is_refused_naming_it():
    from groupflow.models.logprobs import hidden_logprobs

    class Headless(nn.Module):
        def get_output_embeddings(self):
            return None

    with pytest.raises(ValueError, match="Headless has no output embeddings"):
        hidden_logprobs(Headless(), torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long))
