"""The worker with CPS sampling, MixGRPO's SDE window, GRPO-Guard and the DiffusionNFT objective."""

import math

import pytest
import torch

from groupflow.diffusion.settings import renoise_noise, seeded_generator
from groupflow.diffusion.worker import DiffusionSettings
from tests.diffusion.test_worker import _inputs, _rollout, _worker

WINDOW = {"size": 2, "shift_interval": 1, "stride": 1, "roll_back": False}


def test_cps_rollout_is_reproduced_and_never_trains_its_deterministic_last_step():
    w = _worker(DiffusionSettings(sampler="cps", num_steps=3, timestep_fraction=1.0))
    b = _rollout(w)
    assert b["response_mask"].tolist() == [[1, 1, 0]] * 6
    assert bool((b["rollout_logprobs"][:, 2] == 0).all())  # std 0: x' is the mean exactly
    assert bool((b["rollout_logprobs"][:, :2] < 0).all())
    again = w.compute_logprobs(_inputs(b))["logprobs"]
    assert torch.equal(again, b["rollout_logprobs"] * b["response_mask"])
    b["old_logprobs"] = b["rollout_logprobs"]
    m = w.update(_inputs(b))
    assert m["actor/ratio_min"] == 1.0 == m["actor/ratio_max"] and m["actor/grad_norm"] > 0


def test_cps_with_only_the_last_step_selected_is_refused():
    w = _worker(DiffusionSettings(sampler="cps", num_steps=3, timestep_selection="window",
                                  window=(2, 3)))  # fmt: skip
    with pytest.raises(ValueError, match="no trainable step"):
        _rollout(w)


def test_sde_window_slides_with_the_update_count_and_trains_only_its_steps():
    w = _worker(DiffusionSettings(num_steps=4, sde_window=WINDOW))
    b = _rollout(w)
    assert b["response_mask"].tolist() == [[1, 1, 0, 0]] * 6
    assert bool((b["rollout_logprobs"][:, 2:] == 0).all())
    assert bool((b["rollout_logprobs"][:, :2] != 0).all())
    b["old_logprobs"] = b["rollout_logprobs"]
    w.update(_inputs(b))
    assert _rollout(w, step=1)["response_mask"].tolist() == [[0, 1, 1, 0]] * 6
    w.update(_inputs(b))
    w.update(_inputs(b))
    assert _rollout(w, step=2)["response_mask"].tolist() == [[0, 0, 1, 1]] * 6  # stays


