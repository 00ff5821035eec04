"""Config rules of the parallel features: FSDP2 CPU offload for the LLM actor and Ulysses
sequence parallelism — each refused with an error naming its key where it cannot apply."""

from __future__ import annotations

from pathlib import Path

import pytest

from groupflow.config import ConfigError, config_from_dict, load_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _base(**over) -> dict:
    return {"model": {"tiny": {}}, "data": {"task": {"name": "reverse"}}, **over}


def _error(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, "test.yaml")
    return str(info.value)


def test_actor_cpu_offload_needs_fsdp_on_two_workers():
    msg = _error(_base(actor={"cpu_offload": True}))
    assert "actor.cpu_offload" in msg and "run.num_workers=1" in msg
    cfg = config_from_dict(
        _base(actor={"cpu_offload": True}, run={"backend": "ray", "num_workers": 2})
    )
    assert cfg.actor.cpu_offload


def test_actor_cpu_offload_is_for_llm_policies():
    over = ["actor.cpu_offload=true", "run.backend=ray", "run.num_workers=2"]
    with pytest.raises(ConfigError, match="actor.cpu_offload"):
        load_config(EXAMPLES / "diffusion_demo.yaml", over)


def test_actor_generation_weights_default_to_gather_and_name_the_key_when_bad():
    ray2 = {"backend": "ray", "num_workers": 2}
    assert config_from_dict(_base(run=ray2)).actor.generation_weights == "gather"
    cfg = config_from_dict(_base(run=ray2, actor={"generation_weights": "copy"}))
    assert cfg.actor.generation_weights == "copy"
    msg = _error(_base(run=ray2, actor={"generation_weights": "full"}))
    assert "actor.generation_weights" in msg and "gather" in msg


def test_sequence_parallel_defaults_off_and_needs_a_divisor_of_workers_and_heads():
    assert config_from_dict(_base()).parallel.sequence_parallel == 1
    ray4 = {"backend": "ray", "num_workers": 4}
    cfg = config_from_dict(_base(run=ray4, parallel={"sequence_parallel": 2}))
    assert cfg.parallel.sequence_parallel == 2
    msg = _error(_base(run=ray4, parallel={"sequence_parallel": 3}))
    assert "parallel.sequence_parallel=3 must divide run.num_workers=4" in msg
    msg = _error(
        _base(run=ray4, parallel={"sequence_parallel": 4}, model={"tiny": {"num_heads": 2}})
    )
    assert "must divide model.tiny.num_heads=2" in msg
    assert "parallel.sequence_parallel" in _error(_base(parallel={"sequence_parallel": 0}))


def test_sequence_parallel_is_for_llm_policies_and_wan_transformers():
    over = ["parallel.sequence_parallel=2", "run.backend=ray", "run.num_workers=2"]
    with pytest.raises(ConfigError, match="not diffusion.model.kind 'tiny'"):
        load_config(EXAMPLES / "diffusion_demo.yaml", over)
    cfg = load_config(EXAMPLES / "mmdancegrpo_wan.yaml", ["parallel.sequence_parallel=2"])
    assert cfg.parallel.sequence_parallel == 2


def test_sequence_parallel_refuses_a_vision_language_model():
    data = _base(
        run={"backend": "ray", "num_workers": 2},
        parallel={"sequence_parallel": 2},
        model={"tiny": {"vision": {"image_size": 32, "patch_size": 8}}},
    )
    assert "does not support vision-language models yet" in _error(data)


def test_packing_defaults_off_and_is_refused_by_name_where_it_cannot_apply():
    assert not config_from_dict(_base()).actor.packing
    gae = {"estimator": "gae"}
    cfg = config_from_dict(_base(actor={"packing": True}, critic={"packing": True}, algorithm=gae))
    assert cfg.actor.packing and cfg.critic.packing
    ray2 = {"backend": "ray", "num_workers": 2}
    msg = _error(_base(actor={"packing": True}, run=ray2, parallel={"sequence_parallel": 2}))
    assert "actor.packing" in msg and "parallel.sequence_parallel=2" in msg
    msg = _error(_base(model={"tiny": {"vision": {}}}, actor={"packing": True}))
    assert "actor.packing" in msg and "vision" in msg
    msg = _error(_base(critic={"packing": "sometimes"}, algorithm=gae))
    assert "critic.packing" in msg
    with pytest.raises(ConfigError, match="actor.packing"):
        load_config(EXAMPLES / "diffusion_demo.yaml", ["actor.packing=true"])
