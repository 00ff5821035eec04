"""Tests of validation metrics: pass@k / mean@k / accuracy per data source on hand-made outcomes.

A fake actor "generates" one token per sample from a fixed plan (token 1 = right answer, 2 = a
partially right one, 3 = wrong), a fake tokenizer decodes it to text, and the real reward runner
scores the text, so every metric below is computed by hand from the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from groupflow.batch import Batch
from groupflow.data import PromptRow
from groupflow.evaluation import evaluate, pass_at_k
from groupflow.rewards.base import RewardFunction, RewardRunner
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.workflows.single_turn import SingleTurnWorkflow

RIGHT, CLOSE, WRONG = 1, 2, 3
TEXT = {RIGHT: "right", CLOSE: "close", WRONG: "wrong"}
SCORE = {"right": 1.0, "close": 0.3, "wrong": 0.0}

# prompt index -> data source, greedy outcome, k=3 sampled outcomes
SOURCES = ["src/a", "src/a", "src/b", "src/b"]
GREEDY = [RIGHT, RIGHT, CLOSE, WRONG]
SAMPLED = [
    [RIGHT, WRONG, WRONG],  # pass, 1 of 3 right
    [WRONG, WRONG, CLOSE],  # no pass (0.3 is below the threshold)
    [RIGHT, RIGHT, RIGHT],  # pass, 3 of 3
    [WRONG, WRONG, WRONG],  # no pass
]


class FakeTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(TEXT[t] for t in seq) for seq in ids]


@dataclass
class FakeActor:
    greedy: list
    sampled: list
    calls: list = field(default_factory=list)

    def generate(self, prompts_in, params: SamplingParams, prompt_width: int = 0):
        seeds = [s for per_prompt in prompts_in["seeds"] for s in per_prompt]
        self.calls.append((params, list(seeds)))
        tokens = []
        for (p,) in prompts_in[
            "prompt_token_ids"
        ]:  # each prompt is the single token id = its index
            plan = [self.greedy[p]] if params.temperature == 0 else self.sampled[p]
            assert len(plan) == params.n
            tokens.extend(plan)
        b = len(tokens)
        return Batch(
            {
                "responses": torch.tensor(tokens).view(b, 1),
                "response_mask": torch.ones(b, 1, dtype=torch.long),
            },
            {"finish_reason": ["stop"] * b},
        )


@dataclass
class Encoded:
    rows: list
    texts: list
    ids: list


def _encoded() -> Encoded:
    rows = [
        PromptRow(prompt=f"q{i}", fields={"data_source": s}, source="<test>", index=i)
        for i, s in enumerate(SOURCES)
    ]
    return Encoded(rows, [f"q{i}" for i in range(len(rows))], [[i] for i in range(len(rows))])


def _score(completions):
    return [SCORE[c] for c in completions]


def _runner() -> RewardRunner:
    return RewardRunner([RewardFunction("score", _score)])


def _scorer(actor: FakeActor):
    """The single-turn workflow's own ``score`` over the fake actor, tokenizer and real runner."""
    workflow = SimpleNamespace(
        policy=SimpleNamespace(rollout=actor, tokenizer=FakeTokenizer()), reward_fn=_runner()
    )
    return partial(SingleTurnWorkflow.score, workflow)


def _evaluate(sampled=SAMPLED, **kwargs):
    actor = FakeActor(GREEDY, sampled)
    out = evaluate(
        _scorer(actor),
        _encoded(),
        base_params=SamplingParams(max_new_tokens=4, temperature=0.7),
        seed=5,
        **kwargs,
    )
    return out, actor.calls


# ----- pass_at_k -----------------------------------------------------------------------------------


def test_pass_at_k_counts_prompts_with_any_correct_sample():
    correct = torch.tensor([[True, False], [False, False], [True, True]])
    assert pass_at_k(correct) == pytest.approx(2 / 3)
    assert pass_at_k(torch.zeros(2, 4, dtype=torch.bool)) == 0.0
    assert pass_at_k(torch.ones(1, 1, dtype=torch.bool)) == 1.0


