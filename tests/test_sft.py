"""The supervised warm start's loop (groupflow.sft.warm_start), with a recording learner and a
scripted probe: what each step trains, how many training prompts the probe scores, when it stops."""

import pytest

from groupflow.assembly.data import EncodedPrompts
from groupflow.config import SFTConfig
from groupflow.data import PromptRow
from groupflow.sft import warm_start


class _Learner:
    def __init__(self):
        self.batches = []

    def sft_step(self, batch, lr):
        self.batches.append((batch, lr))
        return 1.0 / len(self.batches)


def _train(n=300):
    rows = [PromptRow(f"p{i}", {"answer": str(i)}, "t", i) for i in range(n)]
    return EncodedPrompts(rows, [r.prompt for r in rows], [[i] for i in range(n)])


def _examples(encoded):
    # prompt ids, target ids, no mask (every target token trained)
    return [(ids, [7, ids[0]], None) for ids in encoded.ids]


def test_each_step_trains_batch_samples_demonstrations_at_the_warm_starts_lr():
    learner = _Learner()
    cfg = SFTConfig(steps=3, lr=0.5, batch_samples=5)
    out = warm_start(learner, _examples, lambda probe: pytest.fail("no probe"), _train(), cfg, 0)
    assert out == {"sft/steps": 3.0, "sft/loss": pytest.approx(1 / 3), "sft/probe_acc": 0.0}
    assert [lr for _, lr in learner.batches] == [0.5] * 3
    for batch, _ in learner.batches:
        nt = batch.non_tensors
        assert len(nt["prompt_token_ids"]) == 5 and "vision" not in nt
        # the target follows its own prompt; no mask means every target token is trained
        assert all(t == [7, p[0]] for p, t in zip(nt["prompt_token_ids"], nt["target_ids"]))
        assert [list(m) for m in nt["target_mask"]] == [[1, 1]] * 5


@pytest.mark.parametrize("probe_prompts, expect", [(128, 128), (16, 16), (1000, 300)])
def test_the_probe_scores_probe_prompts_training_prompts_and_stops_at_the_accuracy(
    probe_prompts, expect
):
    learner, probed, synced = _Learner(), [], []
    train = _train()

    def probe(encoded):
        probed.append(encoded)
        hits = len(probed)  # 1/4, 2/4, 3/4 of the probe right at checks 1, 2, 3
        return [{"reward": float(i < hits * len(encoded.rows) // 4)}
                for i in range(len(encoded.rows))]  # fmt: skip

    cfg = SFTConfig(steps=50, check_every=4, stop_at_accuracy=0.7, probe_prompts=probe_prompts)
    out = warm_start(learner, _examples, probe, train, cfg, 0, sync=lambda: synced.append(1))
    assert out["sft/steps"] == 12.0 and len(learner.batches) == 12  # checks at 4, 8, 12: 0.75
    assert out["sft/probe_acc"] >= 0.7 and len(synced) == 3
    # the same fixed slice of training prompts each time, with its texts and ids
    assert all(len(p.rows) == expect for p in probed)
    assert [r.index for r in probed[0].rows] == [r.index for r in probed[-1].rows]
    assert all(p.ids == [[r.index] for r in p.rows] for p in probed)


def test_demonstrations_outside_the_agent_workflow_is_refused_at_load(tiny_config_data):
    from groupflow.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="sft.demonstrations bounds .*rollout.workflow=.auto."):
        config_from_dict(tiny_config_data(sft__demonstrations=16), "<sft test>")


def test_the_probe_and_demonstration_counts_are_validated():
    with pytest.raises(ValueError, match="probe_prompts"):
        SFTConfig(probe_prompts=0)
    with pytest.raises(ValueError, match="demonstrations"):
        SFTConfig(demonstrations=0)
