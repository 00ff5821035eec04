"""``actor.packing`` / ``critic.packing`` through the workers: old-policy and reference
log-probs, the update (every ``loss_agg``, with KL and an entropy bonus, with LoRA, under a token
budget) and the critic's values and update equal the padded path's — metrics, log-probs and the
first step's gradients to 1e-5, and the weights after two updates of two epochs; a sample over the budget names its uid and the
key; FSDP2 on 2 gloo ranks, packed, equals the padded 2-rank run."""

from __future__ import annotations

import pytest
import torch

from groupflow.config import ActorConfig, CriticConfig, LoraConfig
from groupflow.models.value import value_model_from_config
from groupflow.workers.actor import ActorRolloutWorker
from groupflow.workers.critic import CriticWorker
from groupflow.workers.packing import OverBudgetError
from tests.workers.test_actor_parallel import EOS, PAD, _batch, _model, assert_same_run, spawn

KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/loss", "actor/approx_kl",
        "actor/ratio_max", "actor/kl_loss")  # fmt: skip


def _gapped_batch():
    batch = _batch()
    mask = batch["response_mask"].clone()
    mask[1, 1] = 0  # sample 1 (4 response tokens): a tool token between actions, no loss
    batch["response_mask"] = mask
    return batch


def _record_gradients(worker) -> list[dict]:
    """The gradients of every optimizer step the worker takes (filled in as it steps)."""
    step, grads = worker.optimizer.step, []

    def record():
        grads.append({n: p.grad.clone() for n, p in worker.model.named_parameters()
                      if p.grad is not None})  # fmt: skip
        step()

    worker.optimizer.step = record
    return grads


def _assert_gradients_and_weights(got: dict, want: dict) -> None:
    # the first step's gradient, before the weights part: the contract, to 1e-5
    assert got["grads"][0].keys() == want["grads"][0].keys()
    for k, v in want["grads"][0].items():
        torch.testing.assert_close(got["grads"][0][k], v, atol=1e-5, rtol=1e-5, msg=k)
    # after four AdamW steps at lr 1e-2: Adam divides a gradient entry by its own running scale,
    # so the last-bit differences of near-zero entries move a weight by up to ~3e-5 (a wrong
    # gradient moves it by ~lr)
    for k, v in want["weights"].items():
        torch.testing.assert_close(got["weights"][k], v, atol=1e-4, rtol=1e-4, msg=k)


def _actor_run(cfg: dict) -> dict:
    worker = ActorRolloutWorker(
        _model(), None, ActorConfig(**{"lr": 1e-2, "ppo_epochs": 2, **cfg}), total_steps=10,
        pad_id=PAD, eos_ids=[EOS],
    )  # fmt: skip
    batch = _gapped_batch()
    out = {"logprobs": worker.compute_logprobs(batch, temperature=0.9)["logprobs"]}
    if worker.has_reference:
        batch["ref_logprobs"] = worker.compute_logprobs(batch, temperature=0.9, reference=True)[
            "logprobs"
        ]
        out["ref"] = batch["ref_logprobs"]
    out["grads"] = _record_gradients(worker)
    out["metrics"] = [worker.update(batch, temperature=0.9, shuffle_seed=s) for s in (0, 1)]
    out["weights"] = {k: v.clone() for k, v in worker.model.state_dict().items()}
    return out


def _assert_same(got: dict, want: dict) -> None:
    for key in ("logprobs", "ref"):
        if key in want:
            torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5)
    for step, (g, w) in enumerate(zip(got["metrics"], want["metrics"])):
        for k in KEYS:
            if k in w:
                assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-6), (step, k)
    _assert_gradients_and_weights(got, want)


@pytest.mark.parametrize(
    "loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "local_token_mean"]
)
def test_every_loss_agg_packed_equals_padded(loss_agg):
    # micro-batches of 3 samples: the same cut both ways (local_token_mean depends on it)
    cfg = {"loss_agg": loss_agg, "micro_batch_samples": 3, "kl_coef": 0.1, "entropy_coef": 0.01}
    padded, packed = _actor_run(cfg), _actor_run({**cfg, "packing": True})
    _assert_same(packed, padded)
    assert packed["metrics"][0]["actor/kl_loss"] != 0  # the KL term was there to compare


def test_a_token_budget_and_lora_packed_equal_padded():
    # the budgets cut differently (real vs padded tokens): a global-denominator loss is the same
    cfg = {"micro_batch_tokens": 12, "lora": LoraConfig(rank=4, alpha=8), "kl_coef": 0.1,
           "lr": 5e-2}  # fmt: skip
    _assert_same(_actor_run({**cfg, "packing": True}), _actor_run(cfg))


def test_a_sample_over_the_token_budget_names_its_uid_and_the_key():
    worker = ActorRolloutWorker(
        _model(), None, ActorConfig(packing=True, micro_batch_tokens=6), total_steps=1,
        pad_id=PAD, eos_ids=[EOS],
    )  # fmt: skip
    batch = _batch()  # sample 2: 4 prompt + 2 response tokens fit; sample 1: 3 + 4 do not
    with pytest.raises(
        OverBudgetError, match=r"sample '1' has 7 tokens.*actor\.micro_batch_tokens=6"
    ):
        worker.update(batch, temperature=1.0)


def _critic_run(cfg: dict) -> dict:
    torch.manual_seed(1)
    worker = CriticWorker(
        value_model_from_config(_model().config),
        CriticConfig(**{"lr": 1e-2, "ppo_epochs": 2, **cfg}), total_steps=10,
    )  # fmt: skip
    batch = _gapped_batch()
    batch["returns"] = torch.randn(
        batch["response_mask"].shape, generator=torch.Generator().manual_seed(4)
    )
    values = worker.compute_values(batch)["values"]
    batch["values"] = values
    grads = _record_gradients(worker)
    metrics = [worker.update_critic(batch, shuffle_seed=s) for s in (0, 1)]
    return {"values": values, "metrics": metrics, "grads": grads,
            "weights": worker.model.state_dict()}  # fmt: skip


def test_critic_values_and_update_packed_equal_padded():
    cfg = {"micro_batch_tokens": 14, "loss_agg": "seq_mean_token_mean"}
    padded, packed = _critic_run(cfg), _critic_run({**cfg, "packing": True})
    torch.testing.assert_close(packed["values"], padded["values"], atol=1e-5, rtol=1e-5)
    for g, w in zip(packed["metrics"], padded["metrics"]):
        for k in ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean"):
            assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-6), k
    _assert_gradients_and_weights(packed, padded)


@pytest.mark.slow  # two processes importing torch and transformers
def test_fsdp2_on_two_ranks_packed_equals_padded(tmp_path):
    # a token budget (the ranks run different numbers of micro-batches: lockstep repeats), an
    # entropy bonus with gradient; the warm-start steps and the log-probs pack too
    cfg = {"micro_batch_tokens": 12, "entropy_coef": 0.01}
    two = spawn(tmp_path, 2, {
        "padded": ({}, cfg, {}),
        "packed": ({}, {**cfg, "packing": True}, {}),
    })  # fmt: skip
    assert_same_run(two["packed"], two["padded"])
