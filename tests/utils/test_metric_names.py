import warnings

import pytest

from groupflow.utils.metric_names import MLFLOW, WANDB, NameMap, backend_name

AWKWARD = [
    "val/sampled/mean@4",
    "val/greedy/acc/lighteval/MATH-Hard",
    "reward/my reward (v2)/mean",
    "a//b/",
    "/lead",
    "./x/../y",
    "x:y",
    "5fold/acc",
    "ünïcode/ok",
    "",
    "a" * 300,
]


def test_translations():
    assert backend_name("val/sampled/mean@4", MLFLOW) == "val/sampled/mean_at_4"
    assert backend_name("val/sampled/mean@4", WANDB) == "val/sampled/mean_at_4"
    assert (
        backend_name("reward/lighteval/MATH-Hard/mean", MLFLOW) == "reward/lighteval/MATH-Hard/mean"
    )
    assert (
        backend_name("reward/lighteval/MATH-Hard/mean", WANDB) == "reward/lighteval/MATH_Hard/mean"
    )
    assert backend_name("reward/my reward (v2)/mean", MLFLOW) == "reward/my reward _v2_/mean"
    assert backend_name("a//b/", MLFLOW) == "a/b"
    assert backend_name("./x/../y", MLFLOW) == "_/x/_/y"
    assert backend_name("x:y", MLFLOW) == "x_y"  # ':' is refused on Windows
    assert backend_name("5fold/acc", WANDB) == "_5fold/acc"
    assert backend_name("", MLFLOW) == "_"
    assert len(backend_name("a" * 300, MLFLOW)) == 250
    assert backend_name("actor/grad_norm", MLFLOW) == "actor/grad_norm"  # most names: unchanged


def test_mlflows_own_validator_accepts_every_translation():
    pytest.importorskip("mlflow")
    from mlflow.utils.validation import _validate_metric_name, _validate_param_name

    for name in AWKWARD:
        _validate_metric_name(backend_name(name, MLFLOW))
        _validate_param_name(backend_name(name, MLFLOW))


def test_wandb_names_are_sortable_per_section():
    import re

    graphql = re.compile(r"^[_a-zA-Z][_a-zA-Z0-9]*$")
    for name in AWKWARD:
        parts = backend_name(name, WANDB).split("/")
        assert graphql.match(parts[0]) and all(re.fullmatch(r"\w+", p, re.ASCII) for p in parts)


def test_name_map_keeps_distinct_names_distinct():
    names = NameMap(MLFLOW)
    assert names("a@b") == "a_at_b"
    with pytest.warns(UserWarning, match="'a_at_b' would be logged as 'a_at_b', which another"):
        assert names("a_at_b") == "a_at_b_2"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the mapping is remembered: no second warning
        assert names.translate({"a@b": 1.0, "a_at_b": 2.0}) == {"a_at_b": 1.0, "a_at_b_2": 2.0}


def test_mlflow_names_never_make_a_metric_file_a_directory():
    """MLflow's file store keeps metric a/b in the file a/b: a/b/c would need it as a directory."""
    names = NameMap(MLFLOW)
    assert names("val/greedy/acc") == "val/greedy/acc"
    assert names("val/greedy/acc/groupflow/reverse") == "val/greedy/acc.groupflow.reverse"
    assert names("val/greedy/reward/x") == "val/greedy/reward/x"
    with pytest.warns(UserWarning, match="which another metric's name takes"):
        assert names("val/greedy/reward") == "val/greedy/reward_2"  # a directory already
    wandb = NameMap(WANDB)  # W&B keeps names flat: both as they are
    assert wandb("val/greedy/acc") == "val/greedy/acc"
    assert wandb("val/greedy/acc/groupflow/reverse") == "val/greedy/acc/groupflow/reverse"
