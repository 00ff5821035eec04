"""GRPO on prompts with images through the whole trainer: the shapes task with the tiny VLM
(model.tiny.vision), resume, a VLM loaded from a directory with a dataset of image files, and
the errors for image prompts given to a text-only model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import groupflow
from groupflow.config import config_from_dict
from groupflow.data import DataError
from groupflow.data.images import prompt_images
from groupflow.data.shapes import CELL, COLOURS, make_shape_rows
from groupflow.run.tracking import read_metrics
from groupflow.trainer import Trainer

VISION = {"image_size": 32, "patch_size": 8, "scale_factor": 2, "hidden_size": 16, "num_layers": 1}


def _cfg(tiny_config_data, **over):
    data = tiny_config_data(**over)
    data["model"] = {"tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2,
                              "max_positions": 32, "vision": VISION},
                     "freeze_vision": False}  # fmt: skip
    data["data"] = {"task": {"name": "shapes", "num_train": 64, "num_val": 8},
                    "min_pixels": 1024, "prompts_per_step": 4}  # fmt: skip
    data["rollout"] = {"samples_per_prompt": 4, "max_new_tokens": 2}
    return data


def _centres(row):
    img = np.asarray(prompt_images(row["prompt"])[0])
    return img[CELL // 2 :: CELL, CELL // 2 :: CELL].reshape(-1, 3)


@pytest.mark.parametrize("ask_colour", [False, True])
def test_shapes_rows_are_deterministic_disjoint_balanced_and_drawn_as_asked(ask_colour):
    train, val = make_shape_rows(400, 100, seed=3, ask_colour=ask_colour)
    again, _ = make_shape_rows(400, 100, seed=3, ask_colour=ask_colour)
    key = lambda r: (prompt_images(r["prompt"])[0].tobytes(), r["prompt"][0]["content"][1]["text"])  # noqa: E731
    assert [key(r) for r in train] == [key(r) for r in again]
    assert not {key(r) for r in train} & {key(r) for r in val}
    values, counts = np.unique([int(r["answer"]) for r in train], return_counts=True)
    assert list(values) == (list(range(6)) if ask_colour else [1, 2, 3, 4, 5])
    assert counts.min() > 50  # balanced: a policy blind to the image scores 1/5 (1/6)
    for r in train[:50]:
        question = r["prompt"][0]["content"][1]["text"]
        centres = _centres(r)
        if ask_colour:
            hits = (centres == COLOURS[question.rstrip("?")]).all(-1).sum()
        else:
            assert question == "how many?"
            hits = (centres != 255).any(-1).sum()  # every coloured square counts
        assert hits == int(r["answer"])


def test_a_tiny_vlm_trains_on_images_and_resumes_identically(tiny_config_data):
    data = _cfg(tiny_config_data, run__total_steps=4, run__save_every=2)
    data["sft"] = {"steps": 2, "batch_samples": 4}
    data["validation"] = {"before_training": True, "every_steps": 4, "samples_per_prompt": 1}
    cfg = config_from_dict(data)
    first = Trainer(cfg)
    first.fit()
    run_dir = Path(first.run_dir)
    logged = {int(r["step"]): r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0}
    assert sorted(logged) == [1, 2, 3, 4]
    assert all(math.isfinite(logged[s]["actor/loss"]) for s in logged)
    assert logged[1]["actor/ratio_max"] == pytest.approx(1.0)  # sampling == training forward
    # resume from step 2 replays steps 3-4 exactly
    ckpts = run_dir / "checkpoints"
    data["run"]["resume"] = str(ckpts / "step_2")
    data["run"]["name"] = "tiny"
    second = Trainer(config_from_dict(data))
    assert second.maybe_resume() and second.step == 2
    second.fit()
    again = {int(r["step"]): r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0}
    for step in (3, 4):
        for k in ("reward/mean", "actor/loss", "actor/grad_norm", "response_length/mean"):
            assert again[step][k] == logged[step][k], (step, k)


def test_image_prompts_for_a_text_only_model_are_a_data_error(tiny_config_data):
    data = _cfg(tiny_config_data)
    data["model"]["tiny"].pop("vision")
    with pytest.raises(DataError, match="the model is text-only"):
        _ = groupflow.Run(config_from_dict(data)).trainer


def _qwen_dir(out: Path):
    from groupflow.data.tokenizer import train_char_tokenizer
    from groupflow.models.tiny_vlm import chat_template, tiny_qwen2_vl

    tok = train_char_tokenizer()
    model, proc = tiny_qwen2_vl(tok)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    proc.image_processor.save_pretrained(out)
    (out / "chat_template.jinja").write_text(
        chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    )
    return model


def test_a_vlm_directory_trains_on_a_jsonl_dataset_of_image_files(tiny_config_data, tmp_path):
    from PIL import Image

    model_dir = tmp_path / "qwen2vl"
    model_dir.mkdir()
    _qwen_dir(model_dir)
    (tmp_path / "imgs").mkdir()
    rows = []
    for i in range(8):
        Image.new("RGB", (40 + 4 * i, 30), (30 * i, 0, 0)).save(tmp_path / "imgs" / f"{i}.png")
        rows.append({"prompt": [{"role": "user", "content": [
            {"type": "image", "image": f"imgs/{i}.png"}, {"type": "text", "text": "red?"}]}],
            "answer": str(i % 5), "data_source": "groupflow/shapes"})  # fmt: skip
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = tiny_config_data(run__total_steps=2)
    data["model"] = {"path": str(model_dir)}
    data["data"] = {"train_files": [str(path)], "prompts_per_step": 2, "min_pixels": 784,
                    "max_pixels": 112 * 112}  # fmt: skip
    data["rollout"] = {"samples_per_prompt": 2, "max_new_tokens": 3}
    data["validation"] = {"before_training": False}
    trainer = groupflow.Run(config_from_dict(data)).trainer
    trainer.fit()
    rows = read_metrics(Path(trainer.run_dir) / "metrics.jsonl")
    logged = [r for r in rows if r["step"] > 0]
    assert len(logged) == 2 and logged[-1]["actor/ratio_max"] == pytest.approx(1.0)
    assert rows[0]["data/train_rows"] == 8.0


def test_a_reward_can_ask_for_the_prompts_images(tiny_config_data, helpers_on_path):
    import vlm_reward_helpers

    data = _cfg(tiny_config_data, run__total_steps=1)
    data["reward"] = {"functions": [{"function": "vlm_reward_helpers:red_share"}]}
    data["validation"] = {"before_training": False}
    trainer = Trainer(config_from_dict(data))
    vlm_reward_helpers.SEEN.clear()
    trainer.fit()
    (logged,) = [r for r in read_metrics(Path(trainer.run_dir) / "metrics.jsonl") if r["step"] > 0]
    assert vlm_reward_helpers.SEEN and set(vlm_reward_helpers.SEEN) == {1}
    assert 0.0 <= logged["reward/mean"] < 0.5  # red pixels share of boards with 0-4 red squares
    assert logged["reward/std"] > 0.0  # differs per prompt: each sample saw its own image


def test_the_geo3k_example_maps_geometry3k_rows_to_image_prompts(tmp_path):
    """examples/geo3k_qwen2_5_vl_3b.yaml's data section on rows shaped like hiyouga/geometry3k
    (an `images` column of {bytes, path} structs, `<image>` in `problem`, `answer`)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from groupflow.assembly.data import build_data
    from groupflow.assembly.rewards import build_reward
    from groupflow.config import load_config

    buf = io.BytesIO()
    Image.new("RGB", (2000, 1000), (9, 9, 9)).save(buf, format="PNG")
    rows = [{"images": [{"bytes": buf.getvalue(), "path": None}],
             "problem": "<image>Find x. Round to the nearest tenth.", "answer": "8.5"}]  # fmt: skip
    path = tmp_path / "geo3k_train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    example = Path(__file__).resolve().parents[1] / "examples" / "geo3k_qwen2_5_vl_3b.yaml"
    cfg = load_config(example, [f"data.train_files=[{path}]", "data.val_files=[]"])
    train, _, stats = build_data(cfg, build_reward(cfg))
    (row,) = train
    content = row.prompt[0]["content"]
    assert [p["type"] for p in content] == ["image", "text"]
    assert content[1]["text"].startswith("Find x. Round to the nearest tenth. You FIRST think")
    assert content[1]["text"].endswith(r"MUST BE put in \boxed{}.")
    w, h = content[0]["image"].size
    assert w * h <= cfg.data.max_pixels and abs(w / h - 2) < 0.01  # resized, aspect kept
    assert row.fields["data_source"] == "hiyouga/geometry3k" and row.fields["answer"] == "8.5"
    reward = build_reward(cfg)
    result = reward(["p"], [r"<think>x</think> \boxed{8.5}"], answer=["8.5"])
    assert float(result.total[0]) == 1.0


