import pytest
import torch

from groupflow.utils.optim import apply_configured_hyperparameters
from groupflow.workers.common import lr_lambda


def _make(lr: float, betas=(0.9, 0.999), weight_decay=0.0):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=lr, betas=betas, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda("cosine", 2, 10, 0.1))
    return p, opt, sched


def _steps(p, opt, sched, n: int) -> None:
    for _ in range(n):
        p.grad = torch.ones_like(p)
        opt.step()
        sched.step()


def test_unchanged_config_keeps_the_loaded_values_exactly():
    p, opt, sched = _make(3e-4)
    _steps(p, opt, sched, 3)
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
    _, opt2, sched2 = _make(3e-4)
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved_sched)
    before = [dict(g) for g in opt2.param_groups]
    apply_configured_hyperparameters(opt2, sched2)
    for a, b in zip(before, opt2.param_groups):
        assert {k: v for k, v in a.items() if k != "params"} == {
            k: v for k, v in b.items() if k != "params"
        }
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_new_lr_betas_and_weight_decay_replace_the_checkpoints():
    p, opt, sched = _make(3e-4)
    _steps(p, opt, sched, 3)
    q, opt2, sched2 = _make(1e-3, betas=(0.8, 0.9), weight_decay=0.1)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == pytest.approx(3e-4 * lr_lambda("cosine", 2, 10, 0.1)(3))
    apply_configured_hyperparameters(opt2, sched2)
    group = opt2.param_groups[0]
    factor = lr_lambda("cosine", 2, 10, 0.1)
    assert group["lr"] == 1e-3 * factor(3)
    assert (group["betas"], group["weight_decay"]) == ((0.8, 0.9), 0.1)
    _steps(q, opt2, sched2, 1)  # the schedule goes on from the new base LR
    assert opt2.param_groups[0]["lr"] == 1e-3 * factor(4)