def test_ratio_norm_first_ratio_is_one_and_steps_are_weighted_by_one_over_dt():
    settings = DiffusionSettings(num_steps=3, timestep_fraction=1.0, ratio_norm=True)
    w = _worker(settings)
    b = _rollout(w)
    b["old_logprobs"] = b["rollout_logprobs"]
    seen = {}
    orig = w.terms.step_terms

    def spy(*a, **k):
        out = orig(*a, **k)
        seen["terms"] = out
        return out

    w.terms.step_terms = spy
    m = w.update(_inputs(b))
    assert m["actor/ratio_min"] == 1.0 == m["actor/ratio_max"]
    bias, stds = seen["terms"][2]
    assert bool((bias == 0).all())  # old means = this forward's on the first step
    # on-policy PPO loss with ratio 1 is −mean(A·w) over the trained steps, w = 1/|dt|
    dt = (b["sigmas"] - b["sigmas_next"]).abs()
    expected = -(b["advantages"][:, None] / dt).mean().item()
    assert m["actor/pg_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_ratio_norm_recompute_returns_the_old_step_means():
    w = _worker(DiffusionSettings(num_steps=3, timestep_fraction=1.0, ratio_norm=True))
    b = _rollout(w)
    out = w.compute_logprobs(_inputs(b))
    assert out["old_means"].shape == b["latents"].shape
    b["old_logprobs"], b["old_means"] = out["logprobs"], out["old_means"]
    m = w.update(_inputs(b))
    assert all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("sampler", ["ode", "flow_sde"])
def test_nft_trains_on_clean_latents_and_the_old_model_follows_by_ema(sampler):
    nft = {"beta": 1.0, "old_decay_rate": 0.25, "old_decay_max": 0.5}
    # a deterministic sampler needs distinct noise per sample, or a group's images are equal
    distinct = sampler == "ode"
    w = _worker(DiffusionSettings(sampler=sampler, num_steps=3, objective="nft", nft=nft,
                                  same_noise_per_group=not distinct), kl_coef=0.1)  # fmt: skip
    b = _rollout(w)
    assert b["clean_latents"].shape == (6, 3, 8, 8)
    old_before = [p.clone() for p in w.old_model.parameters()]
    m = w.update(_inputs(b), shuffle_seed=3)
    assert math.isfinite(m["actor/loss"]) and m["actor/grad_norm"] > 0
    assert m["actor/kl_loss"] == 0.0  # the policy equalled the reference before the step
    new = list(w.flow.parameters())
    for o, ob, p in zip(w.old_model.parameters(), old_before, new, strict=True):
        assert torch.allclose(o, 0.25 * ob + 0.75 * p.detach(), atol=1e-7)  # decay 0.25·1
    state = w.state_dict()
    w2 = _worker(DiffusionSettings(sampler=sampler, num_steps=3, objective="nft", nft=nft))
    w2.load_state_dict(state)
    for a, c in zip(w2.old_model.parameters(), w.old_model.parameters(), strict=True):
        assert torch.equal(a, c)


def test_nft_loss_is_deterministic_given_the_update_seed():
    def run():
        w = _worker(DiffusionSettings(sampler="ode", num_steps=3, objective="nft",
                                      same_noise_per_group=False))  # fmt: skip
        b = _rollout(w)
        return w.update(_inputs(b), shuffle_seed=5)["actor/loss"]

    assert run() == run()


@pytest.mark.parametrize("objective", ["nft", "awm"])
def test_the_training_noise_is_each_samples_own_whatever_the_split(objective):
    """DiffusionNFT / AWM re-noise each sample from its rollout seed: the update of the batch in
    one micro-batch equals that of the batch reversed in micro-batches of 2 (as 2 ranks or
    micro-batches would split it); before, one stream was drawn in order, row by row."""
    settings = DiffusionSettings(sampler="ode", num_steps=3, objective=objective,
                                 same_noise_per_group=False)  # fmt: skip
    b = _rollout(_worker(settings))
    assert b["sample_seeds"].tolist() == [0, 1, 2, 3, 4, 5]
    b["old_logprobs"] = b["rollout_logprobs"]
    whole = _worker(settings).update(_inputs(b), shuffle_seed=3)
    split = _worker(settings, micro_batch_samples=2).update(
        _inputs(b).index(torch.arange(5, -1, -1)), shuffle_seed=3
    )
    for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm"):
        assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-8), key
    del b["sample_seeds"]
    with pytest.raises(ValueError, match=f"objective={objective}: the batch has no 'sample_seeds'"):
        _worker(settings).update(_inputs(b))


def test_renoise_noise_is_per_sample_and_distinct_per_step_and_epoch():
    seeds = torch.tensor([7, 8, 9])
    noise = renoise_noise(seeds, (2, 3), epoch=0, step=1, num_steps=4)
    assert noise.shape == (3, 2, 3)
    # a sample's noise does not depend on its neighbours
    assert torch.equal(renoise_noise(seeds[1:], (2, 3), 0, 1, 4), noise[1:])
    expected = torch.randn((2, 3), generator=seeded_generator(8, 3 + 0 * 4 + 1))
    assert torch.equal(noise[1], expected)
    others = [renoise_noise(seeds, (2, 3), 0, 2, 4), renoise_noise(seeds, (2, 3), 1, 1, 4)]
    assert not any(torch.allclose(o, noise) for o in others)
    assert not torch.allclose(noise[0], noise[1])
    assert renoise_noise(seeds[:0], (2, 3), 0, 1, 4).shape == (0, 2, 3)


def test_bad_settings_are_refused():
    with pytest.raises(
        ValueError,
        match=r"objective must be one of \('grpo', 'nft', 'flow_dppo', 'awm'\), got 'dpo'",
    ):
        DiffusionSettings(objective="dpo")
    with pytest.raises(ValueError, match="deterministic"):
        DiffusionSettings(sampler="ode")