def test_the_vllm_engine_refuses_the_tiny_vlm_and_names_a_vlm_directorys_processor(
    tiny_config_data, tmp_path
):
    from groupflow.assembly.engines import build_rollout_engine
    from groupflow.config import ConfigError
    from groupflow.rollout.engines.vllm_engine import VLLMUnavailableError, vllm_available

    data = _cfg(tiny_config_data)
    data["rollout"]["engine"] = "vllm"
    with pytest.raises(ConfigError, match="vLLM's multimodal inputs need one"):
        config_from_dict(data)
    # a VLM directory: vLLM's options name it as the processor's (tests/rollout/engines/test_vllm.py
    # runs the engine on images in .venv-vllm)
    (tmp_path / "vlm").mkdir()
    (tmp_path / "vlm" / "config.json").write_text(json.dumps({"vision_config": {}}))
    data = tiny_config_data()
    data["model"] = {"path": str(tmp_path / "vlm")}
    data["rollout"]["engine"] = "vllm"
    if vllm_available():
        assert build_rollout_engine(config_from_dict(data)).processor_path == str(tmp_path / "vlm")
    else:
        with pytest.raises(VLLMUnavailableError):
            build_rollout_engine(config_from_dict(data))


@pytest.mark.slow
def test_the_image_demo_learns_to_count(tmp_path, capsys):
    """examples/shapes_vlm_demo.yaml as shipped (seed 0): the README's 32.5 % -> 86.5 %."""
    from groupflow.cli.commands import main

    root = Path(__file__).resolve().parents[1]
    code = main(["train", str(root / "examples" / "shapes_vlm_demo.yaml"),
                 f"run.output_dir={tmp_path}", "run.name=demo", "run.loggers=[]"])  # fmt: skip
    assert code == 0
    rows = read_metrics(tmp_path / "demo" / "metrics.jsonl")
    accs = [r["val/greedy/acc"] for r in rows if "val/greedy/acc" in r]
    assert accs[0] <= 0.5  # the warm start stops while the policy is right only sometimes
    assert accs[-1] >= 0.8 and accs[-1] - accs[0] >= 0.4, accs
    assert "held-out greedy accuracy: before" in capsys.readouterr().out


