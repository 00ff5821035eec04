"""The reward-model role: a tiny random sequence classifier saved to a directory, loaded, scoring a
batch (same scores batched or alone, own chat template), combined with rule rewards by weight;
a missing path is a start-up error naming the key."""

from __future__ import annotations

import pytest
import torch

from groupflow.batch import Batch
from groupflow.config import RewardModelConfig
from groupflow.data import train_char_tokenizer
from groupflow.models.causal_lm import ModelLoadError
from groupflow.rewards.base import RewardFunction, RewardResult, RewardRunner
from groupflow.workers.reward_model import (
    ModelRewardRunner,
    RewardModelWorker,
    check_reward_model_path,
    reward_texts,
)

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def save_tiny_reward_model(path, chat_template: str | None = None):
    """A randomly initialised 1-label Llama sequence classifier + char tokenizer in ``path``."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = train_char_tokenizer(["0123456789 abcdefghijklmnopqrstuvwxyz<>/"])
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if chat_template:
        tok.chat_template = chat_template
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, num_labels=1,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return save_tiny_reward_model(tmp_path_factory.mktemp("rm"), chat_template=TEMPLATE)


def _worker(rm_dir, **kw) -> RewardModelWorker:
    return RewardModelWorker.create(0, 1, cfg=RewardModelConfig(path=str(rm_dir), **kw))


def test_scores_a_batch_and_batching_changes_nothing(rm_dir):
    w = _worker(rm_dir, micro_batch_samples=3)
    prompts = ["12 ab", "3", "abc 99 x", "7"]
    completions = ["21", "3", "x 99 cba", ""]
    scores = w.score(Batch(non_tensors={"prompt": prompts, "completion": completions}))["scores"]
    assert scores.shape == (4,) and scores.dtype == torch.float32 and torch.isfinite(scores).all()
    assert len(set(scores.tolist())) == 4  # a random model still tells the samples apart
    for i in range(4):  # each sample alone: no padding at all
        alone = w.score(Batch(non_tensors={"prompt": [prompts[i]], "completion": [completions[i]]}))
        torch.testing.assert_close(alone["scores"][0], scores[i], atol=1e-5, rtol=1e-5)


def test_score_is_read_at_the_last_real_token_even_when_it_is_eos(rm_dir):
    w = _worker(rm_dir)
    eos = w.tokenizer.eos_token
    a = w.score(Batch(non_tensors={"prompt": ["12", "12"], "completion": ["21" + eos, "3"]}))[
        "scores"
    ]
    b = w.score(Batch(non_tensors={"prompt": ["12"], "completion": ["21"]}))["scores"]
    assert not torch.isclose(a[0], b[0])  # the EOS token (== pad here) is part of the input


def test_chat_prompts_use_the_reward_models_own_template(rm_dir):
    w = _worker(rm_dir)
    messages = [{"role": "user", "content": "12"}]
    assert reward_texts(w.tokenizer, [messages, "12"], ["21", "21"], None) == [
        "<user>12<assistant>21",
        "1221",
    ]
    assert reward_texts(w.tokenizer, ["12"], ["21"], True) == ["<user>12<assistant>21"]
    assert reward_texts(w.tokenizer, [messages], ["21"], False) == ["12\n21"]


def test_combined_with_rule_rewards_by_weight(rm_dir):
    w = _worker(rm_dir)

    class Rules:
        def __call__(self, prompts, completions, **fields):
            total = torch.tensor([1.0, 0.0])
            return RewardResult(total, {"exact": total}, {"reward/exact/mean": 0.5}, {"exact": 1.0})

        def check_fields(self, available):
            pass

        failure_value = 0.0

    runner = ModelRewardRunner(
        Rules(), w, weight=0.5, label="rm", raw_prompts={"P": [{"role": "user", "content": "12"}]}
    )
    res = runner(["P", "3"], ["21", "3"])
    rm = w.score(
        Batch(
            non_tensors={
                "prompt": [[{"role": "user", "content": "12"}], "3"],
                "completion": ["21", "3"],
            }
        )
    )["scores"]
    torch.testing.assert_close(res.total, torch.tensor([1.0, 0.0]) + 0.5 * rm)
    assert set(res.components) == {"exact", "rm"} and "reward/rm/mean" in res.metrics
    only = ModelRewardRunner(None, w, weight=2.0, label="rm", raw_prompts={})
    torch.testing.assert_close(only(["3"], ["3"]).total, 2.0 * rm[1:])


def test_missing_or_bad_paths_fail_with_the_key(tmp_path):
    with pytest.raises(ModelLoadError, match="reward_model.path: '.*nowhere' does not exist"):
        check_reward_model_path(RewardModelConfig(path=str(tmp_path / "nowhere")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="reward_model.path: .* has no config.json"):
        check_reward_model_path(RewardModelConfig(path=str(tmp_path / "empty")))


def test_a_model_with_two_labels_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=2)  # fmt: skip
    with pytest.raises(ModelLoadError, match="2 labels"):
        RewardModelWorker(LlamaForSequenceClassification(cfg), None, RewardModelConfig(path="x"))


def test_group_normalisation_covers_the_reward_model_too():
    """reward.normalize: group z-scores the model's scores inside each group like any rule."""

    class Scorer:  # a stand-in for the reward-model group: fixed scores
        def score(self, batch):
            return {"scores": torch.tensor([10.0, 30.0, 5.0, 5.0])}

    rules = RewardRunner(
        [RewardFunction("num", lambda completions: [float(c) for c in completions])]
    )
    runner = ModelRewardRunner(
        rules, Scorer(), weight=2.0, label="rm", raw_prompts={}, normalize="group",
        normalize_eps=0.0,
    )  # fmt: skip
    res = runner(["p"] * 4, ["0", "1", "1", "3"], group_ids=[0, 0, 1, 1])
    r = 1 / 2**0.5  # each non-constant pair's z-scores are -1/sqrt2, 1/sqrt2
    # num: [-r, r, -r, r]; rm: [-r, r, 0, 0] (group 1 constant) times 2
    torch.testing.assert_close(res.total, torch.tensor([-3 * r, 3 * r, -r, r]))
    assert res.metrics["reward/rm/share"] == pytest.approx(0.5)  # |2z| mean r vs num's r
    assert res.weights == {"num": 1.0, "rm": 2.0}
    plain = ModelRewardRunner(rules, Scorer(), weight=2.0, label="rm", raw_prompts={})
    torch.testing.assert_close(
        plain(["p"] * 4, ["0", "1", "1", "3"]).total, torch.tensor([20.0, 61.0, 11.0, 13.0])
    )
