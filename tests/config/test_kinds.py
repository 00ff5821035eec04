"""``groupflow.config.kinds``: which kind a config trains, the defaults a kind gives other
sections' unset keys, and that a kind's checks are what ``Config`` runs for it."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from groupflow.config import ConfigError, config_from_dict
from groupflow.config.kinds import DIFFUSION, KINDS, LLM, apply_kind_defaults, kind_of


def _llm(**sections) -> dict:
    data = {"model": {"tiny": {}}, "data": {"task": {"name": "reverse"}}}
    data.update(sections)
    return data


def _diffusion(tmp_path, **sections) -> dict:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "red"}\n')
    data = {
        "diffusion": {"model": {"kind": "tiny", "path": str(tmp_path / "m")}, "num_steps": 3,
                      "timestep_fraction": 0.67},
        "data": {"train_files": [str(prompts)], "prompts_per_step": 2},
        "reward": {"functions": [{"name": "brightness"}]},
    }  # fmt: skip
    data.update(sections)
    return data


def test_the_section_chooses_the_kind(tmp_path):
    assert config_from_dict(_llm()).kind is LLM
    assert config_from_dict(_diffusion(tmp_path)).kind is DIFFUSION
    assert set(KINDS) == {"llm", "diffusion"} and KINDS["llm"].section == "model"
    neither = SimpleNamespace(model=None, diffusion=None)
    both = SimpleNamespace(model=1, diffusion=1)
    for cfg in (neither, both):
        with pytest.raises(ValueError, match="set exactly one of 'model'"):
            kind_of(cfg)


def test_defaults_fill_only_the_keys_the_user_left_unset():
    class Section(SimpleNamespace):
        model_fields_set: set

    actor = Section(clip_eps_low=0.2, model_fields_set=set())
    algorithm = Section(adv_clip_max=1.5, model_fields_set={"adv_clip_max"})
    cfg = SimpleNamespace(actor=actor, algorithm=algorithm)
    apply_kind_defaults(cfg, DIFFUSION)
    assert actor.clip_eps_low == 1e-4  # unset: the diffusion kind's default
    assert algorithm.adv_clip_max == 1.5  # the user's value stays


def test_the_llm_kind_has_no_defaults(tmp_path):
    cfg = config_from_dict(_llm())
    assert LLM.defaults == {} and cfg.actor.clip_eps_low == 0.2
    assert cfg.algorithm.adv_clip_max is None


def test_config_runs_the_registered_kinds_checks(monkeypatch):
    def refuse_long_runs(cfg):
        if cfg.run.total_steps > 10:
            raise ValueError(f"run.total_steps={cfg.run.total_steps}: at most 10 for this kind")

    strict = dataclasses.replace(LLM, checks=(*LLM.checks, refuse_long_runs))
    monkeypatch.setitem(KINDS, "llm", strict)
    assert config_from_dict(_llm(run={"total_steps": 5})).kind is strict
    with pytest.raises(ConfigError, match="run.total_steps=20: at most 10 for this kind"):
        config_from_dict(_llm(run={"total_steps": 20}))


@pytest.mark.parametrize(
    "sections,message",
    [
        ({"teacher": {"path": "t"}, "algorithm": {"estimator": "gae"}, "critic": {}},
         "does not combine with algorithm.estimator=gae"),
        ({"rollout": {"workflow": "diffusion"}}, "needs a 'diffusion' section"),
    ],
)  # fmt: skip
def test_llm_kind_refusals_name_the_key(sections, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(_llm(**sections))


@pytest.mark.parametrize(
    "sections,message",
    [
        (
            {"actor": {"kl_bias_correction": True, "kl_coef": 0.1}},
            "actor.kl_bias_correction: for LLM policies only",
        ),
        ({"actor": {"packing": True}}, "actor.packing packs token sequences"),
        ({"actor": {"off_policy": "tis"}}, "actor.off_policy=tis is implemented for LLM"),
        ({"algorithm": {"preset": "dapo"}}, "algorithm.preset='dapo' sets LLM loss keys"),
        ({"rollout": {"engine": "vllm"}}, "rollout.engine=vllm does not work with a 'diffusion'"),
        (
            {"rollout": {"max_staleness": 1, "async_mode": "in_flight"}},
            "rollout.async_mode=in_flight switches weights between an LLM's decode steps",
        ),
        (
            {"rollout": {"workflow": "agent", "agent": "m:f"}},
            "rollout.workflow=agent trains an LLM",
        ),
        ({"rollout": {"workflow": "single_turn"}}, "rollout.max_turns / tools / environment"),
    ],
)
def test_diffusion_kind_refusals_name_the_key(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(_diffusion(tmp_path, **sections))


def test_what_the_run_reads_from_the_kind(tmp_path):
    from groupflow.trainer import check_benchmark_names
    from groupflow.workflows import workflow_name

    llm = config_from_dict(_llm())
    tools = config_from_dict(_llm(rollout={"max_turns": 2, "tools": [{"name": "calculator"}]}))
    diffusion = config_from_dict(_diffusion(tmp_path))
    assert [workflow_name(c) for c in (llm, tools, diffusion)] == [
        "single_turn", "multi_turn", "diffusion"
    ]  # fmt: skip
    assert (llm.kind.writes_text, llm.kind.teacher_in_actor) == (True, False)
    assert (diffusion.kind.writes_text, diffusion.kind.teacher_in_actor) == (False, True)
    diffusion.validation.benchmarks = ["ifeval"]
    with pytest.raises(ValueError, match="named benchmarks evaluate LLM policies only"):
        check_benchmark_names(diffusion)
