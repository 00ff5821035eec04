"""LoRA on the actor: only adapters train, the reference is the base model (adapters off, no second
copy), and merge-and-export gives a plain HF directory that reproduces the trained log-probs."""

from __future__ import annotations

import copy

import pytest
import torch

from groupflow.batch import Batch
from groupflow.config import ActorConfig, LoraConfig
from groupflow.data import train_char_tokenizer
from groupflow.models.causal_lm import build_tiny_llama
from groupflow.models.logprobs import response_logprobs
from groupflow.workers.actor import ActorRolloutWorker


@pytest.fixture(scope="module")
def tok():
    t = train_char_tokenizer(["0123456789 abc"])
    if t.pad_token_id is None:
        t.pad_token = t.eos_token
    return t


def _base(tok):
    return build_tiny_llama(
        len(tok), hidden_size=16, num_layers=2, num_heads=2, max_positions=16, seed=0
    )


def _worker(base, tok, **lora) -> ActorRolloutWorker:
    cfg = ActorConfig(lr=5e-2, kl_coef=0.0, lora=LoraConfig(rank=4, alpha=8, **lora))
    return ActorRolloutWorker(
        copy.deepcopy(base), tok, cfg, total_steps=10, pad_id=tok.pad_token_id,
        eos_ids=[tok.eos_token_id], reference=True,
    )  # fmt: skip


def _batch(tok, n: int = 6) -> Batch:
    g = torch.Generator().manual_seed(0)
    v = len(tok)
    prompt_ids = torch.randint(3, v, (n, 3), generator=g)
    responses = torch.randint(3, v, (n, 4), generator=g)
    response_mask = torch.ones(n, 4, dtype=torch.long)
    response_mask[0, 2:] = 0
    return Batch(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": torch.ones(n, 3, dtype=torch.long),
            "responses": responses,
            "response_mask": response_mask,
            "advantages": torch.randn(n, generator=g),
        }
    )


def _base_logprobs(model, batch):
    with torch.no_grad():
        lp, _ = response_logprobs(
            model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["responses"],
            batch["response_mask"],
        )
    return lp * batch["response_mask"]


def test_only_adapters_train_and_reference_is_the_base_model(tok):
    base, batch = _base(tok), _batch(tok)
    worker = _worker(base, tok)
    assert worker.reference is None  # no second model in memory
    trainable = [n for n, p in worker.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # B = 0 at init: the LoRA policy starts equal to the base
    torch.testing.assert_close(
        worker.compute_logprobs(batch, temperature=1.0)["logprobs"], _base_logprobs(base, batch)
    )
    frozen = {
        n: p.detach().clone() for n, p in worker.model.named_parameters() if not p.requires_grad
    }
    for _ in range(3):
        worker.update(batch, temperature=1.0)
    policy = worker.compute_logprobs(batch, temperature=1.0)["logprobs"]
    ref = worker.compute_logprobs(batch, temperature=1.0, reference=True)["logprobs"]
    torch.testing.assert_close(ref, _base_logprobs(base, batch))
    assert (policy - ref).abs().max() > 1e-3  # the adapters did change the policy
    for n, p in worker.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    # adapters are back on after the reference pass
    torch.testing.assert_close(worker.compute_logprobs(batch, temperature=1.0)["logprobs"], policy)


def test_merge_and_export_reproduces_the_trained_policy(tok, tmp_path):
    from transformers import AutoModelForCausalLM

    base, batch = _base(tok), _batch(tok)
    worker = _worker(base, tok, target_modules="all-linear")
    for _ in range(3):
        worker.update(batch, temperature=1.0)
    trained = worker.compute_logprobs(batch, temperature=1.0)["logprobs"]
    worker.save_pretrained(str(tmp_path / "export"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), local_files_only=True)
    assert not any("lora" in k for k in reloaded.state_dict())
    torch.testing.assert_close(
        _base_logprobs(reloaded.eval(), batch), trained, atol=1e-5, rtol=1e-5
    )
    # the worker itself keeps training with its adapters after an export
    assert any("lora_" in n for n, _ in worker.model.named_parameters())


def test_checkpoint_state_roundtrip(tok):
    base, batch = _base(tok), _batch(tok)
    worker = _worker(base, tok)
    worker.update(batch, temperature=1.0)
    other = _worker(base, tok)
    other.load_state_dict(copy.deepcopy(worker.state_dict()))
    torch.testing.assert_close(
        other.compute_logprobs(batch, temperature=1.0)["logprobs"],
        worker.compute_logprobs(batch, temperature=1.0)["logprobs"],
    )


def test_target_modules_that_match_nothing(tok):
    with pytest.raises(ValueError, match="q_proj"):
        _worker(_base(tok), tok, target_modules=["nonexistent_proj"])