def test_eval_and_export_of_a_tiny_vlm_run(tiny_config_data, tmp_path, capsys):
    """``groupflow eval`` scores held-out image prompts with the checkpoint; ``groupflow export``
    writes weights, tokenizer and processor that transformers loads back with the same
    log-probs."""
    import torch
    import yaml
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from groupflow.cli.commands import main
    from groupflow.models.vision import encode_image_prompt

    data = _cfg(tiny_config_data, run__total_steps=2, run__save_every=2)
    data["validation"] = {"before_training": False}
    config_file = tmp_path / "vlm.yaml"
    config_file.write_text(yaml.safe_dump(data))
    assert main(["train", str(config_file)]) == 0
    run_dir = Path(data["run"]["output_dir"]) / data["run"]["name"]
    records = tmp_path / "eval.jsonl"
    assert main(["eval", str(config_file), "--checkpoint", str(run_dir),
                 "--output", str(records)]) == 0  # fmt: skip
    lines = [json.loads(x) for x in records.read_text().splitlines()]
    assert len(lines) == 8 and all("completion" in x for x in lines)
    out = tmp_path / "hf"
    assert main(["export", str(config_file), "--checkpoint", str(run_dir), "--out", str(out)]) == 0
    model = AutoModelForImageTextToText.from_pretrained(str(out)).eval()
    proc = AutoProcessor.from_pretrained(str(out))
    trainer = Trainer(config_from_dict(data), inference_run_dir=run_dir)
    rows = trainer.workflow.val.rows
    _, ids, vis = encode_image_prompt(proc, rows[0].prompt)
    assert ids == trainer.workflow.val.ids[0]  # the exported processor encodes as training did
    from groupflow.models.logprobs import response_logprobs

    prompt = torch.tensor([ids])
    resp = torch.tensor([[proc.tokenizer.convert_tokens_to_ids("3"), proc.tokenizer.eos_token_id]])
    from groupflow.run.checkpoint import find_latest_checkpoint, load_checkpoint

    ours = trainer.policy.actor.model.eval()
    ours.load_state_dict(load_checkpoint(find_latest_checkpoint(run_dir / "checkpoints"))["model"])
    args = (prompt, torch.ones_like(prompt), resp, torch.ones_like(resp))
    with torch.no_grad():
        exported, _ = response_logprobs(model, *args, vision=[vis])
        trained, _ = response_logprobs(ours, *args, vision=[vis])
    torch.testing.assert_close(exported, trained, atol=1e-5, rtol=0)
    assert "exported HF model" in capsys.readouterr().out


