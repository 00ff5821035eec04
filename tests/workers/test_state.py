"""TrainedState and CheckpointMethods: what a trained worker's checkpoint holds, restored exactly;
FrozenReference: the actor's reference moves by parameter name and follows the policy on reset."""

import pytest
import torch
from torch import nn

from groupflow.config import ActorConfig
from groupflow.distributed.dispatch import dispatch_mode
from groupflow.workers.actor import ActorRolloutWorker
from groupflow.workers.common import NonFiniteGuard, optimizer_and_schedule
from groupflow.workers.critic import CriticWorker
from groupflow.workers.reference import FrozenReference
from groupflow.workers.state import CheckpointMethods, TrainedState


def _trained(seed: int, sharded: bool = False, steps: int = 0):
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    cfg = ActorConfig(lr=0.1, warmup_steps=2)
    opt, sched = optimizer_and_schedule(model, cfg, 10, cfg.warmup_steps)
    guard = NonFiniteGuard(3, "updates", "advice")
    for _ in range(steps):
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        sched.step()
    guard.passed(float("nan"))  # one skipped step: the guard's counts are part of the state
    return model, TrainedState(model, opt, sched, guard, sharded=sharded)


def test_a_local_state_round_trips_weights_optimizer_schedule_and_guard():
    model, state = _trained(0, steps=3)
    saved = state.local_state(model)
    assert set(saved) == {"model", "optimizer", "scheduler", "nonfinite"}
    assert saved["scheduler"]["last_epoch"] == 3 and saved["nonfinite"] == state.nonfinite.state()
    other_model, other = _trained(1)
    other.load_local_state(other_model, saved)
    for a, b in zip(model.parameters(), other_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert other.scheduler.last_epoch == 3 and other.nonfinite.state() == saved["nonfinite"]
    assert other.optimizer.param_groups[0]["lr"] == state.optimizer.param_groups[0]["lr"]
    # the saved weights are a copy: training on does not change the checkpoint
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(saved["model"]["weight"], model.weight)


def test_train_state_without_a_guard_and_older_states_without_its_counts():
    model, state = _trained(0, steps=1)
    bare = TrainedState(model, state.optimizer, state.scheduler)
    assert set(bare.train_state()) == {"scheduler"}
    _, fresh = _trained(2)
    fresh.load_train_state({"scheduler": state.scheduler.state_dict()})  # no "nonfinite" key
    assert fresh.nonfinite.state() == [0, 0] and fresh.scheduler.last_epoch == 1


def test_a_sharded_worker_is_told_to_save_shards_instead():
    model, state = _trained(0, sharded=True)
    with pytest.raises(RuntimeError, match="sharded workers use save_sharded"):
        state.local_state(model)


def test_sharded_checkpoints_round_trip_in_one_process(tmp_path):
    model, state = _trained(0, steps=2)
    state.save_sharded(str(tmp_path / "shards"))
    other_model, other = _trained(5)
    other.load_sharded(str(tmp_path / "shards"), state.train_state())
    for a, b in zip(model.parameters(), other_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert other.scheduler.last_epoch == 2


@pytest.mark.parametrize("worker", [ActorRolloutWorker, CriticWorker])
def test_every_trained_worker_dispatches_the_checkpoint_methods_alike(worker):
    assert issubclass(worker, CheckpointMethods)
    for name in ("state_dict", "load_state_dict", "train_state", "save_sharded", "load_sharded"):
        assert dispatch_mode(getattr(worker, name)) == "rank0", name


def test_the_reference_is_a_frozen_copy_that_moves_by_name_and_follows_a_reset():
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(2, 2))
    ref = FrozenReference(policy)
    assert ref.model is not policy and ref.root is None
    assert not any(p.requires_grad for p in ref.model.parameters())
    with torch.no_grad():
        policy[0].weight.add_(1.0)
    assert not torch.equal(ref.model[0].weight, policy[0].weight)  # a copy, not a view
    ref.reset_from(_Root(policy))  # the policy's FSDP root names its model "lm"
    assert torch.equal(ref.model[0].weight, policy[0].weight)
    weights = ref.weights()
    assert set(weights) == {"0.weight", "0.bias"} and weights["0.weight"].device.type == "cpu"
    zeros = {k: torch.zeros_like(v) for k, v in weights.items()}
    ref.load(zeros)
    assert float(ref.model[0].weight.abs().sum()) == 0.0


class _Root(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm
