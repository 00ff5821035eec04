"""The teacher role (on-policy distillation): the token-alignment check at load, the credit stage's
per-token advantages by hand, and a tiny run whose teacher is the student's own initial model
(reverse KL 0 at the first step) or another model (the advantages then carry the teacher's
signal)."""

from __future__ import annotations

import math

import pytest
import torch

from groupflow.assembly.models import build_model
from groupflow.assembly.tokenizers import check_teacher
from groupflow.batch import Batch
from groupflow.config import AlgorithmConfig, ModelConfig, TeacherConfig, TinyModelConfig
from groupflow.credit import CreditAssignment
from groupflow.data import train_char_tokenizer
from groupflow.models.causal_lm import ModelLoadError
from groupflow.run.tracking import read_metrics
from groupflow.trainer import Trainer

TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "max_positions": 32}


def save_teacher(path, alphabet=None, seed=0, tiny=TINY):
    """A tiny Llama (as model.tiny builds it with ``seed``) and its char tokenizer in ``path``."""
    tok = train_char_tokenizer([], **({} if alphabet is None else {"base_alphabet": alphabet}))
    model = build_model(ModelConfig(tiny=TinyModelConfig(**tiny)), tok, seed)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


# ----- token alignment at load ---------------------------------------------------------------


def test_a_teacher_with_the_students_tokenizer_passes(tmp_path):
    teacher = save_teacher(tmp_path / "t")
    check_teacher(str(teacher), train_char_tokenizer([]))


def test_a_teacher_with_other_token_ids_is_refused_naming_the_tokens(tmp_path):
    teacher = save_teacher(tmp_path / "t", alphabet="0123456789")
    student = train_char_tokenizer([], base_alphabet="0123456789ab")
    with pytest.raises(
        ModelLoadError, match=r"teacher.path: the teacher's tokenizer does not match"
    ):
        check_teacher(str(teacher), student)
    with pytest.raises(ModelLoadError, match=r"'a': student \d+, teacher None"):
        check_teacher(str(teacher), student)
    # one extra character that sorts first shifts every id: all 11 differ
    shifted = train_char_tokenizer([], base_alphabet="!0123456789")
    with pytest.raises(ModelLoadError, match="11 differ"):
        check_teacher(str(teacher), shifted)


def test_a_teacher_whose_output_layer_is_too_small_is_refused(tmp_path):
    teacher = save_teacher(tmp_path / "t")
    import json

    cfg_file = teacher / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["vocab_size"] = 5
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="vocab_size 5 is smaller"):
        check_teacher(str(teacher), train_char_tokenizer([]))


def test_a_missing_teacher_is_refused_at_start(tiny_config, tmp_path):
    cfg = tiny_config(teacher={"path": str(tmp_path / "nope")})
    with pytest.raises(ModelLoadError, match="teacher.path: .*nope.* does not exist"):
        Trainer(cfg)


# ----- the credit stage --------------------------------------------------------------------------


def test_credit_mixes_the_teacher_signal_into_per_token_advantages():
    batch = Batch(
        {
            "rewards": torch.tensor([1.0, 0.0, 1.0, 1.0]),
            "group_ids": torch.tensor([0, 0, 1, 1]),
            "response_mask": torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]]),
            "old_logprobs": torch.tensor([[-1.0, -1.0], [-2.0, 0.0], [-0.5, -0.5], [-1.0, -1.0]]),
            "teacher_logprobs": torch.tensor(
                [[-0.5, -2.0], [-1.0, 5.0], [-0.5, -1.5], [0.0, -1.0]]
            ),
        }
    )
    teacher = TeacherConfig(path="unused", coef=0.5, reward_weight=2.0)
    out, metrics = CreditAssignment(AlgorithmConfig(estimator="dr_grpo"), 0, teacher)(batch, step=0)
    # dr_grpo: group 0 -> [0.5, -0.5], group 1 -> [0, 0]; times 2, plus 0.5 * (teacher - student)
    expected = torch.tensor([[1.0 + 0.25, 1.0 - 0.5], [-1.0 + 0.5, 0.0], [0.0, -0.5], [0.5, 0.0]])
    torch.testing.assert_close(out["advantages"], expected)
    # mean k1 reverse KL over the 7 valid tokens: sum(student - teacher) / 7
    kl = (-0.5 + 1.0 - 1.0 + 0.0 + 1.0 - 1.0 + 0.0) / 7
    assert metrics["distill/reverse_kl"] == pytest.approx(kl)


# ----- a tiny run ----------------------------------------------------------------------------------


def _run(tiny_config, tmp_path, teacher_dir, name, **over):
    cfg = tiny_config(
        run__total_steps=2, run__name=name, model__tokenizer_path=str(teacher_dir),
        teacher={"path": str(teacher_dir), "reward_weight": 0.0}, **over,
    )  # fmt: skip
    trainer = Trainer(cfg)
    seen = []
    real = trainer.credit.distill
    trainer.credit.distill = lambda batch: seen.append(real(batch)) or seen[-1]  # (adv, metrics)
    trainer.fit()
    return seen, read_metrics(trainer.run_dir)


@pytest.mark.slow
def test_a_run_distils_from_the_teacher(tiny_config, tmp_path):
    # the teacher IS the student's initial model: no signal at the first step
    same = save_teacher(tmp_path / "same", seed=0)
    seen, metrics = _run(tiny_config, tmp_path, same, "same")
    advantages = seen[0][0]
    assert advantages.shape[0] == 16 and advantages.dim() == 2
    assert advantages.abs().max() < 1e-4
    first = next(m for m in metrics if m.get("step") == 1)
    assert abs(first["distill/reverse_kl"]) < 1e-5
    # another teacher: the advantages carry its per-token signal, and the student moves toward it
    other = save_teacher(tmp_path / "other", seed=7)
    seen, metrics = _run(tiny_config, tmp_path, other, "other", actor__lr=1e-2)
    assert seen[0][0].abs().max() > 0.1
    kls = [m["distill/reverse_kl"] for m in metrics if "distill/reverse_kl" in m]
    assert len(kls) == 2 and all(math.isfinite(k) for k in kls)
