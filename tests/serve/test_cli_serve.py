"""``groupflow serve``: an address other than the loopback without an API key is refused before
any model is loaded (exit 2, the fix named)."""

import yaml

from groupflow.cli import main


def test_serve_refuses_a_network_address_without_an_api_key(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GROUPFLOW_API_KEY", raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"tiny": {}}, "data": {"task": {"name": "reverse"}}}))
    assert main(["serve", str(cfg), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "needs an API key" in err and "--api-key" in err
