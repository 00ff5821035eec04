import math

import pytest
import torch

from groupflow.algorithms import compute_advantages
from groupflow.algorithms.registry import UnknownNameError
from groupflow.config import ActorConfig
from groupflow.diffusion.models import TinyFlowModel
from groupflow.diffusion.worker import DiffusionSettings, DiffusionWorker, prompt_rows, select_steps

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["conv1", "conv2"]}


def _worker(settings=None, **actor):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyFlowModel(["red", "blue"], image_size=8, width=8)
    settings = settings or DiffusionSettings(num_steps=3, timestep_fraction=1.0)
    cfg = ActorConfig(**{"lr": 1e-3, "clip_eps_low": 1e-4, **actor})
    return DiffusionWorker(model, settings, cfg, total_steps=10)


def _rollout(w, n=3, step=0):
    rows = prompt_rows(
        ["red", "blue"], [[step * 100 + i * n + j for j in range(n)] for i in range(2)], [0, 1]
    )
    b = w.generate(rows, n)
    rewards = b["images"].mean((1, 2, 3))
    b["advantages"] = compute_advantages(rewards, b["group_ids"], "grpo")
    return b


def _inputs(b):
    keys = [k for k in b.tensors if k not in ("images", "rollout_logprobs")]
    return b.select(*keys)


VARIANTS = [
    pytest.param({}, id="plain"),
    pytest.param({"cfg_scale": 3.0}, id="cfg"),
    pytest.param({"lora": LORA}, id="lora"),
    pytest.param({"sampler": "dance_sde"}, id="dance"),
]


@pytest.mark.parametrize("extra", VARIANTS)
def test_recomputed_step_logprob_is_identical(extra):
    w = _worker(DiffusionSettings(num_steps=3, timestep_fraction=1.0, **extra))
    b = _rollout(w)
    assert b["latents"].shape == (6, 3, 3, 8, 8) and b["images"].shape == (6, 3, 8, 8)
    again = w.compute_logprobs(_inputs(b))["logprobs"]
    assert torch.equal(again, b["rollout_logprobs"])


def test_recomputed_logprobs_of_a_random_subset_of_steps():
    w = _worker(DiffusionSettings(num_steps=4, timestep_fraction=0.5))
    b = _rollout(w)
    mask = b["response_mask"].bool()
    assert mask.sum(1).tolist() == [2] * 6  # 2 of 4 steps per sample
    again = w.compute_logprobs(_inputs(b))["logprobs"]
    assert torch.allclose(again[mask], b["rollout_logprobs"][mask], atol=1e-6, rtol=0)
    assert bool((again[~mask] == 0).all())


@pytest.mark.parametrize("extra", VARIANTS)
def test_first_on_policy_ratio_is_exactly_one_and_kl_is_zero(extra):
    w = _worker(DiffusionSettings(num_steps=3, timestep_fraction=1.0, **extra), kl_coef=0.1)
    b = _rollout(w)
    b["old_logprobs"] = b["rollout_logprobs"]
    m = w.update(_inputs(b))
    assert m["actor/ratio_min"] == 1.0 and m["actor/ratio_max"] == 1.0
    assert m["actor/kl_loss"] == 0.0
    assert all(math.isfinite(v) for v in m.values())
    assert m["actor/grad_norm"] > 0


def _grads_of_update(w, batch):
    seen = []
    w.optimizer.step = lambda *a, **k: seen.append([p.grad.clone() for p in w.flow.parameters()])
    w.update(batch)
    return seen[0]


def test_local_token_mean_is_the_mean_of_micro_batch_token_means():
    """TRL's bnpo: each micro-batch's token mean over the number of micro-batches (the sum made
    the gradient grow with their count)."""
    rollout = _rollout(_worker())
    b = _inputs(rollout)
    b["old_logprobs"] = rollout["rollout_logprobs"] - 0.01  # off-policy: ratios away from 1
    split = _grads_of_update(_worker(loss_agg="local_token_mean", micro_batch_samples=2), b)
    pieces = [
        _grads_of_update(_worker(loss_agg="local_token_mean"), b.index(list(range(i, i + 2))))
        for i in (0, 2, 4)
    ]
    for k, g in enumerate(split):
        expected = sum(piece[k] for piece in pieces) / 3
        torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-7)
    assert sum(float(g.abs().sum()) for g in split) > 0


