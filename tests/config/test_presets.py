"""``algorithm.preset``: each preset's resolved keys (written out here by hand from the papers,
not read from ``PRESETS``), precedence of explicit keys, errors, the dump and the run's log line."""

from __future__ import annotations

import logging

import pytest

from groupflow.config import ConfigError, config_from_dict, load_config
from groupflow.config.presets import PRESETS, preset_note, preset_report


def _base(**sections) -> dict:
    data = {"model": {"tiny": {}}, "data": {"task": {"name": "reverse"}}}
    data.update(sections)
    return data


def _resolved(cfg) -> dict:
    a, p = cfg.algorithm, cfg.actor
    return {
        "estimator": a.estimator,
        "dynamic_sampling": a.dynamic_sampling,
        "loss_fn": p.loss_fn,
        "ratio_level": p.ratio_level,
        "clip": (p.clip_eps_low, p.clip_eps_high),
        "loss_agg": p.loss_agg,
        "kl": (p.kl_coef, p.kl_kind),
        "loss_options": p.loss_options,
    }


DEFAULT_CLIP = (0.2, None)  # ActorConfig's own defaults, for presets that leave a key alone

EXPECTED = {
    "grpo": ("grpo", False, "ppo_clip", "token", (0.2, 0.2), "seq_mean_token_mean", (0.04, "k3"), {}),
    "dapo": ("grpo", True, "ppo_clip", "token", (0.2, 0.28), "token_mean", (0.0, "k3"), {}),
    "dr_grpo": ("dr_grpo", False, "ppo_clip", "token", (0.2, 0.2), "seq_mean_token_sum_norm", (0.0, "k3"), {}),
    "gspo": ("grpo", False, "ppo_clip", "sequence", (3e-4, 4e-4), "seq_mean_token_mean", (0.0, "k3"), {}),
    "bnpo": ("grpo", False, "ppo_clip", "token", (0.2, 0.2), "local_token_mean", (0.0, "k3"), {}),
    "cispo": ("grpo", False, "cispo", "token", DEFAULT_CLIP, "token_mean", (0.0, "k3"), {"clip_ratio_max": 5.0}),
    "rloo": ("rloo", False, "ppo_clip", "token", (0.2, 0.2), "token_mean", (0.0, "k3"), {}),
    "reinforce_pp": ("reinforce_pp_baseline", False, "ppo_clip", "token", (0.2, 0.2), "token_mean", (0.0, "k3"), {}),
}  # fmt: skip


def test_every_preset_is_tested():
    assert set(EXPECTED) | {"opd"} == set(PRESETS)


def test_opd_sets_the_teacher_signal_alone_and_needs_a_teacher_path():
    cfg = config_from_dict(_base(algorithm={"preset": "opd"}, teacher={"path": "/models/t"}))
    assert (cfg.teacher.coef, cfg.teacher.reward_weight) == (1.0, 0.0)
    assert (cfg.actor.loss_fn, cfg.actor.loss_agg, cfg.actor.kl_coef) == (
        "ppo_clip",
        "token_mean",
        0.0,
    )
    mixed = _base(algorithm={"preset": "opd"}, teacher={"path": "/t", "reward_weight": 0.5})
    assert config_from_dict(mixed).teacher.reward_weight == 0.5
    with pytest.raises(ConfigError, match="'teacher.path': Field required"):
        config_from_dict(_base(algorithm={"preset": "opd"}))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_preset_resolves_to_its_papers_keys(name):
    cfg = config_from_dict(_base(algorithm={"preset": name}))
    keys = ("estimator", "dynamic_sampling", "loss_fn", "ratio_level", "clip", "loss_agg", "kl",
            "loss_options")  # fmt: skip
    assert _resolved(cfg) == dict(zip(keys, EXPECTED[name]))
    assert cfg.algorithm.preset == name
    # the dump holds the resolved keys and validates again to the same config
    assert config_from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    assert all(line.endswith("(preset)") for line in preset_report(cfg))


def test_explicit_keys_override_the_preset_in_any_section():
    data = _base(
        algorithm={"preset": "dapo", "dynamic_sampling": False},
        actor={"clip_eps_high": 0.3, "lr": 1e-5},
    )
    cfg = config_from_dict(data)
    assert cfg.actor.clip_eps_high == 0.3 and not cfg.algorithm.dynamic_sampling
    assert (cfg.actor.clip_eps_low, cfg.actor.loss_agg) == (0.2, "token_mean")  # the rest stays
    report = preset_report(cfg)
    assert "actor.clip_eps_high=0.3 (overridden)" in report
    assert "algorithm.dynamic_sampling=False (overridden)" in report
    assert "actor.loss_agg='token_mean' (preset)" in report
    assert data["actor"] == {"clip_eps_high": 0.3, "lr": 1e-5}  # the caller's dict is not changed


