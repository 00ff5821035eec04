"""Tests of the typed run configuration: example files, strictness, cross-field checks, overrides.

Every YAML under ``examples/`` is loaded by a parametrised test, so a new example is covered (and
a broken one fails) without editing this file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from groupflow.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_from_dict,
    load_config,
    parse_overrides,
)
from groupflow.run.tracking import save_config

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").rglob("*.y*ml"))


def test_examples_exist():
    assert EXAMPLES, "no example configs found under examples/"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_loads_and_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    # the dump of a validated config validates again to the same config
    assert config_from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()


def _base() -> dict:
    return {"model": {"tiny": {}}, "data": {"task": {"name": "reverse"}}}


def _error(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, "test.yaml")
    return str(info.value)


def test_minimal_config_uses_defaults():
    cfg = config_from_dict(_base())
    assert cfg.rollout.samples_per_prompt == 8
    assert cfg.actor.loss_agg == "token_mean"
    assert cfg.actor.kl_coef == 0.0
    assert cfg.run.resume == "auto"


# ----- unknown keys ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"rnu": {}}, "'rnu': unknown key; did you mean 'run'?"),
        ({"actor.lrr": 1e-3}, "'actor.lrr': unknown key; did you mean 'actor.lr'?"),
        (
            {"model.tiny.hiden_size": 8},
            "'model.tiny.hiden_size': unknown key; did you mean 'model.tiny.hidden_size'?",
        ),
        (
            {"data.task.digts": 3},
            "'data.task.digts': unknown key; did you mean 'data.task.digits'?",
        ),
        (
            {"reward.functions": [{"name": "gsm8k", "wieght": 2}]},
            "'reward.functions.0.wieght': unknown key; did you mean 'reward.functions.0.weight'?",
        ),
    ],
)
def test_unknown_keys_at_any_depth_suggest_the_closest(overrides, expected):
    msg = _error(apply_overrides(_base(), overrides))
    assert msg.startswith("invalid configuration in test.yaml:")
    assert expected in msg


def test_unknown_key_without_close_match_lists_valid_keys():
    msg = _error(apply_overrides(_base(), {"rollout.qqqzzz": 1}))
    assert "'rollout.qqqzzz': unknown key; valid keys here:" in msg
    assert "samples_per_prompt" in msg and "max_new_tokens" in msg


def test_every_error_is_reported_at_once():
    msg = _error(apply_overrides(_base(), {"actor.lrr": 1, "rollout.top_p": 0}))
    assert "'actor.lrr'" in msg and "'rollout.top_p'" in msg


# ----- invalid values ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"actor.lr": -1e-3}, "'actor.lr': Input should be greater than 0 (got -0.001)"),
        ({"rollout.top_p": 0}, "'rollout.top_p': Input should be greater than 0 (got 0)"),
        ({"rollout.top_p": 1.5}, "'rollout.top_p'"),
        ({"actor.loss_agg": "mean"}, "'actor.loss_agg'"),
        ({"rollout.samples_per_prompt": 0}, "'rollout.samples_per_prompt'"),
        ({"run.loggers": ["csv"]}, "'run.loggers.0'"),
        (
            # 32 prompts × 8 samples = 256 samples per step
            {"actor.mini_batch_samples": 48},
            "actor.mini_batch_samples=48 must divide the samples per step "
            "(data.prompts_per_step × rollout.samples_per_prompt = 256)",
        ),
        (
            {"actor.micro_batch_samples": 4, "actor.micro_batch_tokens": 1024},
            "set at most one of actor.micro_batch_samples and actor.micro_batch_tokens",
        ),
        ({"model.path": "/models/x"}, "set exactly one of model.path"),
        ({"model.tiny": None}, "set exactly one of model.path"),
        ({"data.train_files": ["a.jsonl"]}, "set exactly one of data.train_files or data.task"),
        (
            {"reward.functions": [{"name": "gsm8k", "function": "m:f"}]},
            "exactly one of 'name' (built-in) or 'function'",
        ),
        ({"reward.normalize": "batch"}, "'reward.normalize': Input should be 'none' or 'group'"),
        ({"reward.normalize_eps": -1}, "'reward.normalize_eps'"),
        (
            {"reward.functions": [{"name": "gsm8k", "monitor": True}]},
            "'reward': functions: every reward is a monitor",
        ),
        (
            {
                "reward.functions": [
                    {"name": "gsm8k"},
                    {"name": "format_tags", "monitor": True, "weight": 2.0},
                ]
            },
            "'reward.functions.1': weight: a monitor reward is not trained on",
        ),
    ],
)
def test_invalid_values_name_the_key(overrides, expected):
    assert expected in _error(apply_overrides(_base(), overrides))


def test_loss_options_are_checked_against_the_chosen_loss():
    ok = {"actor.loss_fn": "cispo", "actor.ratio_level": "sequence"}
    ok["actor.loss_options"] = {"clip_ratio_max": 4.0}
    cfg = config_from_dict(apply_overrides(_base(), ok))
    assert cfg.actor.loss_options == {"clip_ratio_max": 4.0}
    # a typed PPO option the loss does not take would be dropped silently: an error instead
    msg = _error(apply_overrides(_base(), {"actor.loss_fn": "cispo", "actor.clip_eps_high": 5.0}))
    assert "actor.clip_eps_high does not apply to actor.loss_fn='cispo'" in msg
    assert "clip_ratio_max" in msg
    msg = _error(
        apply_overrides(_base(), {"actor.loss_fn": "vespo", "actor.ratio_level": "sequence"})
    )
    assert "actor.ratio_level does not apply to actor.loss_fn='vespo'" in msg
    # a default value is no request (a dumped config holds them all) and reloads
    cfg = config_from_dict(apply_overrides(_base(), {"actor.loss_fn": "vespo"}))
    assert config_from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    bad = {"actor.loss_fn": "sapo", "actor.loss_options": {"temperature_negative": 1.1}}
    msg = _error(apply_overrides(_base(), bad))
    assert "'temperature_negative'" in msg and "did you mean 'temperature_neg'" in msg


def test_teacher_section_is_typed_and_not_for_gae():
    cfg = config_from_dict(apply_overrides(_base(), {"teacher.path": "/t", "teacher.coef": 0.5}))
    assert (cfg.teacher.coef, cfg.teacher.reward_weight) == (0.5, 1.0)
    assert "'teacher.coef'" in _error(
        apply_overrides(_base(), {"teacher.path": "/t", "teacher.coef": -1})
    )
    gae = {"teacher.path": "/t", "algorithm.estimator": "gae", "critic": {}}
    msg = _error(apply_overrides(_base(), gae))
    assert "does not combine with algorithm.estimator=gae" in msg


def test_kl_bias_correction_needs_a_kl_loss_and_an_llm_policy():
    on = {"actor.kl_bias_correction": True, "actor.kl_coef": 0.05}
    assert config_from_dict(apply_overrides(_base(), on)).actor.kl_bias_correction is True
    assert config_from_dict(_base()).actor.kl_bias_correction is False  # verl's convention
    msg = _error(apply_overrides(_base(), {"actor.kl_bias_correction": True}))
    assert "actor.kl_bias_correction weights the KL loss term" in msg and "actor.kl_coef" in msg
    assert "'actor.kl_bias_correction'" in _error(
        apply_overrides(_base(), {**on, "actor.kl_bias_correction": "sometimes"})
    )
    examples = Path(__file__).resolve().parents[1] / "examples"
    diffusion = yaml.safe_load((examples / "diffusion_demo.yaml").read_text())
    msg = _error(apply_overrides(diffusion, on))
    assert "actor.kl_bias_correction: for LLM policies only" in msg


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            {"run.backend": "ray", "run.num_workers": 3, "placement.actor.nodes": 2},
            "run.num_workers=3 does not split evenly over placement.actor.nodes=2",
        ),
        (
            {
                "run.backend": "ray",
                "run.num_workers": 4,
                "placement.actor": {"nodes": 2, "workers_per_node": 3},
            },
            "placement.actor: 2 node(s) × 3 worker(s) per node does not make run.num_workers=4",
        ),
        (
            {"placement.reference": {"workers_per_node": 1}},
            "placement.reference is a pool but no reference model is used",
        ),
        (
            {"placement.rollout": {"workers_per_node": 2}},
            "placement.rollout: the local backend runs one in-process worker per role",
        ),
        ({"placement.rollout": "apart"}, "'placement.rollout"),
        (
            {"placement.critic": {"nodes": 1}},
            "placement.critic is set but the run has no 'critic' section",
        ),
        ({"placement.actor.gpus_per_worker": -1}, "'placement.actor.gpus_per_worker'"),
    ],
)
def test_bad_placement_names_the_key(overrides, expected):
    assert expected in _error(apply_overrides(_base(), overrides))


def test_vllm_engine_clashes_are_named():
    data = apply_overrides(
        _base(),
        {"rollout.engine": "vllm", "model.tiny": {"hidden_size": 128, "num_heads": 2},
         "actor.lora": {"rank": 4}, "placement.rollout": {"workers_per_node": 1},
         "rollout.max_staleness": 1},
    )  # fmt: skip
    msg = _error(data)
    assert "rollout.engine=vllm does not work with actor.lora" in msg
    assert (
        "placement.rollout as its own pool on run.backend=local with rollout.max_staleness=1" in msg
    )


@pytest.mark.parametrize("backend", ["ray", "local"])
def test_vllm_engine_with_a_synchronous_rollout_pool_is_accepted(backend):
    """A rollout pool builds vLLM in its workers (tests/distributed/test_ray_vllm_pool.py)."""
    data = apply_overrides(
        _base(),
        {"rollout.engine": "vllm", "model.tiny": {"hidden_size": 128, "num_heads": 2},
         "run.backend": backend, "placement.rollout": {"workers_per_node": 1}},
    )  # fmt: skip
    cfg = config_from_dict(data)
    assert cfg.rollout.engine == "vllm" and cfg.placement.rollout.workers_per_node == 1


def test_the_filesystem_transport_across_nodes_needs_a_shared_weight_dir(tmp_path):
    from groupflow.config.root import spans_nodes

    apart = {"run.backend": "ray", "rollout.weight_transport": "filesystem",
             "placement.actor": {"resources": {"node_a": 1}},
             "placement.rollout": {"resources": {"node_b": 1}}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"rollout\.weight_dir: the filesystem weight transport "
                       r"across nodes \(the pools are pinned to different resources \(placement"
                       r"\.actor\.resources=\{'node_a': 1(\.0)?\}, placement\.rollout"):  # fmt: skip
        config_from_dict(apply_overrides(_base(), apart))
    shared = config_from_dict(
        apply_overrides(_base(), {**apart, "rollout.weight_dir": str(tmp_path)})
    )
    assert spans_nodes(shared).startswith("the pools are pinned to different resources")
    # the same pins on every pool, or one node: nothing says the pools are apart
    together = {**apart, "placement.actor": {"resources": {"node_b": 1}}}
    assert spans_nodes(config_from_dict(apply_overrides(_base(), together))) is None
    spread = {**apart, "placement.rollout": {"nodes": 2}, "placement.actor": {}}
    with pytest.raises(ConfigError, match=r"rollout\.weight_dir: .*placement\.rollout\.nodes is 2"):
        config_from_dict(apply_overrides(_base(), spread))


def test_mini_batch_dividing_samples_is_accepted():
    cfg = config_from_dict(apply_overrides(_base(), {"actor.mini_batch_samples": 64}))
    assert cfg.actor.mini_batch_samples == 64


# ----- overrides ---------------------------------------------------------------------------------


def test_parse_overrides_values_are_yaml():
    parsed = parse_overrides(
        [
            "actor.lr=0.001",
            "run.total_steps=5",
            "validation.greedy=false",
            'rollout.stop=["\\n", "###"]',
            "run.loggers=[]",
            "reward.functions=[{name: gsm8k, weight: 0.5}]",
            "run.name=my run",
            "actor.grad_clip=",
            "run.resume=a=b",  # only the first '=' separates key and value
        ]
    )
    assert parsed == {
        "actor.lr": 0.001,
        "run.total_steps": 5,
        "validation.greedy": False,
        "rollout.stop": ["\n", "###"],
        "run.loggers": [],
        "reward.functions": [{"name": "gsm8k", "weight": 0.5}],
        "run.name": "my run",
        "actor.grad_clip": None,
        "run.resume": "a=b",
    }


@pytest.mark.parametrize("item", ["actor.lr", "=5", " =5", ""])
def test_parse_overrides_rejects_items_without_key_value(item):
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides([item])


def test_parse_overrides_rejects_bad_yaml():
    with pytest.raises(ConfigError, match="rollout.stop=\\[unclosed.*not valid YAML"):
        parse_overrides(["rollout.stop=[unclosed"])


def test_apply_overrides_creates_sections_and_later_wins():
    data = apply_overrides(
        {"run": {"name": "x"}},
        {"sft.steps": 3, "model.tiny.hidden_size": 16, "run.name": "y", "sft.lr": 0.1},
    )
    assert data == {
        "run": {"name": "y"},
        "sft": {"steps": 3, "lr": 0.1},
        "model": {"tiny": {"hidden_size": 16}},
    }
    assert apply_overrides({"a": 1}, {"a": 2})["a"] == 2


def test_apply_overrides_into_a_value_is_an_error():
    with pytest.raises(ConfigError, match="'actor.lr' is a value, not a section"):
        apply_overrides({"actor": {"lr": 1.0}}, {"actor.lr.x": 1})


def test_load_config_with_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**_base(), "actor": {"lr": 0.5, "grad_clip": 2.0}}))
    cfg = load_config(
        path,
        [
            "actor.lr=1e-4",  # YAML 1.1 reads this as a string; the schema converts it
            "actor.grad_clip=",  # empty: None, i.e. no clipping
            "validation.every_steps=5",  # a section the file does not have
            "model.tiny.hidden_size=16",
        ],
    )
    assert cfg.actor.lr == 1e-4 and isinstance(cfg.actor.lr, float)
    assert cfg.actor.grad_clip is None
    assert cfg.validation.every_steps == 5
    assert cfg.model.tiny.hidden_size == 16


def test_load_config_from_overrides_only():
    cfg = load_config(None, ["model.tiny.hidden_size=16", "data.task.name=add"])
    assert cfg.data.task.name == "add"


@pytest.mark.parametrize(
    "text, expected",
    [("- a\n- b\n", "must contain a mapping"), ("run: [x\n", "not valid YAML")],
)
def test_load_config_rejects_bad_files(tmp_path, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected):
        load_config(path)


def test_load_config_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_empty_file_is_an_empty_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("")
    msg = str(pytest.raises(ConfigError, load_config, path).value)
    assert "'model'" in msg and "'data'" in msg  # the two required sections


# ----- saved config --------------------------------------------------------------------------------


def test_saved_config_reloads_identically(tmp_path):
    cfg = config_from_dict(apply_overrides(_base(), {"rollout.stop": ["\n"], "actor.lr": 3e-4}))
    path = save_config(tmp_path, cfg.to_dict())
    assert load_config(path).to_dict() == cfg.to_dict()


def test_secrets_never_reach_saved_config(tmp_path, monkeypatch):
    monkeypatch.setenv("JUDGE_API_KEY", "sk-live-0123456789abcdef")
    spec = {
        "function": "m:f",
        "kwargs": {"api_key": "sk-inline-secret-value", "base_url": "http://x"},
    }
    cfg = config_from_dict(
        apply_overrides(
            _base(), {"reward.functions": [spec], "run.name": "sk-live-0123456789abcdef"}
        )
    )
    text = save_config(tmp_path, cfg.to_dict()).read_text()
    assert "sk-inline-secret-value" not in text
    assert "sk-live-0123456789abcdef" not in text  # an env secret's value, anywhere
    saved = yaml.safe_load(text)
    assert saved["reward"]["functions"][0]["kwargs"]["base_url"] == "http://x"
    assert saved["reward"]["functions"][0]["kwargs"]["api_key"] == "<redacted>"


# ----- duplicate keys --------------------------------------------------------------------------


def test_a_repeated_section_is_an_error_naming_both_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "model:\n  tiny: {}\n"
        "actor:\n  lr: 0.5\n"  # lines 3-4: silently dropped by plain YAML loading
        "data:\n  task: {name: reverse}\n"
        "actor:\n  grad_clip: 2.0\n"  # line 7
    )
    with pytest.raises(
        ConfigError, match=r"line 7.*duplicate key 'actor' \(first at line 3, again at line 7\)"
    ):
        load_config(path)


def test_a_repeated_nested_key_is_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "model:\n  tiny: {}\ndata:\n  task: {name: reverse}\nactor:\n  lr: 0.5\n  lr: 0.1\n"
    )
    with pytest.raises(
        ConfigError, match=r"duplicate key 'lr' \(first at line 6, again at line 7\)"
    ):
        load_config(path)


def test_a_repeated_key_in_an_override_value_is_an_error():
    with pytest.raises(
        ConfigError, match=r"duplicate key 'name' \(first at line 1, again at line 1\)"
    ):
        parse_overrides(["data.task={name: add, name: reverse}"])


def test_merge_keys_may_still_be_overridden():
    # YAML's "<<" merge brings in defaults that the mapping's own keys override: not a duplicate
    assert parse_overrides(
        ["model.tiny={<<: {hidden_size: 16, num_layers: 2}, hidden_size: 32}"]
    ) == {"model.tiny": {"hidden_size": 32, "num_layers": 2}}


# ----- strict types ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "data.prompts_per_step=true",
            "'data.prompts_per_step': Input should be a valid integer (got True)",
        ),
        (
            "data.prompts_per_step='8'",
            "'data.prompts_per_step': Input should be a valid integer (got '8')",
        ),
        ("run.total_steps=2.5", "'run.total_steps': Input should be a valid integer (got 2.5)"),
        ("run.total_steps=3.0", "'run.total_steps': Input should be a valid integer (got 3.0)"),
        ("validation.greedy=1", "'validation.greedy': Input should be a valid boolean (got 1)"),
        ("data.shuffle=yes please", "'data.shuffle': Input should be a valid boolean"),
        ("actor.lr=true", "'actor.lr': Input should be a valid number (got True)"),
        ("rollout.temperature='0.7'", "'rollout.temperature': Input should be a valid number"),
        ("actor.grad_clip=false", "'actor.grad_clip'"),
        ("algorithm.kl_in_reward.coef=true", "'algorithm.kl_in_reward.coef'"),
    ],
)
def test_values_are_not_coerced_across_types(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.tiny.hidden_size=16", "data.task.name=add", override])
    assert expected in str(info.value)


def test_cli_values_keep_their_yaml_types():
    cfg = load_config(
        None,
        [
            "model.tiny.hidden_size=16",
            "data.task.name=add",
            "data.prompts_per_step=3",  # an int from the command line
            "actor.lr=1",  # an int where a float is expected: fine, 1.0
            "actor.betas=[0.9, 0.95]",  # YAML has no tuples
            "validation.greedy=false",
        ],
    )
    assert cfg.data.prompts_per_step == 3 and isinstance(cfg.data.prompts_per_step, int)
    assert cfg.actor.lr == 1.0 and isinstance(cfg.actor.lr, float)
    assert cfg.actor.betas == (0.9, 0.95) and cfg.validation.greedy is False
    assert config_from_dict(cfg.to_dict()).actor.betas == (0.9, 0.95)  # the dump reloads


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("continuous_batching", "maybe", "valid boolean"),
        ("max_batch_samples", 0, "greater than or equal to 1"),
        ("port", 70000, "less than or equal to 65535"),
    ],
)
def test_bad_serve_values_name_the_key(key, value, message):
    err = _error({**_base(), "serve": {key: value}})
    assert f"serve.{key}" in err and message in err


def test_present_narrows_a_guaranteed_section_and_names_a_missing_one(tiny_config):
    from groupflow.config import present

    cfg = tiny_config()
    assert present(cfg.model, "model") is cfg.model
    assert present(0, "run.seed") == 0  # only None is missing
    with pytest.raises(ConfigError, match=r"diffusion must be set here \(it is None\)"):
        present(cfg.diffusion, "diffusion")
