import math
import pickle
from pathlib import Path

import pytest
import torch

from groupflow.distributed.parallel import load_sharded_state, save_sharded_state
from groupflow.utils.safe_state import (
    UnsafeStateError,
    check_dcp_metadata,
    decode_tree,
    encode_tree,
    load_torch_weights_only,
    load_tree,
    save_tree,
)


class _Touch:
    """Unpickling this runs ``Path.touch`` on ``marker`` (a stand-in for ``os.system``)."""

    def __init__(self, marker):
        self.marker = Path(marker)

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_tree_round_trip_keeps_types_and_values(tmp_path):
    value = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.arange(4.0)}},
        "param_groups": [{"betas": (0.9, 0.99), "params": [0], "fused": None, "lr": 1e-3}],
        "python": (3, (1, 2, 3), None),
        "odd": {"__tensor__": "not a tag"},  # a user dict shaped like a tag
        "floats": [math.inf, -math.inf, 1.5, 2],
        "bytes": b"\xff",
        (1, 2): True,
    }
    save_tree(value, tmp_path / "x.safetensors")
    back = load_tree(tmp_path / "x.safetensors")
    assert back["param_groups"] == value["param_groups"]
    assert back["python"] == value["python"] and back["odd"] == value["odd"]
    assert back["floats"] == value["floats"] and isinstance(back["floats"][3], int)
    assert back["bytes"] == b"\xff" and back[(1, 2)] is True
    assert torch.equal(back["state"][0]["exp_avg"], torch.arange(4.0))
    assert back["state"][0]["step"].shape == ()


def test_tree_refuses_objects_and_names_the_path():
    with pytest.raises(TypeError, match=r"opt.state\[1\]\[0\]: a builtins.object cannot be"):
        encode_tree({"state": [None, [object()]]}, "opt")
    with pytest.raises(TypeError, match=r"opt.w: a Tensor \(torch.sparse_coo\)"):
        encode_tree({"w": torch.eye(2).to_sparse()}, "opt")


def test_malformed_skeletons_are_value_errors():
    with pytest.raises(ValueError, match="names tensor 't9'"):
        decode_tree({"__tensor__": "t9"}, {}, "f")
    with pytest.raises(ValueError, match="malformed state skeleton"):
        decode_tree({"__dict__": [[[1], 2]]}, {}, "f")


def test_a_plain_safetensors_file_is_not_a_tree(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(1)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(ValueError, match="not a groupflow state file"):
        load_tree(tmp_path / "w.safetensors")


def test_weights_only_loader_refuses_code_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"rng": _Touch(marker)}, tmp_path / "rng.pt")
    with pytest.raises(UnsafeStateError, match=r"rng.pt: refusing to load it"):
        load_torch_weights_only(tmp_path / "rng.pt")
    assert not marker.exists()
    torch.save({"t": torch.ones(2), "pair": (1, 2)}, tmp_path / "ok.pt")
    assert load_torch_weights_only(tmp_path / "ok.pt")["pair"] == (1, 2)


def _sharded_checkpoint(path: Path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with pytest.warns(UserWarning, match="single process"):
        save_sharded_state(model, opt, str(path))
    return model, opt


def test_dcp_index_is_checked_before_dcp_unpickles_it(tmp_path):
    model, opt = _sharded_checkpoint(tmp_path / "shards")
    check_dcp_metadata(tmp_path / "shards")  # DCP's own index passes
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="single process"):
        load_sharded_state(fresh, fresh_opt, str(tmp_path / "shards"))
    assert torch.equal(fresh.weight, model.weight)

    marker = tmp_path / "pwned"
    (tmp_path / "shards" / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    with pytest.raises(UnsafeStateError, match=r"\.metadata: refusing .* pathlib.Path.touch"):
        load_sharded_state(fresh, fresh_opt, str(tmp_path / "shards"))
    assert not marker.exists()
