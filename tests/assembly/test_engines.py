"""The weight transport chosen from ``rollout.weight_transport`` and the backend
(``groupflow.assembly.engines``); the rollout engine's options are tested with the engines
(``tests/rollout/engines/test_engine_choice.py``)."""

from __future__ import annotations

import pytest

from groupflow.assembly.engines import build_weight_transport
from groupflow.config import ConfigError
from groupflow.distributed.transport import FileTransport


def test_transport_is_chosen_by_config_with_a_default_per_backend(tiny_config, tmp_path):
    assert build_weight_transport(tiny_config(), tmp_path).name == "driver"
    fs = build_weight_transport(
        tiny_config(rollout__weight_transport="filesystem", rollout__weight_bucket_mb=0.5),
        tmp_path,
    )
    assert isinstance(fs, FileTransport) and fs.root == str(tmp_path / "weights")
    assert fs.bucket_bytes == 1 << 19
    with pytest.raises(ConfigError, match=r"rollout.weight_transport=ray needs run.backend=ray"):
        tiny_config(rollout__weight_transport="ray")
    # on Ray: the collective transport where senders and receivers meet (a pool fed synchronously)
    pool = {"workers_per_node": 1}
    ray_pool = tiny_config(run__backend="ray", placement__rollout=pool)
    coll = build_weight_transport(ray_pool, tmp_path)
    assert coll.name == "collective" and coll.address is None  # the policy opens it
    assert build_weight_transport(ray_pool, tmp_path, kind="ray").name == "ray"
    k1 = tiny_config(run__backend="ray", placement__rollout=pool, rollout__max_staleness=1)
    assert build_weight_transport(k1, tmp_path).name == "ray"
    assert build_weight_transport(tiny_config(run__backend="ray"), tmp_path).name == "ray"
    for bad, why in (
        ({}, r"needs run.backend=ray \(got 'local'\)"),
        ({"run__backend": "ray"}, r"needs a rollout pool \(placement.rollout\)"),
        ({"run__backend": "ray", "placement__rollout": pool, "rollout__max_staleness": 1},
         r"needs rollout.max_staleness=0 \(got 1\)"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=r"rollout.weight_transport=collective " + why):
            tiny_config(rollout__weight_transport="collective", **bad)
