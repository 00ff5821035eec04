"""Hub ids for models and datasets, resolved through a Hugging Face cache that the test builds.

Nothing can be downloaded here, so each test writes the huggingface_hub cache layout
(``models--owner--name/refs/<branch>`` holding a commit hash, ``snapshots/<hash>/...``) under a
temporary ``HF_HOME`` and runs with ``HF_HUB_OFFLINE=1``: the real resolution code
(``snapshot_download``) and the real dataset loader (``datasets.load_dataset`` on the snapshot,
configs from its README as on the Hub) run unchanged.
"""

from __future__ import annotations

import json

import pytest

import groupflow
from groupflow.assembly.data import build_data
from groupflow.assembly.models import resolve_hub_models
from groupflow.config import ConfigError, config_from_dict
from groupflow.data import DataError, make_task_rows
from groupflow.utils.hub import (
    HubError,
    hub_cache_dir,
    is_hub_id,
    parse_hub_dataset,
    resolve_model_path,
)

MAIN = "a" * 40
V2 = "b" * 40


def _snapshot(home, repo_id, commit, refs=("main",), repo_type="models"):
    repo = home / "hub" / f"{repo_type}--{repo_id.replace('/', '--')}"
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    return snap


def _tiny_model(out, seed=0):
    from groupflow.data import train_char_tokenizer
    from groupflow.models.causal_lm import build_tiny_llama

    tok = train_char_tokenizer("reverse 0123456789=", out)
    model = build_tiny_llama(len(tok), hidden_size=32, num_layers=1, num_heads=2, seed=seed,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    model.save_pretrained(out)
    return model


def test_cache_dir_and_offline_mode_follow_the_environment_at_call_time(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "h"))
    assert hub_cache_dir() == tmp_path / "h" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub_cache_dir() == tmp_path / "c"


def test_a_local_directory_always_wins_over_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("owner/model")
    (tmp_path / "owner" / "model").mkdir(parents=True)
    assert not is_hub_id("owner/model")
    assert resolve_model_path("owner/model", None, "model.path") == "owner/model"
    assert not is_hub_id("/abs/path") and not is_hub_id("./rel/x") and not is_hub_id("a/b/c")


def test_a_cached_model_id_resolves_offline_by_branch_and_by_revision(hf_home):
    main = _snapshot(hf_home, "acme/tiny", MAIN)
    v2 = _snapshot(hf_home, "acme/tiny", V2, refs=("v2",))
    assert resolve_model_path("acme/tiny", None, "model.path") == str(main)
    assert resolve_model_path("acme/tiny", "v2", "model.path") == str(v2)
    assert resolve_model_path("acme/tiny", V2, "model.path") == str(v2)


def test_an_id_neither_cached_nor_reachable_is_a_clear_error(hf_home):
    with pytest.raises(HubError) as err:
        resolve_model_path("acme/missing", None, "critic.path")
    msg = str(err.value)
    assert msg.startswith("critic.path: 'acme/missing' is neither a local directory nor in")
    assert str(hf_home / "hub") in msg and "HF_HUB_OFFLINE=1" in msg
    assert "hf download acme/missing" in msg


