"""lm-evaluation-harness against ``groupflow serve MODEL_DIR`` (SmolLM2-135M-Instruct, no config),
both of its API models, on two local tasks written here (no Hub: a JSONL dataset and task YAMLs in
the test's directory):

- ``local-completions`` (its tokenizer found at the server's ``/tokenize``), a generation task
  and a multiple-choice task: every choice's log-likelihood (``echo`` + ``logprobs``) equals a
  direct forward of the model, and so does the accuracy; the generations are the ones
  ``groupflow eval`` samples for the same prompts, and the exact-match score its accuracy;
- ``local-chat-completions --apply_chat_template``, the generation task as chat messages: the
  same against ``groupflow eval`` on the chat-template prompts.

The server and each harness run are subprocesses on 127.0.0.1 with one thread and timeouts."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from groupflow.cli.commands import main

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
STOP = ["\n", "."]

QA = [
    ("What is the capital of France?", "Paris"), ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Japan?", "Tokyo"), ("What is 2 + 2?", "4"),
    ("What color is the sky on a clear day?", "blue"),
    ("How many legs does a spider have?", "8"),
]  # fmt: skip
MC = [
    ("What is the capital of France?", ["Berlin", "Paris", "Madrid", "Rome"], 1),
    ("Which animal barks?", ["cat", "cow", "dog", "fish"], 2),
    ("What is frozen water called?", ["steam", "ice", "sand", "fire"], 1),
    ("How many days are in a week?", ["five", "six", "eight", "seven"], 3),
    ("Which planet do we live on?", ["Mars", "Venus", "Earth", "Saturn"], 2),
]


def _text(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def _tasks(d: Path) -> Path:
    """The dataset files and the two task YAMLs; the directory to --include_path."""
    (d / "gen.jsonl").write_text("".join(json.dumps({"q": q, "a": a}) + "\n" for q, a in QA))
    (d / "mc.jsonl").write_text(
        "".join(json.dumps({"q": q, "choices": c, "label": y}) + "\n" for q, c, y in MC)
    )
    tasks = d / "tasks"
    tasks.mkdir()
    common = {"dataset_path": "json", "test_split": "test",
              "doc_to_text": "Question: {{q}}\nAnswer:"}  # fmt: skip
    gen = {
        **common, "task": "gf_gen", "dataset_kwargs": {"data_files": {"test": str(d / "gen.jsonl")}},
        "output_type": "generate_until", "doc_to_target": "{{a}}",
        "generation_kwargs": {"until": STOP, "max_gen_toks": 8, "do_sample": False,
                              "temperature": 0.0},
        "filter_list": [{"name": "last_word", "filter": [
            {"function": "regex", "regex_pattern": r"(\w+)\W*$"}, {"function": "take_first"}]}],
        "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                         "higher_is_better": True}],
    }  # fmt: skip
    mc = {
        **common, "task": "gf_mc", "dataset_kwargs": {"data_files": {"test": str(d / "mc.jsonl")}},
        "output_type": "multiple_choice", "doc_to_choice": "choices", "doc_to_target": "label",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }  # fmt: skip
    (tasks / "gen.yaml").write_text(yaml.safe_dump(gen))
    (tasks / "mc.yaml").write_text(yaml.safe_dump(mc))
    return tasks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lm_eval(model: str, url: str, name: str, tasks: Path, out: Path, env, *extra) -> dict:
    """One harness run; (results, {task: samples by doc id})."""
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args",
           f"base_url={url},model={name}", "--tasks", ",".join(extra[0]), "--include_path",
           str(tasks), "--output_path", str(out), "--log_samples", *extra[1:]]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (results,) = out.rglob("results_*.json")
    samples = {}
    for f in out.rglob("samples_*.jsonl"):
        rows = [json.loads(line) for line in f.open()]
        samples[f.name.split("_")[1] + "_" + f.name.split("_")[2]] = {r["doc_id"]: r for r in rows}
    return json.loads(results.read_text())["results"], samples


def _groupflow_eval(path: Path, rows: list[dict], d: Path, name: str) -> list[dict]:
    """``groupflow eval`` (greedy, the task's 8 tokens and stop strings, its metric as the
    reward) on ``rows``; its per-prompt records."""
    data = d / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "run": {"name": name, "output_dir": str(d / "runs"), "loggers": [], "num_threads": 1},
        "model": {"path": str(path)},
        "data": {"train_files": [str(data)], "val_files": [str(data)], "prompts_per_step": 2},
        "rollout": {"max_new_tokens": 8, "stop": STOP},
        "validation": {"greedy": True, "samples_per_prompt": 1},
        "reward": {"functions": [{"function": "reward_helpers:last_word_match",
                                  "kwargs": {"stop": STOP}}]},
    }  # fmt: skip
    (d / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    out = d / f"{name}.records.jsonl"
    assert main(["eval", str(d / f"{name}.yaml"), "--output", str(out)]) == 0
    return [json.loads(line) for line in out.open()]


def _cut(text: str) -> str:
    cuts = [text.find(s) for s in STOP if s in text]
    return text[: min(cuts)] if cuts else text


def _direct_loglikelihoods(path: Path):
    """Each MC choice's (log-likelihood, greedy) from a direct forward, tokenized as lm-eval
    does (context, then context + continuation, the continuation the difference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    for q, choices, _ in MC:
        ctx = tok(_text(q), add_special_tokens=False)["input_ids"]
        per = []
        for c in choices:
            whole = tok(_text(q) + " " + c, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
            cont = whole[len(ctx) :]
            rows = logp[len(ctx) - 1 : len(whole) - 1]
            ll = rows.gather(-1, torch.tensor(cont)[:, None]).sum().item()
            per.append((ll, bool((rows.argmax(-1) == torch.tensor(cont)).all())))
        out.append(per)
    return out


@pytest.mark.slow
def test_lm_eval_harness_against_groupflow_serve(smollm2_path, tmp_path, helpers_on_path):
    pytest.importorskip("lm_eval", reason="needs lm-eval[api] (the test extra)")
    tasks = _tasks(tmp_path)
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    name = str(smollm2_path)
    server = subprocess.Popen(
        [sys.executable, "-m", "groupflow.cli", "serve", name, "--port", str(port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 180
        while True:
            try:
                assert httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"] == name
                break
            except httpx.TransportError:
                assert server.poll() is None, server.stdout.read()
                assert time.monotonic() < deadline, "the server did not come up in 180 s"
                time.sleep(0.5)
        results, samples = _lm_eval("local-completions", f"{base}/v1/completions", name, tasks,
                                    tmp_path / "out", env, ["gf_gen", "gf_mc"])  # fmt: skip
        chat_results, chat_samples = _lm_eval(
            "local-chat-completions", f"{base}/v1/chat/completions", name, tasks,
            tmp_path / "out_chat", env, ["gf_gen"], "--apply_chat_template",
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(30)

    # multiple choice: the harness's log-likelihoods are the model's own
    direct = _direct_loglikelihoods(smollm2_path)
    for i, per in enumerate(direct):
        got = [
            (float(ll), greedy == "True") for ll, greedy in samples["gf_mc"][i]["filtered_resps"]
        ]
        assert [g for _, g in got] == [g for _, g in per]
        assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in per], abs=2e-3)
    acc = sum(max(range(4), key=lambda j: per[j][0]) == y for per, (_, _, y) in zip(direct, MC))
    assert results["gf_mc"]["acc,none"] == pytest.approx(acc / len(MC))

    # generation: what groupflow eval samples, scored alike
    for kind, res, smp, prompt in [
        ("text", results, samples, _text),
        ("chat", chat_results, chat_samples, lambda q: [{"role": "user", "content": _text(q)}]),
    ]:
        records = _groupflow_eval(smollm2_path, [{"prompt": prompt(q), "answer": a} for q, a in QA],
                                  tmp_path, f"gen_{kind}")  # fmt: skip
        ours = {r["prompt_index"]: r for r in records}  # rows in the dataset's order
        for i, (q, _) in enumerate(QA):
            harness = smp["gf_gen"][i]["resps"][0][0]
            assert harness == _cut(ours[i]["completion"]), (kind, q)
        accuracy = sum(r["reward"] for r in records) / len(records)
        assert res["gf_gen"]["exact_match,last_word"] == pytest.approx(accuracy), kind