def test_update_moves_the_policy_and_then_the_kl_is_positive():
    w = _worker(kl_coef=0.1, lr=1e-2)
    before = [p.detach().clone() for p in w.flow.parameters()]
    b = _rollout(w)
    w.update(_inputs(b))
    assert any(not torch.equal(p, q) for p, q in zip(w.flow.parameters(), before))
    m = w.update(_inputs(_rollout(w, step=1)))
    assert m["actor/kl_loss"] > 0


def test_lora_reference_is_the_base_model():
    base = _worker()
    w = _worker(DiffusionSettings(num_steps=3, timestep_fraction=1.0, lora=LORA), lr=5e-2)
    assert w.peft is not None and w.ref_model is None
    x, s = torch.randn(2, 3, 8, 8), torch.tensor([0.9, 0.4])
    cond = base.flow.encode(["red", "blue"])
    expect = base._velocity(x, s, cond)
    for step in range(2):
        w.update(_inputs(_rollout(w, step=step)))
    with torch.no_grad():
        ref, pol = w._velocity(x, s, cond, reference=True), w._velocity(x, s, cond)
    assert torch.allclose(ref, expect, atol=1e-6)
    assert not torch.allclose(pol, expect, atol=1e-4)
    trainable = {n for n, p in w.flow.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_same_initial_noise_per_group_option():
    same = _rollout(_worker())
    assert torch.equal(same["latents"][0, 0], same["latents"][2, 0])
    assert not torch.equal(same["latents"][0, 0], same["latents"][3, 0])
    assert not torch.equal(
        same["next_latents"][0, 0], same["next_latents"][1, 0]
    )  # SDE noise differs
    own = _rollout(_worker(DiffusionSettings(num_steps=3, same_noise_per_group=False)))
    assert not torch.equal(own["latents"][0, 0], own["latents"][1, 0])


def test_step_selection():
    g = torch.Generator().manual_seed(0)
    assert select_steps(
        6, DiffusionSettings(num_steps=6, timestep_selection="window", window=(2, 4)), g
    ).tolist() == [0, 0, 1, 1, 0, 0]
    assert (
        int(select_steps(6, DiffusionSettings(num_steps=6, timestep_fraction=0.34), g).sum()) == 2
    )


def test_bad_input_is_reported_clearly():
    with pytest.raises(
        UnknownNameError,
        match="unknown sampler 'euler'; valid names: cps, dance_sde, flow_sde, ode",
    ):
        DiffusionSettings(sampler="euler")
    with pytest.raises(ValueError, match="sampler 'ode' is deterministic"):
        DiffusionSettings(sampler="ode")
    with pytest.raises(ValueError, match="window"):
        DiffusionSettings(num_steps=3, timestep_selection="window", window=(2, 5))
    w = _worker()
    b = _inputs(_rollout(w))
    b["latents"] = torch.zeros(6, 3, 3, 16, 16)
    with pytest.raises(
        ValueError, match=r"latent shape mismatch: expected \[B, 3, 8, 8\], got \[6, 3, 16, 16\]"
    ):
        w.update(b)


def test_state_round_trip_restores_model_and_optimizer():
    w = _worker()
    w.update(_inputs(_rollout(w)))
    state = w.state_dict()
    other = _worker()
    other.load_state_dict(state)
    for p, q in zip(w.flow.parameters(), other.flow.parameters()):
        assert torch.equal(p, q)
    assert other.scheduler.state_dict() == w.scheduler.state_dict()


def test_training_steps_follow_the_window_the_fraction_and_the_trainable_steps():
    from groupflow.diffusion.settings import initial_noise, training_steps

    settings = DiffusionSettings(num_steps=4, timestep_fraction=0.5)
    every = torch.ones(4, dtype=torch.bool)
    drawn = training_steps(settings, [7, 8, 7], None, every)
    assert drawn.sum(1).tolist() == [2, 2, 2] and torch.equal(drawn[0], drawn[2])  # by seed
    window = torch.tensor([False, True, True, False])
    assert training_steps(settings, [7, 8], window, every).tolist() == [[0, 1, 1, 0]] * 2
    last_only = torch.tensor([False, False, False, True])
    with pytest.raises(ValueError, match="a sample has no trainable step"):
        training_steps(settings, [7], window, last_only)
    noise = initial_noise([3, 4, 3], (2, 2))
    assert noise.shape == (3, 2, 2) and torch.equal(noise[0], noise[2])
    assert not torch.equal(noise[0], noise[1])
