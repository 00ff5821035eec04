import sys
import textwrap

import pytest

from groupflow.rewards import (
    RewardConfigError,
    RewardRunner,
    UnknownDataSourceError,
    UnknownRewardError,
    build_reward_runner,
    get_reward,
    register_data_source,
    register_reward,
    registered_data_sources,
    resolve_import_path,
    reward_names,
)
from groupflow.rewards import registry as reg


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user package `my_rewards_pkg.scoring` importable for this test only."""
    package = tmp_path / "my_rewards_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scoring.py").write_text(
        textwrap.dedent(
            """
            def exact(completions, answer, scale=1.0):
                return [scale * float(c == a) for c, a in zip(completions, answer)]

            class Judges:
                @staticmethod
                def length(completions):
                    return [float(len(c)) for c in completions]

            THRESHOLD = 3
            """
        )
    )
    (package / "broken.py").write_text("import not_a_real_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_pkg"
    for name in [m for m in sys.modules if m.split(".")[0] == "my_rewards_pkg"]:
        del sys.modules[name]


@pytest.fixture
def isolated_registry(monkeypatch):
    monkeypatch.setattr(reg, "_BUILTINS", dict(reg._BUILTINS))
    monkeypatch.setattr(reg, "_DATA_SOURCES", dict(reg._DATA_SOURCES))


def test_builtin_names_and_defaults():
    assert reward_names() == [
        "brightness",  # the image/video rewards (groupflow.diffusion.rewards) are built-ins too
        "code_tests",
        "compressibility",
        "env_reward",  # multi-turn trajectories (groupflow.rewards.trajectory)
        "format_tags",
        "gsm8k",
        "ifeval",  # IFEval-format rows, the official checkers (the ifeval_style task)
        "image_scorer",
        "instructions",  # the built-in instructions task (groupflow.rewards.instructions)
        "judge",  # an LLM judge behind an OpenAI-compatible endpoint (groupflow.rewards.judge)
        "length_penalty",
        "math_boxed",
        "ocr",  # text read off a generated image vs the prompt's target (groupflow.diffusion.ocr)
        "overlong_penalty",
        "target_color",
        "tool_use",
    ]
    sources = registered_data_sources()
    assert sources["openai/gsm8k"] == "gsm8k"
    assert sources["groupflow/instructions"] == "instructions"
    assert sources["groupflow/ifeval_style"] == "ifeval"
    for source in (
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
    ):
        assert sources[source] == "math_boxed"
    for source in ("codecontests", "apps", "codeforces", "taco"):  # verl's prime_code sources
        assert sources[source] == "code_tests"


def test_build_from_specs():
    runner = build_reward_runner(
        [
            {"name": "gsm8k", "weight": 1.0, "kwargs": {"mode": "flexible"}},
            {"name": "format_tags", "weight": 0.5},
            {"name": "overlong_penalty", "kwargs": {"max_tokens": 10, "buffer_tokens": 5}},
        ],
        failure_value=-1.0,
    )
    assert isinstance(runner, RewardRunner) and not runner.dispatch_by_data_source
    assert [s.name for s in runner.specs] == ["gsm8k", "format_tags", "overlong_penalty"]
    assert runner.failure_value == -1.0
    result = runner(
        ["q", "q"],
        ["<think>t</think><answer>it is 7</answer>", "maybe 8"],
        ground_truth=["7", "7"],
        completion_lengths=[4, 10],
    )
    # sample 0: 1 + 0.5*1 + 0; sample 1: 0 + 0 + (-1)
    assert result.total.tolist() == [1.5, -1.0]


def test_none_or_empty_specs_dispatch_by_data_source():
    assert build_reward_runner(None).dispatch_by_data_source
    assert build_reward_runner([]).dispatch_by_data_source


def test_same_builtin_twice_needs_labels():
    with pytest.raises(RewardConfigError, match="\\['gsm8k'\\] appear more than once.*label"):
        build_reward_runner([{"name": "gsm8k"}, {"name": "gsm8k"}])
    runner = build_reward_runner(
        [
            {"name": "gsm8k"},
            {"name": "gsm8k", "label": "gsm8k_flex", "kwargs": {"mode": "flexible"}},
        ]
    )
    result = runner(["q"], ["it is 3"], ground_truth=["3"])
    assert result.components["gsm8k"].tolist() == [0.0]
    assert result.components["gsm8k_flex"].tolist() == [1.0]


@pytest.mark.parametrize(
    ("specs", "error", "message"),
    [
        ([{"name": "gsm8"}], UnknownRewardError, "did you mean 'gsm8k'"),
        (
            [{"name": "gsm9k"}],
            UnknownRewardError,
            "valid names: \\['brightness', 'code_tests', 'compressibility', 'env_reward', 'format_tags'",
        ),
        ([{"name": "gsm8k", "weigth": 2}], RewardConfigError, "unknown key 'weigth'.*'weight'"),
        ([{"name": "gsm8k", "kwargs": {"mod": "x"}}], RewardConfigError, "no option 'mod'.*'mode'"),
        ([{"name": "gsm8k", "kwargs": {"mode": "x"}}], RewardConfigError, "unknown mode 'x'"),
        (
            [{"name": "overlong_penalty"}],
            RewardConfigError,
            "requires option\\(s\\) \\['max_tokens'",
        ),
        ([{"weight": 1.0}], RewardConfigError, "needs 'name'.*or 'function'"),
        (
            [{"name": "gsm8k", "weight": "high"}],
            RewardConfigError,
            "weight must be a finite number",
        ),
        (["gsm8k"], RewardConfigError, "must be a mapping"),
        ({"name": "gsm8k"}, RewardConfigError, "must be a list of mappings"),
    ],
)
def test_bad_specs(specs, error, message):
    with pytest.raises(error, match=message) as info:
        build_reward_runner(specs)
    if isinstance(specs, list):
        assert str(info.value).startswith("rewards[0]")


def test_import_path_function_with_kwargs_and_label(user_module):
    runner = build_reward_runner(
        [
            {"function": f"{user_module}.scoring:exact", "kwargs": {"scale": 2.0}},
            {"function": f"{user_module}.scoring:Judges.length", "weight": 0.1},
            {"function": f"{user_module}.scoring:exact", "label": "exact_raw"},
        ]
    )
    assert [s.name for s in runner.specs] == ["exact", "length", "exact_raw"]
    result = runner(["q", "q"], ["ab", "c"], answer=["ab", "x"])
    assert result.components["exact"].tolist() == [2.0, 0.0]
    assert result.total.tolist() == pytest.approx([2.0 + 0.2 + 1.0, 0.1])


def test_import_path_function_missing_field_checked_at_call(user_module):
    runner = build_reward_runner([{"function": f"{user_module}.scoring:exact"}])
    with pytest.raises(RewardConfigError, match="'exact'.*requires field 'answer'.*available"):
        runner(["q"], ["a"], ground_truth=["a"])


def test_import_path_function_bad_kwargs(user_module):
    with pytest.raises(RewardConfigError, match="does not accept option\\(s\\) \\['scael'\\]"):
        build_reward_runner([{"function": f"{user_module}.scoring:exact", "kwargs": {"scael": 2}}])


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("my_rewards_pkg.scoring.exact", "must look like 'package.module:function'"),
        ("my_rewards_pkg.scoring:", "must look like"),
        ("no_such_pkg_xyz.mod:fn", "cannot import module 'no_such_pkg_xyz.mod'.*PYTHONPATH"),
        ("my_rewards_pkg.nope:fn", "cannot import module 'my_rewards_pkg.nope'"),
        (
            "my_rewards_pkg.broken:fn",
            "importing module 'my_rewards_pkg.broken'.*failed.*not_a_real",
        ),
        (
            "my_rewards_pkg.scoring:exactt",
            "'my_rewards_pkg.scoring' has no attribute 'exactt'.*did you mean 'exact'",
        ),
        (
            "my_rewards_pkg.scoring:Judges.size",
            "'my_rewards_pkg.scoring.Judges' has no attribute 'size'",
        ),
        ("my_rewards_pkg.scoring:THRESHOLD", "is a int, not a callable"),
    ],
)
def test_import_path_errors(user_module, path, message):
    with pytest.raises(RewardConfigError, match=message):
        resolve_import_path(path)


def test_a_reward_function_may_live_in_a_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def shout(completions, **kw):\n    return [float(c.isupper()) for c in completions]\n"
    )
    fn = resolve_import_path(f"{path}:shout")
    assert fn(completions=["YES", "no"]) == [1.0, 0.0]
    with pytest.raises(RewardConfigError, match="file '.*missing.py' does not exist"):
        resolve_import_path(f"{tmp_path / 'missing.py'}:shout")


def test_get_reward_and_register_reward(isolated_registry):
    assert get_reward("gsm8k")(completions=["#### 2"], ground_truth=["2"]) == [1.0]

    def make_constant(value=1.0):
        return lambda completions: [value] * len(completions)

    register_reward("constant", make_constant)
    runner = build_reward_runner([{"name": "constant", "kwargs": {"value": 0.3}}])
    assert runner(["q"], ["a"]).total.tolist() == pytest.approx([0.3])
    with pytest.raises(RewardConfigError, match="already registered"):
        register_reward("constant", make_constant)


def test_register_data_source(isolated_registry, user_module):
    def echo(completions):
        return [0.5] * len(completions)

    register_data_source("toy/a", echo)
    register_data_source("toy/b", echo)  # same function: one shared component
    register_data_source("toy/c", "gsm8k")  # a built-in name shares the default instance
    register_data_source("toy/d", f"{user_module}.scoring:Judges.length")
    found = reg.data_source_rewards(["toy/a", "toy/b", "toy/c", "openai/gsm8k", "toy/d"])
    assert found["toy/a"] is found["toy/b"]
    assert found["toy/c"] is found["openai/gsm8k"]
    assert found["toy/d"].name == "length"
    with pytest.raises(RewardConfigError, match="already has reward 'echo'.*overwrite=True"):
        register_data_source("toy/a", echo)
    with pytest.raises(RewardConfigError, match="name 'echo' is already used.*name="):
        register_data_source("toy/e", lambda completions: [0.0], name="echo")
    register_data_source("toy/a", "math_boxed", overwrite=True)
    assert registered_data_sources()["toy/a"] == "math_boxed"


def test_unknown_data_source_suggests_close_match():
    with pytest.raises(UnknownDataSourceError, match="'openai/gsm8K'; did you mean 'openai/gsm8k'"):
        reg.data_source_rewards(["openai/gsm8K"])