def test_an_unreachable_hub_is_named_when_offline_mode_is_off(hf_home, monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(c, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    with pytest.raises(HubError, match=r"model.path: 'acme/missing'.*the Hub could not be reached"):
        resolve_model_path("acme/missing", None, "model.path")


def test_config_model_paths_resolve_to_snapshots_and_the_config_keeps_the_ids(
    hf_home, tiny_config_data
):
    snap = _snapshot(hf_home, "acme/tiny", MAIN)
    _tiny_model(snap)
    data = tiny_config_data(run__total_steps=1)
    data["model"] = {"path": "acme/tiny"}
    cfg = config_from_dict(data)
    built = resolve_hub_models(cfg)
    assert built.model.path == str(snap) and cfg.model.path == "acme/tiny"
    trainer = groupflow.Run(cfg).trainer  # loads the model and tokenizer from the snapshot
    assert trainer.cfg.model.path == "acme/tiny"
    trainer.fit()
    saved = json.loads((trainer.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert saved["data/train_rows"] == 200.0


def test_an_uncached_model_id_fails_the_run_at_start_naming_the_key(hf_home, tiny_config_data):
    data = tiny_config_data()
    data["model"] = {"path": "acme/absent", "revision": "v9"}
    with pytest.raises(HubError, match=r"model.path: 'acme/absent' at revision 'v9' is neither"):
        groupflow.Run(data)


# ----- datasets ----------------------------------------------------------------------------------

README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
# a GSM8K-shaped dataset
"""


def _reverse_dataset(home, n_train=12, n_test=4):
    """A Hub dataset with GSM8K's shape: config 'main', columns question/answer, parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    snap = _snapshot(home, "acme/reverse", MAIN, repo_type="datasets")
    (snap / "README.md").write_text(README)
    (snap / "main").mkdir()
    train, test = make_task_rows("reverse", n_train, n_test, seed=9, digits=4)
    for split, rows in (("train", train), ("test", test)):
        table = pa.Table.from_pylist(
            [{"question": r["prompt"].removesuffix(" ="), "answer": r["answer"]} for r in rows]
        )
        pq.write_table(table, snap / "main" / f"{split}-00000-of-00001.parquet")
    return train, test


def _data_config(tiny_config_data, **data):
    cfg = tiny_config_data()
    cfg["data"] = {"prompts_per_step": 4, **data}
    return config_from_dict(cfg)


def test_hf_ids_and_mappings_load_a_cached_dataset_with_columns_and_a_template(
    hf_home, tiny_config_data
):
    train, test = _reverse_dataset(hf_home)
    cfg = _data_config(
        tiny_config_data,
        train_files=["hf://acme/reverse?config=main"],
        val_files=[{"name": "acme/reverse", "config": "main"}],  # split: test by default
        columns={"reference": "answer"},
        prompt_template="{question} =",
    )
    train_rows, val_rows, stats = build_data(cfg)
    assert [r.prompt for r in train_rows] == [r["prompt"] for r in train]
    assert [r.prompt for r in val_rows] == [r["prompt"] for r in test]
    first = train_rows[0]
    assert first.fields == {
        "question": train[0]["prompt"].removesuffix(" ="),
        "reference": train[0]["answer"],
        "data_source": "acme/reverse",  # a Hub dataset's default, as verl writes it
    }
    assert first.source == "hf://acme/reverse/main[train]"
    assert stats["data/train_rows"] == 12.0 and stats["data/val_rows"] == 4.0


def test_a_hub_dataset_trains_through_the_python_api(hf_home, tiny_config_data):
    _reverse_dataset(hf_home)
    cfg = _data_config(
        tiny_config_data,
        train_files=["hf://acme/reverse?config=main&split=train"],
        val_files=["hf://acme/reverse?config=main&split=test"],
        columns={"prompt": "question"},
        data_source="groupflow/reverse",
    ).to_dict()
    cfg["run"]["total_steps"] = 1

    def exact(completions, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    run = groupflow.Run(cfg, rewards=[exact])
    assert run.trainer.workflow.train_rows[0].fields["data_source"] == "groupflow/reverse"
    assert "reward/exact/mean" in run.fit()


def test_an_unknown_split_or_config_names_the_key(hf_home, tiny_config_data):
    _reverse_dataset(hf_home)
    cfg = _data_config(tiny_config_data, train_files=["hf://acme/reverse?config=main&split=dev"])
    with pytest.raises(HubError, match=r"data.train_files\[0\]: hf://acme/reverse/main\[dev\]"):
        build_data(cfg)
    cfg = _data_config(
        tiny_config_data, train_files=[{"name": "acme/reverse", "config": "socratic"}]
    )
    with pytest.raises(HubError, match=r"data.train_files\[0\]: hf://acme/reverse/socratic"):
        build_data(cfg)


def test_an_uncached_dataset_is_a_clear_error(hf_home, tiny_config_data):
    cfg = _data_config(tiny_config_data, train_files=["hf://acme/nothing"])
    with pytest.raises(HubError, match=r"data.train_files\[0\]: 'acme/nothing' is neither"):
        build_data(cfg)


def test_a_row_lacking_a_mapped_column_is_named_by_source_row_and_column(hf_home, tiny_config_data):
    _reverse_dataset(hf_home)
    cfg = _data_config(
        tiny_config_data, train_files=["hf://acme/reverse?config=main"], columns={"prompt": "text"}
    )
    with pytest.raises(DataError, match=r"hf://acme/reverse/main\[train\], row 0, field 'text'"):
        build_data(cfg)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("hf://acme", "is not a Hub dataset id"),
        ("hf://acme/x?splt=train", "unknown query key 'splt'"),
    ],
)
def test_malformed_hf_ids_are_reported(spec, message):
    with pytest.raises(HubError, match=message):
        parse_hub_dataset(spec, "train", "data.train_files[0]")


def test_config_rejects_bad_dataset_mappings_and_templates(tiny_config_data):
    with pytest.raises(ConfigError, match=r"data.train_files.0.*'owner/name'"):
        _data_config(tiny_config_data, train_files=[{"name": "gsm8k"}])
    with pytest.raises(ConfigError, match="named fields like"):
        _data_config(tiny_config_data, train_files=["x.jsonl"], prompt_template="{} =")
    with pytest.raises(ConfigError, match="the built-in data.task has its own"):
        _data_config(tiny_config_data, task={"name": "reverse"}, columns={"prompt": "q"})