def test_command_line_overrides_win_over_the_file_preset(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {tiny: {}}\ndata: {task: {name: reverse}}\nalgorithm: {preset: grpo}\n")
    cfg = load_config(path, ["actor.kl_coef=0.0", "actor.loss_agg=token_mean"])
    assert (cfg.actor.kl_coef, cfg.actor.loss_agg, cfg.actor.kl_kind) == (0.0, "token_mean", "k3")
    cfg = load_config(path, ["algorithm.preset=gspo"])  # the preset itself, from the command line
    assert cfg.actor.ratio_level == "sequence"


def test_loss_options_merge_key_by_key_and_user_keys_win():
    cfg = config_from_dict(_base(algorithm={"preset": "cispo"}, actor={"loss_options": {}}))
    assert cfg.actor.loss_options == {"clip_ratio_max": 5.0}
    cfg = config_from_dict(
        _base(algorithm={"preset": "cispo"}, actor={"loss_options": {"clip_ratio_max": 2.0}})
    )
    assert cfg.actor.loss_options == {"clip_ratio_max": 2.0}
    assert "actor.loss_options={'clip_ratio_max': 2.0} (overridden)" in preset_report(cfg)


def test_a_different_loss_keeps_the_rest_of_the_preset_but_not_its_clip_options():
    cfg = config_from_dict(_base(algorithm={"preset": "dapo"}, actor={"loss_fn": "vespo"}))
    assert (cfg.algorithm.dynamic_sampling, cfg.actor.loss_agg) == (True, "token_mean")
    assert cfg.actor.clip_eps_high is None  # not set: vespo has no clip range
    assert "actor.clip_eps_high (not an option of actor.loss_fn='vespo')" in preset_report(cfg)
    cfg = config_from_dict(_base(algorithm={"preset": "cispo"}, actor={"loss_fn": "sapo"}))
    assert cfg.actor.loss_options == {}  # clip_ratio_max is CISPO's


def test_unknown_preset_names_the_closest_valid():
    with pytest.raises(ConfigError) as info:
        config_from_dict(_base(algorithm={"preset": "dapoo"}))
    msg = str(info.value)
    assert "'algorithm.preset': unknown preset 'dapoo'" in msg
    assert "did you mean 'dapo'?" in msg and "reinforce_pp" in msg
    with pytest.raises(ConfigError, match="did you mean 'dr_grpo'"):
        config_from_dict(_base(algorithm={"preset": "drgrpo"}))
    with pytest.raises(ConfigError, match="'algorithm.preset'"):
        config_from_dict(_base(algorithm={"preset": 3}))


def test_what_a_preset_leaves_out_is_said():
    assert "overlong_penalty" in preset_note("dapo")
    assert "teacher.path" in preset_note("opd")
    assert preset_note("gspo") == "" and preset_note(None) == ""


def test_no_preset_changes_nothing():
    assert (
        config_from_dict(_base()).to_dict()
        == config_from_dict(_base(algorithm={"preset": None})).to_dict()
    )
    assert preset_report(config_from_dict(_base())) == []


def test_the_run_logs_the_resolved_values(tiny_config, caplog):
    from groupflow.trainer import Trainer

    cfg = tiny_config(algorithm__preset="dr_grpo", actor__clip_eps_high=0.25)
    with caplog.at_level(logging.INFO, logger="groupflow"):
        Trainer(cfg)
    line = next(r.getMessage() for r in caplog.records if "algorithm.preset" in r.getMessage())
    assert line.startswith("algorithm.preset=dr_grpo: algorithm.estimator='dr_grpo' (preset)")
    assert "actor.clip_eps_high=0.25 (overridden)" in line
    assert "actor.loss_agg='seq_mean_token_sum_norm' (preset)" in line


def test_a_diffusion_run_refuses_a_preset(tmp_path):
    data = {
        "diffusion": {"model": {"kind": "tiny", "path": str(tmp_path)}, "num_steps": 3},
        "data": {"train_files": [str(tmp_path / "p.jsonl")]},
        "reward": {"functions": [{"name": "brightness"}]},
    }
    assert config_from_dict(data).diffusion is not None  # loads without one
    data["algorithm"] = {"preset": "dapo"}
    with pytest.raises(ConfigError, match="algorithm.preset='dapo' sets LLM loss keys"):
        config_from_dict(data)


def test_a_preset_chosen_on_the_command_line_warns_about_each_key_the_file_shadows(caplog):
    """examples/reverse_demo.yaml sets actor.loss_agg: token_mean; preset dr_grpo on top of it
    keeps token_mean (the file's key wins, as explicit keys do) and the loader says so, naming
    both values; an override of the key, or a preset written in the file, is deliberate."""
    import logging

    from groupflow.config import load_config

    with caplog.at_level(logging.WARNING, logger="groupflow"):
        cfg = load_config("examples/reverse_demo.yaml", ["algorithm.preset=dr_grpo"])
    assert cfg.actor.loss_agg == "token_mean"
    assert (
        "algorithm.preset=dr_grpo sets actor.loss_agg='seq_mean_token_sum_norm', but "
        "examples/reverse_demo.yaml gives actor.loss_agg='token_mean', which wins" in caplog.text
    )
    assert "add actor.loss_agg='seq_mean_token_sum_norm'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="groupflow"):
        load_config("examples/reverse_demo.yaml",
                    ["algorithm.preset=dr_grpo", "actor.loss_agg=seq_mean_token_sum_norm"])  # fmt: skip
        load_config("examples/reverse_demo.yaml", ["algorithm.preset=dapo"])  # same value
    assert "algorithm.preset" not in caplog.text


def test_a_preset_in_the_file_with_its_own_keys_does_not_warn(tmp_path, caplog):
    import logging

    import yaml

    from groupflow.config import load_config

    data = yaml.safe_load(open("examples/reverse_demo.yaml"))
    data.setdefault("algorithm", {})["preset"] = "gspo"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    with caplog.at_level(logging.WARNING, logger="groupflow"):
        cfg = load_config(path, ["run.seed=3"])
    assert cfg.actor.loss_agg == "token_mean" and "algorithm.preset" not in caplog.text
