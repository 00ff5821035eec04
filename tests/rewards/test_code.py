import json
import time

import pytest

from groupflow.rewards import RewardConfigError, build_reward_runner
from groupflow.rewards.code import (
    CodeTests,
    extract_code,
    make_code_tests_reward,
    parse_tests,
)


def reward(**options):
    options.setdefault("timeout_s", 1.0)
    options.setdefault("max_workers", 2)
    return make_code_tests_reward(**options)


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{code}\n```\nIt adds."


ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]
ADD = "def add(a, b):\n    return a + b"


# --------------------------------------------------------------------------------------------
# Extracting the program


def test_extract_last_python_block():
    text = "```python\nfirst()\n```\ntext\n```py\nsecond()\n```\n```text\noutput\n```"
    assert extract_code(text) == "second()\n"


def test_extract_falls_back_to_untagged_block_then_whole_text():
    assert extract_code("Try:\n```\nuntagged()\n```") == "untagged()\n"
    assert extract_code("print(1)") == "print(1)"


def test_extract_ignores_thinking_and_accepts_a_cut_off_block():
    text = "<think>```python\nwrong()\n```</think>Answer:\n```python\nright()\n"
    assert extract_code(text) == "right()\n"


# --------------------------------------------------------------------------------------------
# Test-case rows


def test_parse_the_three_row_shapes():
    assert parse_tests(ADD_TESTS) == CodeTests("assert", tuple(ADD_TESTS))
    assert parse_tests("assert f() == 1") == CodeTests("assert", ("assert f() == 1",))
    verl = json.dumps({"inputs": ["1 2\n", ["3 4", "5"]], "outputs": ["3\n", ["7", "5"]]})
    assert parse_tests(verl) == CodeTests("stdio", (("1 2\n", "3\n"), ("3 4\n5", "7\n5")))
    pairs = [{"input": "1", "output": "2"}]
    assert parse_tests(pairs) == CodeTests("stdio", (("1", "2"),))
    call = {"inputs": ["1\n[2, 3]", [4]], "outputs": ["[1, 2]", 5], "fn_name": "f"}
    assert parse_tests(call) == CodeTests("call", (([1, [2, 3]], [1, 2]), ([4], 5)), "f")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (42, "field 'tests' must be a list of assert statements, a dict .* got int"),
        ([], "field 'tests' has no test cases"),
        (["assert True", 3], r"field 'tests'\[1\] must be a non-empty string"),
        (["assert f(1) ==", "x"], r"field 'tests'\[0\] is not valid Python \(invalid syntax\)"),
        ("72", "field 'tests' is a string with no assert statement: '72'"),
        ('{"inputs": [1', "field 'tests' looks like JSON but does not parse"),
        ({"inputs": ["1"]}, "field 'tests' lacks key 'outputs'"),
        ({"inputs": ["1"], "outputs": []}, "has 1 inputs but 0 outputs"),
        ({"inputs": "1", "outputs": "2"}, "'inputs' must be a list, got str"),
        ({"inputs": [3], "outputs": ["3"]}, r"inputs\[0\] must be a string or a list of lines"),
        ({"inputs": ["x"], "outputs": ["1"], "fn_name": "f"}, r"inputs\[0\]: an argument line"),
        ({"inputs": ["1"], "outputs": ["oops"], "fn_name": "f"}, r"outputs\[0\] is not JSON"),
        ({"inputs": ["1"], "outputs": ["1"], "fn_name": "no such"}, "fn_name must be a function"),
        ([{"input": "1"}], r"field 'tests'\[0\] lacks key 'output'"),
    ],
)
def test_bad_rows_name_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        parse_tests(value, "tests")


# --------------------------------------------------------------------------------------------
# Scores


def test_passing_failing_partial_and_timing_out():
    partial = "def add(a, b):\n    return a + b if a < 10 else 0"
    loops = "def add(a, b):\n    while True:\n        pass"
    completions = [fenced(ADD), fenced("def add(a, b):\n    return a - b"), fenced(partial)]
    completions += [fenced(loops), fenced("def add(a, b) return"), "no code here at all", ""]
    started = time.monotonic()
    scores = reward()(completions=completions, tests=[ADD_TESTS] * len(completions))
    assert scores == [1.0, 0.0, pytest.approx(2 / 3), 0.0, 0.0, 0.0, 0.0]
    assert time.monotonic() - started < 10  # the loop is cut at its 1 s timeout


def test_tests_reported_before_a_timeout_still_count():
    slow_third = "def add(a, b):\n    if a == 10:\n        while True: pass\n    return a + b"
    assert reward()(completions=[fenced(slow_third)], tests=[ADD_TESTS]) == [pytest.approx(2 / 3)]


def test_all_or_nothing_and_max_tests():
    partial = fenced("def add(a, b):\n    return a + b if a < 10 else 0")
    assert reward(partial_credit=False)(completions=[partial], tests=[ADD_TESTS]) == [0.0]
    assert reward(max_tests=1)(completions=[partial], tests=[ADD_TESTS]) == [1.0]


