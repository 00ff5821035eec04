import json
import time

import pytest

from groupflow.rewards import RewardConfigError, build_reward_runner
from groupflow.rewards.code import extract_code, make_code_tests_reward
from groupflow.rewards.code_cases import CodeTests, parse_tests
from groupflow.rewards.code_harness import SplitAssert, split_assert


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


# --------------------------------------------------------------------------------------------
# A solution that attacks the harness (it shares the harness's interpreter)

# Reach the harness's frame, call its report function for every case, leave before the tests.
FRAME_HACK = """
import sys, os
f = sys._getframe(1)
rep, spec = f.f_locals['report'], f.f_locals['spec']
for i in range(len(spec['cases'])):
    rep(i, 'pass')
os._exit(0)
"""
# Find the harness's instructions through gc, and report for each case the values it can find
# anywhere in the process: if an expected value were in the sandbox, this would pass.
GC_HACK = """
import gc, json, os
spec = next(o for o in gc.get_objects() if isinstance(o, dict) and 'token' in o and 'cases' in o)
seen = {repr(o) for o in gc.get_objects() if isinstance(o, int) and o > 100000}
for text in json.dumps(spec).replace('"', ' ').replace(',', ' ').split():
    seen.add(text)
for i in range(len(spec['cases'])):
    for value in seen:
        for status, detail in (('value', json.dumps(value)), ('value', value), ('pass', '')):
            print('\\n' + json.dumps([spec['token'], i, status, detail]), flush=True)
os._exit(0)
"""
# Make failing asserts look like passing ones and comparisons always true, then define a wrong add.
PATCH_HACK = """
import builtins
class Never(Exception):
    pass
builtins.AssertionError = Never
class Anything(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
def add(a, b):
    return Anything(0)
"""
EARLY_EXIT = "import os\nos._exit(0)"
FAKE_MARKERS = (
    "import json\nfor i in range(3):\n"
    "    print(json.dumps(['0' * 32, i, 'pass', '']))\n    print(json.dumps([i, 'pass']))"
)
UNGUESSABLE = ["assert add(400000, 87654) == 487654", "assert add(5, 5) == 10"]
CALL_ROW = json.dumps(
    {"fn_name": "add", "inputs": [[400000, 87654], [5, 5]], "outputs": [487654, 10]}
)


@pytest.mark.parametrize(
    "hack",
    [FRAME_HACK, GC_HACK, PATCH_HACK, EARLY_EXIT, FAKE_MARKERS],
    ids=["frame-report", "gc-forge", "patch-assert-and-eq", "os._exit-early", "fake-markers"],
)
@pytest.mark.parametrize("tests", [UNGUESSABLE, CALL_ROW], ids=["assert-literal", "call"])
def test_attacks_on_the_harness_score_zero(hack, tests):
    assert reward()(completions=[fenced(hack)], tests=[tests]) == [0.0]
    # The same rows still give full marks to an honest solution.
    assert reward()(completions=[fenced(ADD)], tests=[tests]) == [1.0]


def test_asserts_against_literals_are_judged_in_the_parent():
    assert split_assert("assert add(1, 2) == 3") == SplitAssert("add(1, 2)", "==", 3)
    assert split_assert("assert [1, 2] == f(x)") == SplitAssert("f(x)", "==", [1, 2])
    assert split_assert("assert f() is None") == SplitAssert("f()", "is", None)
    assert split_assert("assert f() != (1, 'a')") == SplitAssert("f()", "!=", (1, "a"))
    # Other shapes can only run in the child (documented: a solution can fake them).
    for statement in (
        "assert f(x) > 3",
        "assert f(1) == g(1)",
        "x = f()\nassert x == 1",
        "assert f() is 3",
        "assert f(1) == 2 == 2",
    ):
        assert split_assert(statement) is None, statement
    tuples = ["assert pair() == (1, 2)", "assert pair() != [1, 2]", "assert empty() is None"]
    good = "def pair():\n    return (1, 2)\ndef empty():\n    return None"
    lists = "def pair():\n    return [1, 2]\ndef empty():\n    return 0"
    assert reward()(completions=[fenced(good), fenced(lists)], tests=[tuples] * 2) == [
        1.0,
        0.0,
    ]
    numpy_scalar = "import numpy as np\ndef add(a, b):\n    return np.int64(a) + b"
    assert reward()(completions=[fenced(numpy_scalar)], tests=[UNGUESSABLE]) == [1.0]


# A value that prints as one value and compares as another, and one that prints as True.
LIAR = """
class Liar(int):
    def __repr__(self):
        return "6"

class Truthy:
    def __repr__(self):
        return "True"

def f(x):
    return Liar(5)

def g():
    return Truthy()

def h():
    return object()
"""


def test_a_crafted_object_cannot_satisfy_negative_or_identity_asserts():
    """`!=` needs a plain value (a subclass of int printing "6" is not 6); `is` / `is not` are
    judged by the value's identity in the child, which no object can fake — so an honest object
    that is not a literal passes `is not None` too."""
    cases = ["assert f(1) != 5", "assert g() is True", "assert h() is not None",
             "assert g() is not None", "assert None is not h()"]  # fmt: skip
    scores = [reward()(completions=[fenced(LIAR)], tests=[[case]])[0] for case in cases]
    assert scores == [0.0, 0.0, 1.0, 1.0, 1.0]
    honest = "def f(x):\n    return 6\ndef g():\n    return True"
    assert reward()(completions=[fenced(honest)], tests=[cases[:2]]) == [1.0]
