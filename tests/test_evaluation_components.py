"""Tests of per-reward-component accuracy in validation (``val/<mode>/component/<name>/...``).

A fake actor emits fixed completions, the real reward runner scores them with the real GSM8K
reward in strict and flexible mode (the SmolLM2 example's setup), and every expected number is
counted by hand from the completions.
"""

from __future__ import annotations

import json
import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from groupflow.batch import Batch
from groupflow.data import PromptRow
from groupflow.evaluation import evaluate
from groupflow.rewards import build_reward_runner
from groupflow.rewards.base import RewardFunction, RewardRunner
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.workflows.single_turn import SingleTurnWorkflow

# prompt i has ground truth "7"; completions per prompt (greedy: the first; sampled: all three)
PLANS = [
    ["so #### 7", "it is 7", "#### 8"],  # strict ✓ flexible ✓ | sampled: strict 1/3, flex 2/3
    ["the answer is 7", "7 apples", "#### 7"],  # strict ✗ flexible ✓ | strict 1/3, flex 3/3
    ["#### 5", "no idea", "5"],  # strict ✗ flexible ✗ | strict 0/3, flex 0/3
]


class FakeTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def batch_decode(self, ids, skip_special_tokens=True):
        return [self.vocab[seq[0]] for seq in ids]


class FakeActor:
    """Token id = index into the flat list of completions."""

    def generate(self, prompts_in, params: SamplingParams, prompt_width: int = 0):
        tokens = []
        for (p,) in prompts_in["prompt_token_ids"]:
            plan = PLANS[p][:1] if params.temperature == 0 else PLANS[p][: params.n]
            tokens.extend(p * 3 + j for j in range(len(plan)))
        b = len(tokens)
        return Batch(
            {
                "responses": torch.tensor(tokens).view(b, 1),
                "response_mask": torch.ones(b, 1, dtype=torch.long),
            },
            {"finish_reason": ["stop"] * b},
        )


class Encoded:
    def __init__(self, sources):
        self.rows = [
            PromptRow(f"q{i}", {"data_source": s, "ground_truth": "7"}, "<test>", i)
            for i, s in enumerate(sources)
        ]
        self.texts = [f"q{i}" for i in range(len(sources))]
        self.ids = [[i] for i in range(len(sources))]


STRICT_AND_FLEXIBLE = [
    {"name": "gsm8k", "label": "strict", "kwargs": {"mode": "strict"}},
    {"name": "gsm8k", "label": "flexible", "weight": 0.0, "kwargs": {"mode": "flexible"}},
]


def _run(runner, sources=("openai/gsm8k",) * 3, **kwargs):
    vocab = [c for plan in PLANS for c in plan]
    # the single-turn workflow's own score, over the fake actor and tokenizer and the real runner
    workflow = SimpleNamespace(
        policy=SimpleNamespace(rollout=FakeActor(), tokenizer=FakeTokenizer(vocab)),
        reward_fn=runner,
    )
    return evaluate(
        partial(SingleTurnWorkflow.score, workflow),
        Encoded(list(sources)),
        base_params=SamplingParams(max_new_tokens=4),
        **kwargs,
    )


def test_greedy_strict_and_flexible_accuracy_by_hand():
    metrics = _run(build_reward_runner(STRICT_AND_FLEXIBLE), samples=1, greedy=True)
    assert metrics["val/greedy/component/strict/acc"] == pytest.approx(1 / 3)
    assert metrics["val/greedy/component/flexible/acc"] == pytest.approx(2 / 3)
    # the total is the strict score (flexible has weight 0), so acc is unchanged
    assert metrics["val/greedy/acc"] == pytest.approx(1 / 3)
    assert metrics["val/greedy/reward"] == pytest.approx(1 / 3)


def test_sampled_mean_and_pass_at_k_per_component():
    metrics = _run(build_reward_runner(STRICT_AND_FLEXIBLE), samples=3, greedy=False)
    assert metrics["val/sampled/component/strict/mean@3"] == pytest.approx(2 / 9)
    assert metrics["val/sampled/component/strict/pass@3"] == pytest.approx(2 / 3)
    assert metrics["val/sampled/component/flexible/mean@3"] == pytest.approx(5 / 9)
    assert metrics["val/sampled/component/flexible/pass@3"] == pytest.approx(2 / 3)
    assert metrics["val/sampled/mean@3"] == pytest.approx(2 / 9)


def test_single_component_adds_no_keys():
    runner = build_reward_runner(STRICT_AND_FLEXIBLE[:1])
    metrics = _run(runner, samples=1, greedy=True)
    assert not any("/component/" in k for k in metrics)
    assert metrics["val/greedy/acc"] == pytest.approx(1 / 3)


def test_component_counts_only_samples_it_scored():
    # data_source dispatch: each component scores only its own source's prompts.
    def other(completions):
        return [1.0 for _ in completions]

    def lookup(sources):
        table = {
            "openai/gsm8k": build_reward_runner(STRICT_AND_FLEXIBLE[:1]).specs[0],
            "other": RewardFunction("other", other),
        }
        return {s: table[s] for s in sources}

    runner = RewardRunner.by_data_source(lookup)
    metrics = _run(runner, sources=["openai/gsm8k", "other", "openai/gsm8k"], samples=1)
    assert metrics["val/greedy/component/strict/acc"] == pytest.approx(1 / 2)  # prompts 0, 2
    assert metrics["val/greedy/component/other/acc"] == 1.0  # prompt 1 only


def test_none_from_a_component_is_not_counted():
    def picky(completions):
        # no opinion on completions without "####"
        return [float("7" in c) if "####" in c else None for c in completions]

    def one(completions):
        return [1.0] * len(completions)

    runner = RewardRunner([RewardFunction("picky", picky), RewardFunction("one", one)])
    greedy = [plan[0] for plan in PLANS]  # "so #### 7", "the answer is 7", "#### 5"
    assert [("####" in c) for c in greedy] == [True, False, True]
    (metrics, records) = _run(runner, samples=1, return_records=True)
    assert metrics["val/greedy/component/picky/acc"] == pytest.approx(1 / 2)
    assert [r["components"]["picky"] for r in records["greedy"]] == [1.0, None, 0.0]
    json.dumps(records["greedy"], allow_nan=False)  # records stay valid JSON


def test_records_carry_unweighted_component_values():
    _, records = _run(
        build_reward_runner(STRICT_AND_FLEXIBLE), samples=1, greedy=True, return_records=True
    )
    got = [r["components"] for r in records["greedy"]]
    assert got == [
        {"strict": 1.0, "flexible": 1.0},
        {"strict": 0.0, "flexible": 1.0},
        {"strict": 0.0, "flexible": 0.0},
    ]
    assert not any(math.isnan(v) for c in got for v in c.values())
