"""ModelSpec carrying a run-trained tokenizer: a worker rebuilds it without the driver's run
directory (a worker on another node need not see it); the optimizer every training worker builds and
the guard that skips, counts and stops non-finite updates."""

import pickle
import shutil

from groupflow.config import ModelConfig
from groupflow.data.tokenizer import train_char_tokenizer
from groupflow.workers.common import ModelSpec


def test_a_carried_tokenizer_is_rebuilt_after_its_directory_is_gone(tmp_path):
    run_tok = tmp_path / "run" / "tokenizer"
    tok = train_char_tokenizer(["12+34=", "46"])
    tok.save_pretrained(run_tok)
    model = ModelConfig(tiny={"hidden_size": 16, "num_layers": 1, "num_heads": 2})
    spec = pickle.loads(pickle.dumps(ModelSpec.carrying(model, str(run_tok), 0)))
    shutil.rmtree(tmp_path / "run")  # what a worker on another node sees: no run directory
    _, rebuilt = spec.build()
    assert rebuilt.encode("12+34=") == tok.encode("12+34=")
    assert spec.tokenizer_path() != str(run_tok)
    # the written copy is this process's: pickling again does not carry the temp path
    assert pickle.loads(pickle.dumps(spec))._local is None
    # a model's own tokenizer is not carried: read where the model is
    assert ModelSpec(model, str(run_tok), 0).tokenizer_path() == str(run_tok)


def test_the_nonfinite_guard_skips_counts_and_stops_a_diverged_run():
    import math

    import pytest
    import torch

    from groupflow.workers.common import NonFiniteGuard, NonFiniteLossError, optimizer_and_schedule

    w = torch.nn.Linear(2, 1)
    before = w.weight.detach().clone()
    cfg = type("Section", (), {"lr": 0.1, "betas": (0.9, 0.999), "weight_decay": 0.0,
                               "lr_schedule": "constant", "min_lr_ratio": 0.0})()  # fmt: skip
    optimizer, scheduler = optimizer_and_schedule(w, cfg, total_steps=10, warmup_steps=2)
    assert scheduler.get_last_lr() == [0.05]  # warm-up step 1 of 2: half the LR
    guard = NonFiniteGuard(2, "updates", "lower the LR")
    w(torch.ones(1, 2)).sum().backward()
    assert guard.step(optimizer, math.nan, 1.0) == 1.0  # skipped: no step, gradients dropped
    assert torch.equal(w.weight, before) and w.weight.grad is None
    assert guard.state() == [1, 1]
    w(torch.ones(1, 2)).sum().backward()
    assert guard.step(optimizer, 0.5, 1.0) == 0.0 and not torch.equal(w.weight, before)
    assert guard.state() == [0, 1]  # a finite step resets the run of skips, not the total
    guard.load([1, 7])  # a resumed run counts on
    with pytest.raises(
        NonFiniteLossError, match="2 consecutive updates had a non-finite .*lower the LR"
    ):
        guard.step(optimizer, 1.0, math.inf)
    assert guard.total == 8
