"""Every built-in reward, named in a config, through a one-step ``groupflow train``: the load-time
field check, the fields the workflow hands the runner and the scoring must all agree, so a
built-in that cannot be used (``length_penalty`` and ``overlong_penalty`` were refused for lacking
``completion_lengths``) fails here. The image rewards run through a diffusion run in
tests/diffusion/test_rewards.py; the last test checks that together they cover every name.
"""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from groupflow.cli.commands import main
from groupflow.rewards import reward_names

# name -> the config entry (kwargs chosen so the value can be checked by hand where noted)
SINGLE_TURN = {
    "gsm8k": {"name": "gsm8k"},
    "math_boxed": {"name": "math_boxed"},
    "format_tags": {"name": "format_tags"},
    "length_penalty": {"name": "length_penalty", "kwargs": {"penalty_per_token": 1.0}},
    "overlong_penalty": {
        "name": "overlong_penalty",
        "kwargs": {"max_tokens": 7, "buffer_tokens": 2},
    },
    "code_tests": {"name": "code_tests", "kwargs": {"timeout_s": 5.0}},
    "instructions": {"name": "instructions"},
    "ifeval": {"name": "ifeval"},
}
MULTI_TURN = {
    "env_reward": {"name": "env_reward"},
    "tool_use": {"name": "tool_use"},
    "length_penalty": SINGLE_TURN["length_penalty"],
    "overlong_penalty": SINGLE_TURN["overlong_penalty"],
}
# diffusion/test_rewards; ocr: diffusion/test_ocr (RapidOCR reading rendered text, its failures)
IMAGE = ("target_color", "brightness", "compressibility", "image_scorer", "ocr")


def _train(tmp_path, tiny_config_data, rewards: dict, **overrides) -> dict:
    """One CLI step with ``rewards``; the step's metrics (the run must succeed)."""
    data = tiny_config_data(run__total_steps=1, validation__every_steps=0, **overrides)
    data["reward"] = {"functions": [{**spec, "label": name} for name, spec in rewards.items()]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["train", str(path), "--no-plot"]) == 0
    lines = (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


def _used_cleanly(metrics: dict, names) -> None:
    for name in names:
        assert math.isfinite(metrics[f"reward/{name}/mean"]), name
        assert metrics[f"reward/{name}/failures"] == 0.0, name


def _length_rewards_match_the_responses(metrics: dict) -> None:
    # -1 per model token (response_length/mean counts the same response_mask tokens)
    assert metrics["reward/length_penalty/mean"] == pytest.approx(
        -metrics["response_length/mean"], abs=1e-5
    )
    assert -1.0 <= metrics["reward/overlong_penalty/mean"] <= 0.0


@pytest.fixture
def judge_url():
    """A stub OpenAI-compatible judge on 127.0.0.1 that gives every response a score of 1,
    after the verdict marker the request asks for."""
    import re

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            request = self.rfile.read(int(self.headers["Content-Length"])).decode()
            marker = re.search(r"VERDICT-[0-9A-F]{6}", request).group(0)
            content = f"{marker} Score: 1"
            reply = {"choices": [{"message": {"role": "assistant", "content": content}}]}
            body = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_every_single_turn_builtin_in_one_run(tmp_path, tiny_config_data, judge_url):
    rows = [
        {
            "prompt": f"add {i} and {i + 1}",
            "ground_truth": str(2 * i + 1),
            "tests": [f"assert add({i}, 1) == {i + 1}"],
            "constraints": [{"kind": "keyword", "arg": "sum"}],
            "topic": "adding numbers",
            "instruction_id_list": ["punctuation:no_comma"],  # the ifeval reward's row format
            "kwargs": [{}],
        }
        for i in range(8)
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    judge = {"name": "judge", "kwargs": {"base_url": judge_url, "model": "stub",
                                         "rubric": "Score the answer from 0 to 1."}}  # fmt: skip
    rewards = {**SINGLE_TURN, "judge": judge}
    metrics = _train(
        tmp_path, tiny_config_data, rewards, data__task=None,
        data__train_files=[str(data)], data__val_files=[str(data)],
    )  # fmt: skip
    _used_cleanly(metrics, rewards)
    assert metrics["reward/judge/mean"] == 1.0
    _length_rewards_match_the_responses(metrics)


def test_every_multi_turn_builtin_in_one_run(tmp_path, tiny_config_data):
    calc = dict(
        data__task={"name": "calc", "digits": 2, "num_train": 40, "num_val": 4},
        model__tiny={"hidden_size": 32, "num_layers": 2, "num_heads": 2, "max_positions": 80},
        rollout__max_turns=2, rollout__max_new_tokens=12, rollout__max_response_tokens=30,
        rollout__stop=["</calc>"], rollout__tools=[{"name": "calculator", "label": "calc"}],
        rollout__tool_parser="tag", rollout__observation_template="={content}\n",
    )  # fmt: skip
    metrics = _train(tmp_path, tiny_config_data, MULTI_TURN, **calc)
    _used_cleanly(metrics, MULTI_TURN)
    _length_rewards_match_the_responses(metrics)  # the model's tokens, not the tool's


def test_the_end_to_end_tests_cover_every_builtin():
    judge = {"judge"}  # in the single-turn run, against a stub endpoint
    assert set(reward_names()) == set(SINGLE_TURN) | judge | set(MULTI_TURN) | set(IMAGE)
