"""The critic worker: values aligned with the policy's log-probs, the clipped value-loss update,
micro-batch invariance of its gradient, initialisation from the policy, and its state."""

from __future__ import annotations

import copy

import pytest
import torch

from groupflow.batch import Batch
from groupflow.config import CriticConfig, TinyModelConfig
from groupflow.models.causal_lm import build_tiny_llama
from groupflow.models.value import response_values, value_model_from_config, value_model_from_policy
from groupflow.workers.common import ModelSpec
from groupflow.workers.critic import CriticSpec, CriticWorker

VOCAB, PAD = 12, 0


def _policy():
    return build_tiny_llama(
        VOCAB, hidden_size=16, num_layers=1, num_heads=2, max_positions=16, seed=0
    )


def _critic(**cfg) -> CriticWorker:
    torch.manual_seed(1)
    model = value_model_from_config(_policy().config)
    return CriticWorker(model, CriticConfig(**{"lr": 1e-2, **cfg}), total_steps=10)


def _batch(n: int = 8, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.full((n, 3), PAD)
    prompt_mask = torch.zeros(n, 3, dtype=torch.long)
    responses = torch.full((n, 4), PAD)
    response_mask = torch.zeros(n, 4, dtype=torch.long)
    for i in range(n):
        p, r = 1 + i % 3, 1 + (3 * i) % 4
        prompt_ids[i, 3 - p :] = torch.randint(2, VOCAB, (p,), generator=g)
        prompt_mask[i, 3 - p :] = 1
        responses[i, :r] = torch.randint(2, VOCAB, (r,), generator=g)
        response_mask[i, :r] = 1
    return Batch(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "responses": responses,
            "response_mask": response_mask,
            "returns": torch.randn(n, 4, generator=g) * response_mask,
        }
    )


def test_values_are_masked_and_match_an_unbatched_forward():
    worker, batch = _critic(), _batch()
    values = worker.compute_values(batch)["values"]
    assert values.shape == (8, 4)
    assert (values[batch["response_mask"] == 0] == 0).all()
    # sample 1 alone, without padding: the same values (padding and batching change nothing)
    i = 1
    pm, rm = batch["prompt_mask"][i].bool(), batch["response_mask"][i].bool()
    alone = response_values(
        worker.model, batch["prompt_ids"][i][pm][None], torch.ones(1, int(pm.sum()), dtype=torch.long),
        batch["responses"][i][rm][None], torch.ones(1, int(rm.sum()), dtype=torch.long),
    )  # fmt: skip
    torch.testing.assert_close(values[i, : int(rm.sum())], alone[0], atol=1e-5, rtol=1e-5)


def test_update_fits_the_returns():
    worker, batch = _critic(lr=3e-2, value_clip=None), _batch()
    losses = []
    for _ in range(30):
        batch["values"] = worker.compute_values(batch)["values"]
        losses.append(worker.update_critic(batch)["critic/vf_loss"])
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0], losses


def _grads(worker: CriticWorker, batch: Batch) -> list[torch.Tensor]:
    seen = []
    worker.optimizer.step = lambda *a, **k: seen.append(
        [p.grad.clone() for p in worker.critic.parameters()]
    )
    worker.update_critic(batch)
    return seen[0]


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_gradient_does_not_depend_on_micro_batching(agg):
    batch = _batch()
    batch["values"] = _critic().compute_values(batch)["values"] + 0.3  # some tokens clip
    whole = _grads(_critic(loss_agg=agg, value_clip=0.2), batch)
    split = _grads(_critic(loss_agg=agg, value_clip=0.2, micro_batch_samples=3), batch)
    tokens = _grads(_critic(loss_agg=agg, value_clip=0.2, micro_batch_tokens=10), batch)
    for a, b, c in zip(whole, split, tokens):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-5)


def test_update_needs_values_and_returns():
    batch = _batch()
    with pytest.raises(KeyError, match="update_critic needs 'values'"):
        _critic().update_critic(batch)


def test_value_model_from_policy_copies_the_backbone():
    policy = _policy()
    critic = value_model_from_policy(policy, seed=3)
    for (k, a), b in zip(
        policy.get_decoder().state_dict().items(), critic.model.state_dict().values()
    ):
        assert torch.equal(a, b), k
    assert critic.score.weight.shape == (1, 16)


def test_critic_spec_sources(tmp_path):
    from groupflow.config import ModelConfig
    from groupflow.data import train_char_tokenizer

    tok = train_char_tokenizer(["0123456789"])
    tok.save_pretrained(str(tmp_path / "tok"))
    tiny = TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, max_positions=16)
    policy_spec = ModelSpec(ModelConfig(tiny=tiny), str(tmp_path / "tok"), seed=0)
    from_policy = CriticSpec(CriticConfig(), policy_spec, seed=0).build()
    policy, _ = policy_spec.build()
    assert torch.equal(
        from_policy.model.embed_tokens.weight, policy.get_decoder().embed_tokens.weight
    )
    own = CriticSpec(
        CriticConfig(tiny=tiny.model_copy(update={"hidden_size": 8})), policy_spec, 0
    ).build()
    assert own.config.hidden_size == 8 and own.config.num_labels == 1
    # a saved critic is a plain HF directory that loads back as critic.path
    worker = CriticWorker(own, CriticConfig(), total_steps=1)
    worker.save_pretrained(str(tmp_path / "critic"))
    loaded = CriticSpec(CriticConfig(path=str(tmp_path / "critic")), policy_spec, 0).build()
    assert torch.equal(loaded.score.weight, own.score.weight)
    with pytest.raises(ValueError, match="no config.json"):
        CriticSpec(CriticConfig(path=str(tmp_path / "nowhere")), policy_spec, 0).build()


def test_load_backbone_and_state_roundtrip():
    policy = _policy()
    worker = _critic()
    worker.load_backbone(policy.state_dict())
    assert torch.equal(worker.model.model.norm.weight, policy.model.norm.weight)
    batch = _batch()
    batch["values"] = worker.compute_values(batch)["values"]
    worker.update_critic(batch)
    state = copy.deepcopy(worker.state_dict())
    other = _critic()
    other.load_state_dict(state)
    torch.testing.assert_close(
        other.compute_values(batch)["values"], worker.compute_values(batch)["values"]
    )
    assert (
        other.optimizer.state_dict()["state"].keys()
        == worker.optimizer.state_dict()["state"].keys()
    )