@pytest.mark.parametrize(
    "cheat",
    [
        "import sys\nsys.exit(0)",  # leave before the tests run
        "import os\nos._exit(0)",
        'print(\'pass\')\nprint(\'["0", 0, "pass", ""]\')',  # print what a report looks like
    ],
    ids=["sys.exit", "os._exit", "fake-report"],
)
def test_cheats_do_not_pass_assert_tests(cheat):
    assert reward()(completions=[fenced(cheat)], tests=[ADD_TESTS]) == [0.0]


def test_reports_survive_the_solution_closing_stdout():
    closes = "import sys\nsys.stdout.close()\nprint = None\n" + ADD
    assert reward()(completions=[fenced(closes)], tests=[ADD_TESTS]) == [1.0]


def test_stdin_stdout_rows_verl_style():
    row = json.dumps({"inputs": ["1 2\n", "3 4\n", "0 0\n"], "outputs": ["3\n", "7\n", "0"]})
    good = "a, b = map(int, input().split())\nprint(a + b)   "
    half = "a, b = map(int, input().split())\nprint(a + b if a else 5)"
    crash = "a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)"
    scores = reward()(
        completions=[fenced(good), fenced(half), fenced(crash)], ground_truth=[row] * 3
    )
    assert scores == [1.0, pytest.approx(2 / 3), 0.0]  # a non-zero exit fails the case


def test_function_call_rows_and_the_always_equal_cheat():
    row = {"inputs": ["[3, 1, 2]", "[]"], "outputs": ["[1, 2, 3]", "[[]]"], "fn_name": "sort_it"}
    function = "def sort_it(xs):\n    return sorted(xs)"
    method = "class Solution:\n    def sort_it(self, xs):\n        return tuple(sorted(xs))"
    always_equal = (
        "class Anything:\n    def __eq__(self, other):\n        return True\n"
        "def sort_it(xs):\n    return Anything()"
    )
    missing = "def other(xs):\n    return xs"
    completions = [fenced(c) for c in (function, method, always_equal, missing)]
    scores = reward()(completions=completions, ground_truth=[row] * 4)
    assert scores == [1.0, 1.0, 0.0, 0.0]


def test_samples_run_in_parallel():
    # Four samples that each sleep 0.5 s take about 1 s on 2 threads, not 2 s.
    sleepy = fenced("import time\ntime.sleep(0.5)\ndef add(a, b):\n    return a + b")
    started = time.monotonic()
    scores = reward(max_workers=4)(completions=[sleepy] * 4, tests=[ADD_TESTS[:1]] * 4)
    assert scores == [1.0] * 4
    assert time.monotonic() - started < 1.9


# --------------------------------------------------------------------------------------------
# Through the registry and the runner


def test_registered_by_name_and_for_verl_code_sources():
    runner = build_reward_runner([{"name": "code_tests", "kwargs": {"timeout_s": 1.0}}])
    result = runner(["p"], [fenced(ADD)], tests=[ADD_TESTS])
    assert result.total.tolist() == [1.0]
    by_source = build_reward_runner(None)
    row = json.dumps({"inputs": ["2\n"], "outputs": ["4\n"]})
    result = by_source(
        ["p"], [fenced("print(int(input()) * 2)")], data_source=["apps"], ground_truth=[row]
    )
    assert result.total.tolist() == [1.0]


def test_a_bad_row_costs_one_sample_not_the_step():
    runner = build_reward_runner([{"name": "code_tests", "kwargs": {"timeout_s": 1.0}}])
    result = runner(["p", "q"], [fenced(ADD)] * 2, tests=[ADD_TESTS, {"inputs": ["1"]}])
    assert result.total.tolist() == [1.0, 0.0]
    assert result.metrics["reward/code_tests/failures"] == 1.0


def test_bad_row_message_names_field_and_sample():
    with pytest.raises(ValueError, match=r"field 'ground_truth' lacks key 'inputs'.*\(sample 1\)"):
        reward()(completions=["x", "y"], ground_truth=[ADD_TESTS, {"outputs": []}])


def test_missing_field_is_a_configuration_error():
    with pytest.raises(RewardConfigError, match="field 'tests' or 'ground_truth', which the batch"):
        reward()(completions=["x"], answer=["1"])
    with pytest.raises(RewardConfigError, match="field 'test_list', which the batch lacks"):
        reward(field="test_list")(completions=["x"], tests=[ADD_TESTS])
    assert reward(field="test_list")(completions=[fenced(ADD)], test_list=[ADD_TESTS]) == [1.0]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"timeout_s": 0}, "code_tests: sandbox limit timeout_s must be a positive number"),
        ({"memory_mb": 1}, "code_tests: sandbox limit memory_mb must be an integer >= 32"),
        ({"max_tests": 0}, "code_tests: max_tests must be a positive integer"),
        ({"max_workers": 1.5}, "code_tests: max_workers must be a positive integer"),
        ({"partial_credit": "yes"}, "code_tests: partial_credit must be true or false"),
        ({"field": ""}, "code_tests: field must be a field name"),
    ],
)
def test_bad_options_fail_at_build(options, message):
    with pytest.raises(RewardConfigError, match=message):
        build_reward_runner([{"name": "code_tests", "kwargs": options}])
