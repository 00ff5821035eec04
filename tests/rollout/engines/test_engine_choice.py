"""Choosing the rollout engine: config keys, start-up errors, the old-log-prob rule (no vLLM needed)."""

import pytest

from groupflow.assembly.engines import build_rollout_engine
from groupflow.config import ActorConfig, ConfigError
from groupflow.policies.llm import old_logprobs_source, recompute_old_logprobs
from groupflow.rollout.engines import vllm_engine
from groupflow.rollout.engines.base import HFOptions
from groupflow.trainer import Trainer


def test_default_engine_is_hf_and_builds_no_vllm_options(tiny_config):
    cfg = tiny_config()
    assert cfg.rollout.engine == "hf"
    assert build_rollout_engine(cfg) == HFOptions()


def test_vllm_options_pass_through(tiny_config, monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: True)
    cfg = tiny_config(
        rollout__engine="vllm",
        model__tiny__hidden_size=128,
        rollout__vllm={"gpu_memory_utilization": 0.5, "sleep_mode": True, "cpu_kv_cache_gib": 2,
                       "max_model_len": 64, "dtype": "bfloat16"},
        run__seed=7,
    )  # fmt: skip
    opts = build_rollout_engine(cfg)
    assert opts == vllm_engine.VLLMOptions(
        gpu_memory_utilization=0.5, sleep_mode=True, cpu_kv_cache_gib=2, max_model_len=64,
        dtype="bfloat16", enforce_eager=True, enable_prefix_caching=True, seed=7,
    )  # fmt: skip
    assert not opts.in_flight
    # rollout.async_mode=in_flight: an engine whose weights may change between its steps
    cfg = tiny_config(rollout__engine="vllm", model__tiny__hidden_size=128,
                      rollout__max_staleness=1, rollout__async_mode="in_flight")  # fmt: skip
    assert build_rollout_engine(cfg).in_flight


def test_vllm_missing_fails_at_start_up_naming_the_install(tiny_config, monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    cfg = tiny_config(rollout__engine="vllm", model__tiny__hidden_size=128)
    with pytest.raises(vllm_engine.VLLMUnavailableError) as err:
        Trainer(cfg)
    msg = str(err.value)
    assert "scripts/setup_vllm.sh" in msg and "groupflow[vllm]" in msg
    assert "rollout.engine=hf" in msg


def test_unknown_engine_lists_the_valid_ones(tiny_config):
    with pytest.raises(ConfigError, match=r"rollout\.engine.*'hf' or 'vllm'"):
        tiny_config(rollout__engine="sglang")


def test_vllm_rejects_a_tiny_head_dim_it_cannot_run(tiny_config):
    # the base tiny model: hidden 32 / 2 heads = head dim 16
    with pytest.raises(
        ConfigError, match=r"head dim .*= 16\) is not one vLLM's attention supports"
    ):
        tiny_config(rollout__engine="vllm")
    tiny_config(rollout__engine="vllm", model__tiny__hidden_size=128)  # head dim 64: fine


@pytest.mark.parametrize(
    "key, value",
    [
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.5),
        ("cpu_kv_cache_gib", 0),
        ("dtype", "float64"),
        ("max_model_len", 4),
        ("sleep", True),
    ],
)
def test_bad_vllm_options_name_the_key(tiny_config, key, value):
    with pytest.raises(ConfigError, match=rf"rollout\.vllm\.{key}"):
        tiny_config(**{f"rollout__vllm__{key}": value})


def test_tis_cap_must_be_positive_and_needs_recomputed_old_logprobs(tiny_config):
    with pytest.raises(ConfigError, match=r"actor\.tis_cap"):
        tiny_config(actor__tis_cap=0)
    with pytest.raises(ConfigError, match="actor.recompute_old_logprobs=never"):
        tiny_config(actor__tis_cap=2.0, actor__recompute_old_logprobs="never")
    assert tiny_config(actor__tis_cap=2.0).actor.tis_cap == 2.0


@pytest.mark.parametrize(
    "mode, engine, epochs, mini, expected",
    [
        ("auto", "hf", 1, None, False),  # one optimizer step: the rollout's log-probs serve
        ("auto", "hf", 2, None, True),  # several epochs
        ("auto", "hf", 1, 8, True),  # several mini-batches
        ("auto", "vllm", 1, None, True),  # vLLM's numerics differ from the training forward
        ("never", "vllm", 1, None, False),
        ("always", "hf", 1, None, True),
    ],
)
def test_recompute_old_logprobs_rule(mode, engine, epochs, mini, expected):
    actor = ActorConfig(recompute_old_logprobs=mode, ppo_epochs=epochs, mini_batch_samples=mini)
    assert recompute_old_logprobs(actor, engine, num_samples=16) is expected


@pytest.mark.parametrize(
    "off_policy, engine, epochs, kl_in_reward, mode, expected",
    [
        # one optimizer step: the update's forward runs on the proximal weights, no extra pass
        ("decoupled", "hf", 1, False, "auto", "forward"),
        ("decoupled", "vllm", 1, False, "auto", "forward"),
        ("tis", "hf", 1, False, "auto", "forward"),
        ("decoupled", "hf", 2, False, "auto", "recompute"),  # the policy moves between steps
        ("decoupled", "hf", 1, True, "auto", "recompute"),  # the credit stage needs them first
        ("decoupled", "hf", 1, False, "always", "recompute"),
        ("none", "hf", 1, False, "auto", "rollout"),
        ("none", "vllm", 1, False, "auto", "recompute"),
    ],
)
def test_old_logprobs_source_rule(off_policy, engine, epochs, kl_in_reward, mode, expected):
    tis = {"tis_cap": 2.0} if off_policy == "tis" else {}
    actor = ActorConfig(off_policy=off_policy, ppo_epochs=epochs, recompute_old_logprobs=mode,
                        **tis)  # fmt: skip
    assert old_logprobs_source(actor, engine, 16, kl_in_reward=kl_in_reward) == expected


def test_sleep_mode_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: True)
    monkeypatch.setattr(vllm_engine.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"rollout\.vllm\.sleep_mode.*no GPU"):
        vllm_engine.VLLMEngine(
            None, None, vllm_engine.VLLMOptions(sleep_mode=True), eos_ids=[2], pad_id=0
        )
