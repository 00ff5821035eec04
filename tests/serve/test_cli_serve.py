"""``groupflow serve``: an address other than the loopback without an API key is refused before
any model is loaded (exit 2, the fix named); a trained checkpoint is served to the official client
(a subprocess on 127.0.0.1 with one thread, bounded by timeouts); a plain model — a Hugging Face
directory, or a Hub id in the HF cache — is served without a config; a path that is neither
is exit 2 naming it; config overrides may follow the options."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from groupflow.cli.commands import _parse, build_parser, main
from groupflow.cli.serve import serving

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


def test_overrides_may_follow_the_options(capsys):
    parser = build_parser()
    args = _parse(parser, ["serve", "c.yaml", "--port", "8001", "serve.max_tokens=64",
                           "--host", "127.0.0.1", "rollout.temperature=0.5"])  # fmt: skip
    assert args.port == 8001 and args.config == "c.yaml"
    assert args.overrides == ["serve.max_tokens=64", "rollout.temperature=0.5"]
    args = _parse(parser, ["train", "c.yaml", "actor.lr=1e-3", "--no-plot", "run.seed=1"])
    assert args.overrides == ["actor.lr=1e-3", "run.seed=1"] and not args.plot
    with pytest.raises(SystemExit) as exit_:
        _parse(parser, ["serve", "c.yaml", "--port", "8001", "--bogus", "x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--bogus" in err and "key=value and may go anywhere" in err


def _model_dir(out: Path) -> Path:
    from groupflow.data import train_char_tokenizer
    from groupflow.models.causal_lm import build_tiny_llama

    tok = train_char_tokenizer("0123456789 abc", out)
    build_tiny_llama(len(tok), hidden_size=32, num_layers=1, num_heads=2, max_positions=64,
                     seed=0, pad_token_id=tok.pad_token_id,
                     eos_token_id=tok.eos_token_id).save_pretrained(out)  # fmt: skip
    return out


def _served_completion(target: str, overrides=()):
    """Build what `groupflow serve TARGET OVERRIDES` serves; one completion through it."""
    openai = pytest.importorskip("openai", reason="needs the openai package")
    from dataclasses import replace

    from groupflow.serve.app import build_app
    from groupflow.serve.build import server_core
    from groupflow.serve.thread import ServerThread

    args = _parse(build_parser(), ["serve", target, *overrides])
    cfg, policy = serving(args)
    core = server_core(cfg, policy.tokenizer, policy.rollout, replace(policy.sampling, n=1))
    server = ServerThread(build_app(core)).start()
    try:
        client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=60)
        models = [m.id for m in client.models.list().data]
        r = client.completions.create(model="anything", prompt="12", max_tokens=3, seed=0)
        return models, r, core
    finally:
        server.stop()
        core.close()
        policy.shutdown()


def test_serve_a_plain_model_directory_without_a_config(tmp_path):
    model = _model_dir(tmp_path / "m")
    models, r, core = _served_completion(str(model), ["serve.max_tokens=3"])
    assert models == [str(model)]  # the model as named on the command line
    assert 1 <= len(r.choices[0].model_extra["token_ids"]) <= 3
    assert core.limits.max_tokens == 3 and core.limits.max_context_tokens == 64  # config.json's


def test_serve_a_hub_id_from_the_hf_cache_offline(tmp_path, monkeypatch, hf_home):
    commit = "c" * 40
    repo = hf_home / "hub" / "models--tiny-org--tiny-lm"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    _model_dir(repo / "snapshots" / commit)
    monkeypatch.chdir(tmp_path)  # no local directory of that name
    models, r, core = _served_completion("tiny-org/tiny-lm")
    assert models == ["tiny-org/tiny-lm"] and r.choices[0].model_extra["token_ids"]
    assert core.limits.max_context_tokens == 64  # read from the snapshot's config.json


@pytest.mark.parametrize("kind", ["missing", "not-a-model-dir", "not-a-config", "uncached-hub-id"])
def test_serve_a_bad_path_is_exit_2_naming_it(kind, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_hf_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    target = {"missing": str(tmp_path / "no" / "such-model"), "not-a-model-dir": str(tmp_path),
              "not-a-config": str(tmp_path / "notes.txt"),
              "uncached-hub-id": "nobody/no-such-model"}[kind]  # fmt: skip
    (tmp_path / "notes.txt").write_text("hi")
    assert main(["serve", target]) == 2
    err = capsys.readouterr().err
    assert target in err and "Traceback" not in err