# ----- evaluate ------------------------------------------------------------------------------------


def test_greedy_and_sampled_metrics_by_hand():
    metrics, _ = _evaluate(samples=3, temperature=0.9, greedy=True)
    expected = {
        # greedy: right, right | close, wrong
        "val/greedy/acc": 2 / 4,
        "val/greedy/acc/src/a": 1.0,
        "val/greedy/acc/src/b": 0.0,
        "val/greedy/reward": (1 + 1 + 0.3 + 0) / 4,
        "val/greedy/reward/src/a": 1.0,
        "val/greedy/reward/src/b": 0.15,
        # sampled, k = 3: 4 of 12 right; prompts 0 and 2 have a right sample
        "val/sampled/mean@3": 4 / 12,
        "val/sampled/pass@3": 2 / 4,
        "val/sampled/reward": (1 + 0.3 + 3) / 12,
        "val/sampled/mean@3/src/a": 1 / 6,
        "val/sampled/pass@3/src/a": 1 / 2,
        "val/sampled/reward/src/a": 1.3 / 6,
        "val/sampled/mean@3/src/b": 3 / 6,
        "val/sampled/pass@3/src/b": 1 / 2,
        "val/sampled/reward/src/b": 3 / 6,
    }
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key


def test_sampling_parameters_and_seeds():
    _, calls = _evaluate(samples=3, temperature=0.9, greedy=True)
    (greedy, greedy_seeds), (sampled, sampled_seeds) = calls
    assert greedy.temperature == 0.0 and greedy.n == 1
    assert sampled.temperature == 0.9 and sampled.n == 3
    assert sampled.max_new_tokens == greedy.max_new_tokens == 4  # the rest from base_params
    assert len(greedy_seeds) == 4 and len(sampled_seeds) == 12
    assert len(set(sampled_seeds)) == 12  # one distinct seed per sample


def test_threshold_decides_what_counts_as_correct():
    metrics, _ = _evaluate(samples=3, temperature=1.0, greedy=True, correct_threshold=0.3)
    assert metrics["val/greedy/acc"] == 3 / 4  # close counts now
    assert metrics["val/sampled/pass@3"] == 3 / 4
    assert metrics["val/sampled/mean@3"] == pytest.approx(5 / 12)


def test_greedy_only_when_one_sample():
    metrics, calls = _evaluate(samples=1, greedy=True)
    assert len(calls) == 1
    assert not any(k.startswith("val/sampled") for k in metrics)


def test_sampled_only_reports_acc_for_k_1():
    # with greedy off and k = 1 the sampled run reports plain accuracy, not mean@1 / pass@1
    metrics, calls = _evaluate(
        sampled=[s[:1] for s in SAMPLED], samples=1, greedy=False, temperature=1.0
    )
    assert len(calls) == 1
    assert metrics["val/sampled/acc"] == 2 / 4  # right, wrong, right, wrong
    assert not any("@" in k for k in metrics)


def test_records_are_returned_prompt_major():
    (metrics, records), _ = _evaluate(samples=3, greedy=True, return_records=True)
    assert set(records) == {"greedy", "sampled"}
    sampled = records["sampled"]
    assert [r["prompt_index"] for r in sampled] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [r["completion"] for r in sampled[:3]] == ["right", "wrong", "wrong"]
    assert [r["data_source"] for r in records["greedy"]] == SOURCES
    assert [r["reward"] for r in records["greedy"]] == pytest.approx([1.0, 1.0, 0.3, 0.0])


def test_rows_without_data_source_are_reported_as_default():
    encoded = _encoded()
    encoded.rows = [
        PromptRow(prompt=r.prompt, fields={}, source=r.source, index=r.index) for r in encoded.rows
    ]
    metrics = evaluate(
        _scorer(FakeActor(GREEDY, SAMPLED)),
        encoded,
        base_params=SamplingParams(max_new_tokens=4),
        samples=1,
    )
    assert metrics["val/greedy/acc/default"] == metrics["val/greedy/acc"] == 2 / 4