def test_a_multi_turn_vlm_run_sees_observation_images_and_trains(tiny_config_data,
                                                                 helpers_on_path):  # fmt: skip
    """Image prompts, an environment that answers with a picture of a number, two GRPO steps:
    the sampling log-probs are the training forward's (ratio 1 on the first update) although
    each sample's later turns show the images of its prompt and of its observations."""
    data = _cfg(tiny_config_data, run__total_steps=2)
    data["model"]["tiny"]["max_positions"] = 96
    data["data"].update(prompts_per_step=2, max_prompt_tokens=64)
    data["rollout"].update(max_turns=2, max_new_tokens=3, max_response_tokens=40,
                           environment={"class": "agent_helpers:NumberPictureEnv"})  # fmt: skip
    data["validation"] = {"before_training": False}
    data["actor"]["recompute_old_logprobs"] = "always"  # logs rollout/logprob_diff_max
    # a short warm start on the answers (one turn each) teaches "digit, EOS": turns then end
    # and the environment answers with its picture
    data["sft"] = {"steps": 20, "batch_samples": 16, "lr": 2e-2, "check_every": 100}
    trainer = Trainer(config_from_dict(data))
    trainer.fit()
    logged = {int(r["step"]): r for r in read_metrics(Path(trainer.run_dir) / "metrics.jsonl")
              if r["step"] > 0}  # fmt: skip
    assert sorted(logged) == [1, 2]
    assert logged[1]["actor/ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert all(math.isfinite(logged[s]["actor/loss"]) for s in logged)
    # token-in/token-out with images in the prompt and the observations
    assert logged[1]["rollout/logprob_diff_max"] < 1e-4
    assert max(r["rollout/observation_tokens/mean"] for r in logged.values()) > 0


def test_image_prompts_for_a_multi_turn_text_model_are_a_data_error(tiny_config_data):
    data = _cfg(tiny_config_data)
    data["model"]["tiny"].pop("vision")
    data["rollout"].update(max_turns=2, tools=[{"name": "calculator"}])
    with pytest.raises(DataError, match="text-only"):
        _ = groupflow.Run(config_from_dict(data)).trainer
