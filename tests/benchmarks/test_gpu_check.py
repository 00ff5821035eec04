"""The GPU check (scripts/gpu_check.sh, benchmarks/gpu_check.py) cannot rot between GPU runs: its
dry run (CPU, tiny shapes, every part) runs end to end here, through the shell script, and the JSON
it writes is checked part by part. Its helpers are checked on their own: the reward that gives a
random policy's samples advantages, the tokenizer padded to a real vocabulary, and the recording
of a part that fails or does not fit the time budget."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Every test marked gpu in these files: the dry run's `pytest -m gpu` must see them all skip.
GPU_TEST_FILES = {
    "tests/distributed/test_parallel.py": 1,
    "tests/models/test_packing.py": 2,
    "tests/rollout/engines/test_static_cache.py": 2,
    "tests/run/test_checkpoint.py": 1,
    "tests/test_trainer.py": 1,
}


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_check():
    return _module()


@pytest.mark.slow  # ~30 s: every part, the diffusers import and a pytest subprocess included
def test_the_dry_run_runs_every_part_and_writes_the_report(tmp_path, gpu_check):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"),
        "GPU_CHECK_TIMEOUT_S": "300",
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_check.json",
        "gpu_check.log",
        "gpu_check.txt",
    ]
    report = json.loads((out / "gpu_check.json").read_text())
    parts = report["parts"]
    assert report["dry_run"] is True and report["device"] == "cpu"
    # what the GPU machine lacks was unimportable here too, and no part needed it
    assert report["blocked_imports"] == list(gpu_check.ABSENT_ON_GPU)
    assert list(parts) == list(gpu_check.PARTS)
    assert {n: p["status"] for n, p in parts.items() if p["status"] != "ok"}.keys() <= {
        "lm_vs_trl",
        "weight_transfer",
    }, {n: p.get("error") for n, p in parts.items()}

    env_part = parts["environment"]
    assert env_part["cuda_available"] is False
    assert env_part["packages"]["pydantic"][0].isdigit()  # a version, not "missing: ..."
    assert env_part["packages"]["ray"].startswith("missing: ModuleNotFoundError")
    assert env_part["install"] == {"wheels": "not installed (dry run)"}
    assert env_part["groupflow_from"] == str(ROOT / "groupflow")

    lm = parts["lm_groupflow"]
    s = report["shapes"]
    assert lm["dtype"] == "torch.bfloat16" and lm["device"] == "cpu"
    assert len(lm["step_s"]) == s["steps"] and lm["median_step_s"] > 0
    assert lm["generate_tokens_per_s"] > 0
    assert lm["zero_adv_skipped"] == 0.0  # the hash reward gives every sample an advantage
    assert lm["last_metrics"]["actor/grad_norm"] > 0
    assert lm["peak_mib"] is None  # no CUDA: no GPU memory figure, not a made-up one

    trl = parts["lm_vs_trl"]
    if trl["status"] == "skipped":  # TRL is a benchmark-only dependency
        assert "TRL does not import" in trl["reason"]
    else:
        assert set(trl["median_step_s"]) == {"trl", "groupflow"}
        ratio = trl["median_step_s"]["trl"] / trl["median_step_s"]["groupflow"]
        assert trl["speedup_vs_trl"] == pytest.approx(ratio)
        assert all(len(v) == s["steps"] for v in trl["step_s"].values())

    kinds = [("wan", s["wan_latent"]), ("sd3", s["sd3_latent"]),
             *((k, f["latent"]) for k, f in s["families"].items())]  # fmt: skip
    assert [k for k, _ in kinds] == ["wan", "sd3", "flux", "qwen_image", "z_image", "flux2"]
    for kind, latent in kinds:
        d = parts["diffusion"][kind]
        assert d["latent_shape"] == latent
        assert d["grpo_step"]["step_s"] > 0 and d["grpo_step"]["grad_norm"] > 0
        assert d["bf16_denoising_step"]["velocity_dtype"] == "torch.bfloat16"
        assert d["bf16_denoising_step"]["grad_norm"] > 0

    demo = parts["demo"]
    assert demo["steps"] == 2 and demo["device"] == "cpu"
    assert 0 <= demo["val_greedy_acc_before"] <= 1 and 0 <= demo["val_greedy_acc_after"] <= 1

    transfer = parts["weight_transfer"]
    assert transfer["status"] == "ok" and transfer["bytes"] > 0, transfer
    assert set(transfer["transports"]) == {"driver", "filesystem"}
    assert all(t["seconds"] > 0 for t in transfer["transports"].values())

    tests = parts["gpu_tests"]
    assert tests["files"] == sorted(GPU_TEST_FILES)
    assert tests["returncode"] == 0
    assert tests["counts"]["skipped"] == sum(GPU_TEST_FILES.values())  # all marked, all skipped
    assert "needs a CUDA GPU" in tests["output_tail"]

    text = (out / "gpu_check.txt").read_text()
    assert text.startswith("groupflow GPU check (DRY RUN")
    assert "[demo] ok" in text and "held-out greedy accuracy" in text
    assert "gpu_check.sh: dry run: nothing installed" in (out / "gpu_check.log").read_text()


def test_the_hash_reward_is_a_fixed_function_of_the_text_in_0_1(gpu_check):
    texts = ["123", "321", "", "ĀāĂ", "123"]
    rewards = gpu_check.text_hash_reward(["p"] * 5, texts)
    assert rewards == gpu_check.text_hash_reward(["q"] * 5, texts)  # the prompt plays no part
    assert all(0 <= r < 1 for r in rewards)
    assert rewards[0] == rewards[4] != rewards[1]
    assert rewards[2] == 0.0  # crc32 of the empty string
    chat = [[{"role": "assistant", "content": "123"}]]
    assert gpu_check.text_hash_reward(["p"], chat) == rewards[:1]


def test_the_padded_tokenizer_decodes_every_id_of_the_vocabulary(gpu_check, tmp_path):
    tok = gpu_check.padded_char_tokenizer(300, tmp_path)
    assert len(tok) == 300
    text = tok.decode(list(range(4, 300)))  # past the 4 special tokens: one character per id
    assert len(text) == 296 and tok.encode(text, add_special_tokens=False) == list(range(4, 300))
    assert tok.decode(tok.encode("3021 cba", add_special_tokens=False)) == "3021 cba"
    with pytest.raises(ValueError, match="smaller than the character tokenizer"):
        gpu_check.padded_char_tokenizer(10, tmp_path)


def _ctx(gpu_check, tmp_path, deadline_in_s: float):
    import time

    import torch

    return gpu_check.Context(
        dry_run=True,
        shapes=gpu_check.DRY,
        device=torch.device("cpu"),
        work=tmp_path,
        deadline=time.monotonic() + deadline_in_s,
        gpu_tests=(),
        install_log=None,
    )


def test_a_failing_part_is_recorded_with_its_traceback(gpu_check, tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("CUDA error: out of memory")

    def wrong(ctx):
        raise gpu_check.CheckFailed("the demo did not learn")

    monkeypatch.setitem(gpu_check.PART_FUNCTIONS, "demo", broken)
    monkeypatch.setitem(gpu_check.PART_FUNCTIONS, "lm_groupflow", wrong)
    ctx = _ctx(gpu_check, tmp_path, 100)
    failed = gpu_check.run_part("demo", ctx)
    assert failed["status"] == "failed"
    assert failed["error"] == "RuntimeError: CUDA error: out of memory"
    assert "in broken" in failed["traceback"] and failed["seconds"] >= 0
    checked = gpu_check.run_part("lm_groupflow", ctx)
    assert checked["status"] == "check_failed" and checked["error"] == "the demo did not learn"
    report = {
        "dry_run": True,
        "device": "cpu",
        "total_s": 1.0,
        "parts": {"demo": failed, "lm_groupflow": checked},
    }
    text = gpu_check.format_report(report)
    assert "[demo] failed" in text and "CUDA error: out of memory" in text
    assert "[lm_groupflow] check_failed" in text


def test_a_part_that_does_not_fit_the_budget_is_skipped(gpu_check, tmp_path, monkeypatch):
    ran = []
    monkeypatch.setitem(gpu_check.PART_FUNCTIONS, "demo", lambda ctx: ran.append(1) or {})
    shapes = gpu_check.DRY.__class__(**{**gpu_check.DRY.__dict__, "estimates_s": {"demo": 60}})
    ctx = _ctx(gpu_check, tmp_path, 30)
    ctx.shapes = shapes
    result = gpu_check.run_part("demo", ctx)
    assert result["status"] == "skipped" and "~60 s needed" in result["reason"] and not ran
    ctx.deadline += 60
    assert gpu_check.run_part("demo", ctx)["status"] == "ok" and ran == [1]


def test_without_a_gpu_the_full_check_records_the_environment_and_stops(
    gpu_check, tmp_path, monkeypatch
):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    log = tmp_path / "install.tsv"
    log.write_text("pydantic-2.whl\tinstalled\npydantic_core-2.whl\tFAILED: not supported\n")
    assert gpu_check.main(["--out", str(tmp_path), "--install-log", str(log)]) == 2
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["error"] == "no CUDA device" and list(report["parts"]) == ["environment"]
    assert report["parts"]["environment"]["install"] == {
        "pydantic-2.whl": "installed",
        "pydantic_core-2.whl": "FAILED: not supported",
    }
    text = (tmp_path / "gpu_check.txt").read_text()
    assert "ERROR: no CUDA device" in text and "did not install: pydantic_core-2.whl" in text


def test_the_real_size_diffusion_models_build_and_take_their_latents(gpu_check):
    """The GPU's real-width transformers (built on the meta device: no memory) are the classes
    groupflow loads for each kind, and each takes its latent, so a GPU run cannot spend its
    minutes on a config that fails."""
    import diffusers
    import torch

    from groupflow.diffusion.models import DIFFUSERS_KINDS, check_latent_fits

    for kind, config, latent in gpu_check.flow_models(gpu_check.GPU):
        with torch.device("meta"):
            model = getattr(diffusers, DIFFUSERS_KINDS[kind])(**config)
        check_latent_fits(model.config, kind, latent)
        params = sum(p.numel() for p in model.parameters())
        assert 5e7 < params < 4e9, (kind, params)  # real widths, few blocks: fits one GPU
