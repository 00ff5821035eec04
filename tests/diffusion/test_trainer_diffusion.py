"""The diffusion policy through the same Trainer: config, a short run, online test, resume, control."""

import json
import math

import pytest
import torch

from groupflow.config import ConfigError, config_from_dict
from groupflow.data import DataError
from groupflow.diffusion.models import TinyFlowModel, save_tiny_model
from groupflow.diffusion.pretrain import COLORS
from groupflow.run.tracking import read_metrics
from groupflow.trainer import Trainer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random-weight tiny flow model (8x8, width 8) knowing the synthetic colour labels."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-flow")
    save_tiny_model(TinyFlowModel(list(COLORS), image_size=8, width=8), path)
    return path


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Another tiny flow model of the same latent and labels: a distillation teacher."""
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("teacher-flow")
    save_tiny_model(TinyFlowModel(list(COLORS), image_size=8, width=8), path)
    return path


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": c}) + "\n" for c in ("red", "blue", "green")))
    return path


def _cfg(out, model_dir, prompts, drop=(), **over):
    from groupflow.config import apply_overrides

    data = {
        "run": {"name": "diff", "output_dir": str(out), "seed": 0, "total_steps": 2, "loggers": [],
                "num_threads": 1, "samples_every": 1, "console_every": 1},
        "diffusion": {"model": {"kind": "tiny", "path": str(model_dir)}, "num_steps": 3,
                      "timestep_fraction": 0.67, "eval_samples_per_prompt": 2},
        "data": {"train_files": [str(prompts)], "prompts_per_step": 2},
        "rollout": {"samples_per_prompt": 3},
        "validation": {"every_steps": 1},
        "actor": {"lr": 1e-3},
        "reward": {"functions": [{"name": "brightness"}]},
    }  # fmt: skip
    for key in drop:  # "section.key" left to its default
        section, name = key.split(".")
        del data[section][name]
    return config_from_dict(apply_overrides(data, over))


def test_config_chooses_the_policy_type_and_sets_diffusion_defaults(
    tiny_dir, prompts_file, tmp_path
):
    cfg = _cfg(tmp_path, tiny_dir, prompts_file)
    assert (
        cfg.model is None and cfg.actor.clip_eps_low == 1e-4 and cfg.algorithm.adv_clip_max == 5.0
    )
    cfg = _cfg(tmp_path, tiny_dir, prompts_file, **{"actor.clip_eps_low": 1e-3})
    assert cfg.actor.clip_eps_low == 1e-3
    with pytest.raises(ConfigError, match="set exactly one of 'model'"):
        _cfg(tmp_path, tiny_dir, prompts_file, **{"model.tiny.hidden_size": 32})


@pytest.mark.parametrize(
    "override,message",
    [
        (
            {"diffusion.sampler": "flow"},
            r"'diffusion.sampler': unknown sampler 'flow'; valid names: cps, dance_sde, flow_sde, ode",
        ),
        ({"diffusion.sampler": "ode"}, "has no step log-probs"),
        ({"diffusion.timestep_selection": "window"}, "diffusion.window"),
        ({"diffusion.model.kind": "sd3"}, "latent_shape is required"),
        ({"sft.steps": 5}, "sft.steps"),
        ({"diffusion.num_stepz": 5}, "did you mean 'diffusion.num_steps'"),
        ({"diffusion.objective": "dpo"}, "'diffusion.objective'"),
        ({"diffusion.sde_window.size": 4}, "diffusion.sde_window.size=4 exceeds"),
        ({"diffusion.sde_window.size": 2}, "sde_window trains every step of its window"),
        ({"diffusion.sde_window.stride": -1}, "'diffusion.sde_window.stride'"),
        ({"diffusion.ratio_norm": True, "diffusion.sampler": "cps"}, "constant-free"),
        ({"diffusion.ratio_norm": True, "diffusion.objective": "nft"}, "objective=nft has its own"),
        ({"diffusion.objective": "nft", "diffusion.sampler": "ode"}, "same_noise_per_group: false"),
        ({"diffusion.nft.beta": 0}, "'diffusion.nft.beta'"),
        ({"diffusion.model.vae_path": "vae"}, "diffusion.model.vae_path is for kinds sd3, wan, flux, .* not 'tiny'"),
        ({"diffusion.activation_checkpointing": True}, "not 'tiny'"),
        ({"diffusion.bf16": True}, "diffusion.bf16 is FSDP2's mixed precision .*set diffusion.fsdp: true"),
        ({"diffusion.bf16": True, "diffusion.fsdp": True}, "run.num_workers=1"),
        ({"diffusion.cpu_offload": True}, "diffusion.cpu_offload is FSDP2's CPUOffloadPolicy .*set diffusion.fsdp: true"),
        ({"diffusion.cpu_offload": True, "diffusion.fsdp": True}, "diffusion.cpu_offload applies through FSDP2.*run.num_workers=1"),
        ({"diffusion.nft.old_decay_max": 1.0}, "'diffusion.nft.old_decay_max'"),
        ({"diffusion.objective": "flow_dppo", "diffusion.sampler": "ode"}, "has no step log-probs"),
        ({"diffusion.objective": "flow_dppo", "diffusion.ratio_norm": True}, "objective=flow_dppo has its own"),
        ({"diffusion.objective": "awm", "diffusion.ratio_norm": True}, "objective=awm has its own"),
        ({"diffusion.objective": "awm", "diffusion.sampler": "ode"}, "same_noise_per_group: false"),
        ({"diffusion.flow_dppo.kl_mask_threshold": 0}, "'diffusion.flow_dppo.kl_mask_threshold'"),
        ({"diffusion.awm.weighting": "sqrt"}, "'diffusion.awm.weighting'"),
        # a distillation teacher: step means (grpo / flow_dppo), one local dir, colocated
        ({"teacher.path": "t", "diffusion.objective": "awm"}, "teacher with diffusion.objective='awm'"),
        ({"teacher.path": "t", "teacher.coef": 0, "teacher.reward_weight": 0}, "both 0"),
        ({"teacher.path": "t", "teacher.dtype": "bfloat16"}, "teacher.dtype: not with a diffusion teacher"),
        ({"teacher.path": "t", "placement.teacher": {}}, "placement.teacher: not with a diffusion"),
        ({"teacher.path": "t", "diffusion.fsdp": True}, "diffusion.fsdp: not with a diffusion"),
        ({"placement.reference": {}, "actor.kl_coef": 0.1}, "placement.reference: for LLM policies only"),
        # a rollout pool's workers hold a replicated flow model, not Ulysses groups
        ({"diffusion.model.kind": "wan", "diffusion.model.latent_shape": [4, 3, 8, 8],
          "run.backend": "ray", "run.num_workers": 2, "parallel.sequence_parallel": 2,
          "placement.rollout": {}},
         r"parallel.sequence_parallel: not with a diffusion rollout pool \(placement.rollout\)"),
    ],
)  # fmt: skip
def test_bad_diffusion_config_names_the_key(tiny_dir, prompts_file, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(tmp_path, tiny_dir, prompts_file, **override)


VARIANT_RUNS = [
    pytest.param({"diffusion.sampler": "cps"}, id="cps"),
    pytest.param({"diffusion.sde_window": {"size": 2, "shift_interval": 1},
                  "actor.ppo_epochs": 2, "drop": ["diffusion.timestep_fraction"]}, id="mixgrpo"),
    pytest.param({"diffusion.ratio_norm": True, "actor.ppo_epochs": 2}, id="grpo_guard"),
    pytest.param({"diffusion.objective": "nft", "diffusion.sampler": "ode",
                  "diffusion.same_noise_per_group": False}, id="nft"),
    # several optimizer steps per batch: Flow-DPPO's mask needs the old step means recomputed
    pytest.param({"diffusion.objective": "flow_dppo", "actor.ppo_epochs": 2}, id="flow_dppo"),
    pytest.param({"diffusion.objective": "awm", "diffusion.awm.weighting": "t",
                  "actor.ppo_epochs": 2}, id="awm"),
]  # fmt: skip


@pytest.mark.parametrize("over", VARIANT_RUNS)
def test_each_algorithm_switch_trains_and_resumes_exactly(tiny_dir, prompts_file, tmp_path, over):
    def run(**more):
        t = Trainer(_cfg(tmp_path, tiny_dir, prompts_file, **{**over, **more}))
        t.fit()
        return t

    full = run(**{"run.name": "full", "run.total_steps": 3})
    rows = read_metrics(full.run_dir / "metrics.jsonl")
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert all(r["actor/grad_norm"] > 0 for r in rows[1:])
    run(**{"run.name": "part", "run.save_every": 1})
    resumed = run(**{"run.name": "part", "run.total_steps": 3})
    a = read_metrics(full.run_dir / "metrics.jsonl")[-1]
    b = read_metrics(resumed.run_dir / "metrics.jsonl")[-1]
    for key in ("reward/mean", "actor/grad_norm", "actor/loss"):
        assert a[key] == b[key], key
    sa, sb = full.policy.actor.state_dict(), resumed.policy.actor.state_dict()
    for part in ("model", "nft_old"):
        assert all(torch.equal(sa[part][k], sb[part][k]) for k in sa.get(part, {}))


def test_a_teacher_trains_resumes_exactly_and_is_not_checkpointed(
    tiny_dir, teacher_dir, prompts_file, tmp_path
):
    teacher = {"teacher.path": str(teacher_dir), "teacher.coef": 0.5}

    def run(**more):
        t = Trainer(_cfg(tmp_path, tiny_dir, prompts_file, **{**teacher, **more}))
        t.fit()
        return t

    full = run(**{"run.name": "full", "run.total_steps": 3, "validation.every_steps": 0})
    rows = read_metrics(full.run_dir / "metrics.jsonl")
    trained = [r for r in rows if "actor/loss" in r]
    assert len(trained) == 3 and all(r["actor/distill_kl"] > 0 for r in trained)
    assert not any("distill/reverse_kl" in r for r in rows)  # the LLM credit stage is not used
    state = full.policy.actor.state_dict()
    assert set(state["model"]) == set(full.policy.actor.local_worker().flow.state_dict())
    run(**{"run.name": "part", "run.save_every": 1, "validation.every_steps": 0})
    resumed = run(**{"run.name": "part", "run.total_steps": 3, "validation.every_steps": 0})
    a = read_metrics(full.run_dir / "metrics.jsonl")[-1]
    b = read_metrics(resumed.run_dir / "metrics.jsonl")[-1]
    for key in ("reward/mean", "actor/grad_norm", "actor/loss", "actor/distill_kl"):
        assert a[key] == b[key], key


def test_a_teacher_of_other_labels_is_refused_at_start(tiny_dir, prompts_file, tmp_path):
    other = tmp_path / "other"
    save_tiny_model(TinyFlowModel(["red", "blue", "green"], image_size=8, width=8), other)
    cfg = _cfg(tmp_path, tiny_dir, prompts_file, **{"teacher.path": str(other)})
    with pytest.raises(ValueError, match=r"teacher.path: .* does not match .*labels: student"):
        Trainer(cfg)


def test_missing_model_and_unknown_prompt_are_clear(tiny_dir, prompts_file, tmp_path):
    with pytest.raises(FileNotFoundError, match="groupflow pretrain-diffusion --out"):
        Trainer(_cfg(tmp_path, tmp_path / "none", prompts_file))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "purple"}) + "\n")
    with pytest.raises(
        DataError, match=r"prompt 'purple' is not a label .* valid prompts: \['red'"
    ):
        Trainer(_cfg(tmp_path, tiny_dir, bad))


def test_short_run_logs_finite_metrics_and_image_grids(tiny_dir, prompts_file, tmp_path):
    trainer = Trainer(_cfg(tmp_path, tiny_dir, prompts_file, **{"actor.kl_coef": 0.05}))
    last = trainer.fit()
    rows = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all("val/reward/mean" in r for r in rows)
    first = rows[1]
    assert first["actor/ratio_min"] == 1.0 and first["actor/ratio_max"] == 1.0
    assert first["actor/kl_loss"] == 0.0 and first["batch/samples"] == 6
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert last["batch/trained_steps_per_sample"] == 2.0
    images = sorted(p.name for p in (trainer.run_dir / "images").iterdir())
    assert images == ["step_000000.png", "step_000001.png", "step_000002.png"]
    from PIL import Image

    assert Image.open(trainer.run_dir / "images" / "step_000000.png").size == (4 * 19, 4 * 28)
    sample = json.loads((trainer.run_dir / "samples.jsonl").read_text().splitlines()[0])
    assert "<image 3x8x8 mean rgb" in json.dumps(sample)


def test_resume_reproduces_the_uninterrupted_run(tiny_dir, prompts_file, tmp_path):
    full = Trainer(
        _cfg(tmp_path, tiny_dir, prompts_file, **{"run.name": "full", "run.total_steps": 3})
    )
    full.fit()
    part = Trainer(
        _cfg(tmp_path, tiny_dir, prompts_file, **{"run.name": "part", "run.save_every": 1})
    )
    part.fit()
    resumed = Trainer(
        _cfg(tmp_path, tiny_dir, prompts_file, **{"run.name": "part", "run.total_steps": 3})
    )
    resumed.fit()
    a = read_metrics(full.run_dir / "metrics.jsonl")[-1]
    b = read_metrics(resumed.run_dir / "metrics.jsonl")[-1]
    for key in ("reward/mean", "actor/grad_norm", "val/reward/mean", "actor/lr"):
        assert a[key] == b[key], key
    wa = full.policy.actor.state_dict()["model"]
    wb = resumed.policy.actor.state_dict()["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_shuffle_advantages_permutes_them(tiny_dir, prompts_file, tmp_path):
    trainer = Trainer(
        _cfg(tmp_path, tiny_dir, prompts_file, **{"algorithm.shuffle_advantages": True})
    )
    batch, _ = trainer.collect(0)
    plain = Trainer(_cfg(tmp_path, tiny_dir, prompts_file, **{"run.name": "plain"}))
    shuffled = trainer.credit(batch.copy(), 0)[0]["advantages"]
    reference = plain.credit(batch.copy(), 0)[0]["advantages"]
    assert not torch.equal(shuffled, reference)
    assert torch.equal(shuffled.sort().values, reference.sort().values)


def test_cli_pretrains_the_tiny_model(tmp_path, capsys):
    from groupflow.cli.commands import main
    from groupflow.diffusion.models import load_tiny_model

    assert (
        main(
            [
                "pretrain-diffusion",
                "--out",
                str(tmp_path / "m"),
                "--steps",
                "2",
                "--labels",
                "red,blue",
            ]
        )
        == 0
    )
    assert load_tiny_model(tmp_path / "m").labels == ["red", "blue"]
    assert "tiny flow model written to" in capsys.readouterr().out


def test_a_run_of_0_steps_exits_0_and_plots_the_online_test(tiny_dir, prompts_file, tmp_path,
                                                            capsys):  # fmt: skip
    """As an LLM run of 0 steps: the online test before training is logged, summarised and
    plotted, and train exits 0 (it exited 2: no plot panel matched a diffusion metric)."""
    import yaml

    from groupflow.cli.commands import main

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_cfg(tmp_path, tiny_dir, prompts_file).to_dict()))
    assert main(["train", str(path), "run.total_steps=0"]) == 0
    printed = capsys.readouterr().out
    assert "eval reward (fixed prompts and noise): before" in printed
    plots = tmp_path / "diff" / "plots"
    assert sorted(p.name for p in plots.iterdir()) == ["overview.png", "val_reward.png"]
    steps = {r["step"] for r in read_metrics(tmp_path / "diff" / "metrics.jsonl")}
    assert steps == {0}


@pytest.mark.slow
def test_one_ray_worker_gives_the_local_numbers(tiny_dir, teacher_dir, prompts_file, tmp_path):
    pytest.importorskip("ray")
    # with a distillation teacher: it is built and scored inside each Ray worker alike
    teacher = {"teacher.path": str(teacher_dir)}
    local = Trainer(_cfg(tmp_path, tiny_dir, prompts_file, **{"run.name": "local", **teacher}))
    local.fit()
    ray_run = Trainer(
        _cfg(tmp_path, tiny_dir, prompts_file,
             **{"run.name": "ray", "run.backend": "ray", **teacher})
    )  # fmt: skip
    try:
        ray_run.fit()
    finally:
        ray_run.shutdown()
    a = read_metrics(local.run_dir / "metrics.jsonl")
    b = read_metrics(ray_run.run_dir / "metrics.jsonl")
    for ra, rb in zip(a, b):
        for key in ("reward/mean", "actor/grad_norm", "val/reward/mean", "actor/distill_kl"):
            if key in ra:
                assert ra[key] == rb[key], (ra["step"], key)


def test_llm_only_commands_refuse_a_diffusion_config(tiny_dir, prompts_file, tmp_path, capsys):
    import yaml

    from groupflow.cli.commands import main

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_cfg(tmp_path, tiny_dir, prompts_file).to_dict()))
    assert main(["eval", str(path)]) == 2
    assert "'eval' works on LLM policies" in capsys.readouterr().err


@pytest.mark.slow
def test_two_ray_workers_train_data_parallel(tiny_dir, prompts_file, tmp_path):
    pytest.importorskip("ray")
    over = {"run.name": "ray2", "run.backend": "ray", "run.num_workers": 2, "run.save_every": 2}
    trainer = Trainer(_cfg(tmp_path, tiny_dir, prompts_file, **over))
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    rows = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert rows[-1]["batch/samples"] == 6 and rows[-1]["actor/ratio_max"] == 1.0
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert (trainer.run_dir / "checkpoints" / "step_2").is_dir()


@pytest.mark.parametrize(
    "over",
    [
        pytest.param({"diffusion.objective": "nft", "diffusion.sampler": "ode",
                      "diffusion.same_noise_per_group": False}, id="nft"),
        pytest.param({"diffusion.objective": "awm"}, id="awm"),
        pytest.param({"diffusion.sde_window": {"size": 1, "shift_interval": 1},
                      "drop": ["diffusion.timestep_fraction"]}, id="sde_window"),
    ],
)  # fmt: skip
def test_a_rollout_pool_samples_with_the_old_copy_and_window_it_receives(
    tiny_dir, prompts_file, tmp_path, over
):
    """DiffusionNFT / AWM sample with the actor's "old" copy and MixGRPO's SDE window slides with
    the actor's update count: a pool's worker, which never trains, receives both with each
    version (before: refused), and the run's numbers are the colocated run's exactly."""
    rows = {}
    for name, pool in {"colo": {}, "pool": {"placement.rollout": {}}}.items():
        cfg = _cfg(tmp_path, tiny_dir, prompts_file, **over, **pool, **{"run.name": name,
                   "run.total_steps": 3, "validation.every_steps": 0})  # fmt: skip
        trainer = Trainer(cfg)
        trainer.fit()
        trainer.shutdown()
        rows[name] = {r["step"]: r for r in read_metrics(trainer.run_dir / "metrics.jsonl")}
    for step in (1, 2, 3):
        for key in ("reward/mean", "actor/grad_norm", "actor/loss"):
            assert rows["pool"][step][key] == rows["colo"][step][key], (step, key)


def test_a_local_rollout_pool_samples_with_the_pushed_weights(tiny_dir, prompts_file, tmp_path):
    """placement.rollout on the local backend: an in-process rollout worker samples (training and
    validation) with each version pushed after the update — here through the driver, whose bytes
    are counted —, and the run's numbers are the colocated run's exactly."""
    runs = {}
    for name, over in {"colo": {}, "pool": {"placement.rollout": {}}}.items():
        trainer = Trainer(_cfg(tmp_path, tiny_dir, prompts_file, **over, **{"run.name": name}))
        trainer.fit()
        runs[name] = (trainer.policy.rollout_pool.generated(), trainer.policy.actor.generated())
        runs[name] += ({r["step"]: r for r in read_metrics(trainer.run_dir / "metrics.jsonl")},)
    (_, _, a), (pool, by_actor, b) = runs["colo"], runs["pool"]
    assert pool == [2 * 2 * 3] and by_actor == [0]  # steps × prompts × samples, all on the pool
    nbytes = sum(t.numel() * t.element_size() for t in trainer.policy.actor.full_weights().values())
    for step in (1, 2):
        assert (
            b[step]["weights/bytes_via_driver"] == nbytes
            and a[step]["weights/bytes_via_driver"] == 0
        )
        for key in ("reward/mean", "actor/grad_norm", "val/reward/mean"):
            assert b[step][key] == a[step][key], (step, key)


@pytest.mark.slow
def test_a_ray_rollout_pool_samples_and_no_weights_pass_the_driver(
    tiny_dir, teacher_dir, prompts_file, tmp_path, shared_ray
):
    """A distillation teacher (it stays in the actor's ranks) and 1 rollout worker: the pool's
    worker draws every SDE trajectory and versions reach it without the driver
    (weights/bytes_via_driver 0 at every step), and the run is the local colocated run's.
    Synchronously, 2 actor ranks broadcast each version (the collective transport): the same
    images and rewards at step 1 (initial weights on both), then equal numbers up to float
    reduction order (2 ranks vs 1); the final validation samples on the pool too. With
    max_staleness 1 (the loop in a Ray actor beside the pool, versions through Ray's object
    store), 1 actor rank: the local run's numbers exactly, stopped after step 2 and resumed."""
    base = {"teacher.path": str(teacher_dir), "run.total_steps": 3}
    pool = {"run.backend": "ray",
            "placement.rollout": {"workers_per_node": 1, "cpus_per_worker": 0.5}}  # fmt: skip
    two = {"run.num_workers": 2,
           "placement.actor": {"nodes": 1, "workers_per_node": 2, "cpus_per_worker": 0.5}}  # fmt: skip
    keys = ("reward/mean", "actor/grad_norm", "actor/distill_kl", "val/reward/mean")

    def train(name, **over):
        over = {**base, **over, "run.name": name}
        trainer = Trainer(_cfg(tmp_path, tiny_dir, prompts_file, **over))
        try:
            if over.get("run.backend") == "ray":
                assert trainer.policy.transport.name == (
                    "ray" if "rollout.max_staleness" in over else "collective"
                )
            trainer.fit()
            on_ray = over.get("run.backend") == "ray"
            return (
                trainer.policy.rollout_pool.generated() if on_ray else None,
                trainer.policy.actor.generated(),
            )
        finally:
            trainer.shutdown()

    def rows(name):
        return {r["step"]: r for r in read_metrics(tmp_path / name / "metrics.jsonl")}

    train("local0")
    assert train("pool0", **pool, **two) == ([3 * 2 * 3], [0, 0])  # steps × prompts × samples
    a, b = rows("local0"), rows("pool0")
    assert _samples(tmp_path / "pool0")[1] == _samples(tmp_path / "local0")[1]
    assert b[1]["reward/mean"] == a[1]["reward/mean"]
    for step in (1, 2, 3):
        assert b[step]["weights/bytes_via_driver"] == 0.0
        for key in keys:
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4), (step, key)

    k1 = {"rollout.max_staleness": 1}
    train("local1", **k1)
    first = train("pool1", **pool, **k1, **{"run.total_steps": 2, "run.save_every": 2})
    resumed = train("pool1", **pool, **k1)  # from the checkpoint of step 2
    assert (first, resumed) == (([2 * 2 * 3], [0]), ([1 * 2 * 3], [0]))
    a, b = rows("local1"), rows("pool1")
    assert _samples(tmp_path / "pool1") == _samples(tmp_path / "local1")
    for step in (1, 2, 3):
        assert b[step]["weights/bytes_via_driver"] == 0.0
        assert b[step]["async/staleness"] == a[step]["async/staleness"]
        for key in keys:
            assert b[step][key] == a[step][key], (step, key)


def _samples(run_dir):
    """step -> [(prompt, completion: the image's size and mean colour)] of samples.jsonl."""
    out: dict = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], []).append((row["prompt"], row["completion"]))
    return out


def test_flow_dppo_measures_the_step_kl_and_awm_starts_on_policy(tiny_dir, prompts_file, tmp_path):
    over = {"diffusion.objective": "flow_dppo", "actor.ppo_epochs": 2, "run.total_steps": 1}
    last = Trainer(_cfg(tmp_path, tiny_dir, prompts_file, **over)).fit()
    # epoch 1 is on-policy (KL 0), epoch 2 has moved: the step KL is measured, the mask applied
    assert last["actor/dppo_step_kl"] > 0 and 0 <= last["actor/dppo_masked_frac"] <= 1
    over = {"diffusion.objective": "awm", "run.total_steps": 2, "run.name": "awm"}
    t = Trainer(_cfg(tmp_path, tiny_dir, prompts_file, **over))
    t.fit()
    rows = read_metrics(t.run_dir / "metrics.jsonl")
    # the old copy holds the weights the batch was sampled with: every first ratio is exactly 1
    assert all(r["actor/ratio_min"] == 1.0 == r["actor/ratio_max"] for r in rows[1:])
