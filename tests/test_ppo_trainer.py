"""PPO through the one driver: critic and reward model as roles, KL in the reward, critic warm-up,
exact resume with the critic and the KL controller in the checkpoint, LoRA export through the CLI,
and start-up errors for missing model paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from groupflow.config import ConfigError, config_from_dict
from groupflow.models.causal_lm import ModelLoadError
from groupflow.trainer import Trainer

PPO = {
    "algorithm.estimator": "gae",
    "algorithm.lam": 0.95,
    "algorithm.kl_in_reward": {
        "coef": 0.05,
        "controller": "adaptive",
        "target_kl": 0.01,
        "horizon": 50,
    },
    "critic": {"lr": 1e-3},
}


def _ppo() -> dict:
    return {k.replace(".", "__"): v for k, v in PPO.items()}


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_ppo_steps_log_critic_and_kl_and_warmup_holds_the_actor(tiny_config):
    cfg = tiny_config(**{**_ppo(), "critic": {"lr": 1e-3, "warmup_steps": 2}})
    trainer = Trainer(cfg)
    trainer.fit()
    steps = [r for r in _rows(trainer.run_dir) if "critic/vf_loss" in r]
    assert len(steps) == 3
    assert ["actor/pg_loss" in r for r in steps] == [False, False, True]
    coefs = [r["kl_in_reward/coef"] for r in steps]
    # adaptive β: the logged value is the one used; it moves after each step by at most ×(1 ± 0.2·16/50)
    assert coefs[0] == pytest.approx(0.05)
    for a, b in zip(coefs, coefs[1:]):
        assert b != a and abs(b / a - 1) <= 0.2 * 16 / 50 + 1e-9


def test_ppo_resume_is_exact(tiny_config_data, tmp_path):
    data = tiny_config_data(**_ppo(), run__save_every=2, actor__lr=3e-3)
    full = Trainer(config_from_dict(data))
    full.fit()
    first = {**data, "run": {**data["run"], "name": "resumed", "total_steps": 2}}
    Trainer(config_from_dict(first)).fit()
    second = {**first, "run": {**first["run"], "total_steps": 3}}
    resumed = Trainer(config_from_dict(second))
    resumed.fit()
    a = [r for r in _rows(full.run_dir) if r.get("step") == 3 and "critic/vf_loss" in r][-1]
    b = [r for r in _rows(resumed.run_dir) if r.get("step") == 3 and "critic/vf_loss" in r][-1]
    for key in (
        "critic/vf_loss",
        "critic/grad_norm",
        "kl_in_reward/coef",
        "kl_in_reward/kl",
        "actor/pg_loss",
        "reward/mean",
    ):
        assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
    ckpt = resumed.run_dir / "checkpoints" / "step_2"
    assert (ckpt / "critic_model.safetensors").is_file() and (ckpt / "kl_controller.json").is_file()


def test_grpo_with_kl_in_reward_needs_no_critic(tiny_config):
    trainer = Trainer(
        tiny_config(algorithm__kl_in_reward={"coef": 0.1, "kind": "k3"}, run__total_steps=1)
    )
    last = trainer.fit()
    assert trainer.policy.critic is None and last["kl_in_reward/coef"] == 0.1
    assert last["kl_in_reward/kl"] == pytest.approx(
        0.0, abs=1e-6
    )  # first step: policy == reference


def test_lora_run_exports_a_plain_model_through_the_cli(tiny_config_data, tmp_path):
    from transformers import AutoModelForCausalLM

    from groupflow.cli.commands import main
    from groupflow.models.logprobs import response_logprobs

    data = tiny_config_data(
        actor__lora={"rank": 4, "alpha": 8, "target_modules": "all-linear"}, actor__lr=1e-2,
        algorithm__kl_in_reward={"coef": 0.01}, run__total_steps=2, run__save_every=2,
    )  # fmt: skip
    path = tmp_path / "lora.yaml"
    path.write_text(json.dumps(data))
    trainer = Trainer(config_from_dict(data))
    trainer.fit()
    assert trainer.policy.actor.reference is None
    out = tmp_path / "export"
    assert main(["export", str(path), "--checkpoint", str(trainer.run_dir), "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    assert not any("lora" in k for k in model.state_dict())
    batch, _ = trainer.workflow.collect(trainer.loader.take(2), step=9, round_=0, version=0)
    trained = trainer.policy.actor.compute_logprobs(
        batch.select("prompt_ids", "prompt_mask", "responses", "response_mask"), temperature=1.0
    )["logprobs"]
    with torch.no_grad():
        lp, _ = response_logprobs(
            model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["responses"],
            batch["response_mask"],
        )
    torch.testing.assert_close(lp * batch["response_mask"], trained, atol=1e-5, rtol=1e-5)


def test_reward_model_in_the_run(tiny_config, tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "rmt", Path(__file__).parent / "workers" / "test_reward_model.py"
    )
    rmt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rmt)
    rm_dir = rmt.save_tiny_reward_model(tmp_path / "rm")
    trainer = Trainer(
        tiny_config(reward_model={"path": str(rm_dir), "weight": 0.5}, run__total_steps=1)
    )
    last = trainer.fit()
    assert "reward/reward_model/mean" in last and "reward/total/mean" in last
    only = Trainer(
        tiny_config(
            reward_model={"path": str(rm_dir), "only": True}, run__total_steps=1, run__name="only"
        )
    )
    last = only.fit()
    assert last["reward/mean"] == pytest.approx(last["reward/reward_model/mean"], abs=1e-6)


def test_missing_model_paths_fail_at_start_up(tiny_config, tmp_path, monkeypatch):
    import groupflow.workflows.build as workflows

    def too_late(*a, **k):
        raise AssertionError("data were loaded before the path check")

    monkeypatch.setattr(workflows, "build_data", too_late)  # where build_run calls it
    with pytest.raises(ModelLoadError, match="reward_model.path: '.*no_rm' does not exist"):
        Trainer(tiny_config(reward_model={"path": str(tmp_path / "no_rm")}))
    with pytest.raises(ModelLoadError, match="critic.path: '.*no_critic'"):
        Trainer(
            tiny_config(algorithm__estimator="gae", critic={"path": str(tmp_path / "no_critic")})
        )


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"algorithm": {"estimator": "gae"}}, "'gae' needs a critic"),
        ({"critic": {}}, "only used by algorithm.estimator 'gae'"),
        (
            {
                "algorithm": {"estimator": "gae", "kl_in_reward": {"controller": "adaptive"}},
                "critic": {},
            },
            "needs target_kl and horizon",
        ),
        (
            {"algorithm": {"estimator": "gae"}, "critic": {"path": "a", "tiny": {}}},
            "at most one of critic.path",
        ),
        ({"actor": {"lora": {"rank": 0}}}, "actor.lora.rank"),
        ({"reward_model": {}}, "reward_model.path"),
    ],
)
def test_bad_ppo_configs(overrides, message):
    data = {"model": {"tiny": {}}, "data": {"task": {"name": "reverse"}}, **overrides}
    with pytest.raises(ConfigError, match=message):
        config_from_dict(data)
