"""``groupflow serve``: an address other than the loopback without an API key is refused before
any model is loaded (exit 2, the fix named); a trained checkpoint is served to the official client
(a subprocess on 127.0.0.1 with one thread, bounded by timeouts)."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from groupflow.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_serve_refuses_a_network_address_without_an_api_key(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GROUPFLOW_API_KEY", raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"tiny": {}}, "data": {"task": {"name": "reverse"}}}))
    assert main(["serve", str(cfg), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "needs an API key" in err and "--api-key" in err


@pytest.mark.slow
def test_serve_a_trained_checkpoint_to_an_openai_client(tiny_base, tmp_path):
    """Train one step, then `groupflow serve CONFIG --checkpoint RUN_DIR` in a subprocess on
    127.0.0.1: the official client lists the model and gets a completion with its token ids."""
    openai = pytest.importorskip("openai", reason="needs the openai package")
    from groupflow.config import config_from_dict
    from groupflow.trainer import Trainer

    base, with_overrides = tiny_base
    data = with_overrides(base(tmp_path), {"run.total_steps": 1, "run.name": "served",
                                           "validation.before_training": False})  # fmt: skip
    Trainer(config_from_dict(data)).fit()
    cfg = tmp_path / "served.yaml"
    cfg.write_text(yaml.safe_dump(data))
    with socket.socket() as s:  # a free port for the server
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "groupflow.cli", "serve", str(cfg), "--checkpoint",
         str(tmp_path / "served"), "--port", str(port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0, timeout=30)  # fmt: skip
        deadline = time.monotonic() + 180
        while True:
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "the server did not come up in 180 s"
                time.sleep(0.5)
        assert [m.id for m in models.data] == ["served"]
        r = client.completions.create(model="served", prompt="1234", max_tokens=5, seed=0)
        assert 1 <= len(r.choices[0].model_extra["token_ids"]) <= 5
    finally:
        proc.terminate()
        proc.wait(30)
