"""Each role's pool from ``placement`` (``groupflow.assembly.groups``), and the CPUs a local Ray
instance declares for all of them."""

from __future__ import annotations

import pytest

from groupflow.assembly.groups import pool_spec, total_cpus
from groupflow.config import ConfigError, apply_overrides, config_from_dict


def _base() -> dict:
    return {"model": {"tiny": {}}, "data": {"task": {"name": "reverse"}}}


def test_placement_pools_per_role():
    data = apply_overrides(
        _base(),
        {
            "run.backend": "ray",
            "run.num_workers": 4,
            "actor.kl_coef": 0.05,
            "placement.actor": {"nodes": 2, "gpus_per_worker": 1},
            "placement.rollout": {"nodes": 1, "workers_per_node": 2, "gpus_per_worker": 1},
            "placement.reference": {"cpus_per_worker": 2},
        },
    )
    cfg = config_from_dict(data)
    actor = pool_spec(cfg, "actor")
    assert (actor.nodes, actor.workers_per_node, actor.gpus_per_worker) == (2, 2, 1)
    assert pool_spec(cfg, "rollout").world_size == 2
    assert pool_spec(cfg, "reference").bundle() == {"CPU": 2}
    assert total_cpus(cfg) == 4 * 1 + 2 * 1 + 1 * 2
    assert config_from_dict(_base()).placement.rollout == "colocated"


def test_a_pool_pinned_to_a_node_resource_and_bad_resources_named_by_key():
    pin = {"run.backend": "ray", "placement.rollout": {"resources": {"node_b": 1}}}
    cfg = config_from_dict(apply_overrides(_base(), pin))
    assert pool_spec(cfg, "rollout").bundle() == {"CPU": 1, "node_b": 1}
    assert pool_spec(cfg, "actor").bundle() == {"CPU": 1}
    for bad, why in (({"CPU": 2}, "'CPU' is one of Ray's own resources"),
                     ({"node_b": 0}, "resource 'node_b' needs a name and an amount > 0"),
                     ({"node_b": "one"}, "Input should be a valid number")):  # fmt: skip
        data = apply_overrides(_base(), {**pin, "placement.rollout": {"resources": bad}})
        with pytest.raises(
            ConfigError, match=rf"placement\.rollout\.(PoolConfig\.)?resources(\.node_b)?': {why}"
        ):
            config_from_dict(data)
