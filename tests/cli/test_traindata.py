"""Training text: its sources and length buckets, and the hygiene rule: no evaluation text in it."""

from __future__ import annotations

import lzma
from pathlib import Path

import pytest

from ternop.cli import evaldata, traindata

# Word n-grams shared between two texts longer than this are treated as copied text.
_SHINGLE = 10


def _shingles(text: str, n: int = _SHINGLE) -> set[str]:
    words = evaldata.normalize_text(text).split()
    if len(words) < n:
        return {" ".join(words)} if words else set()
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


class _TrainIndex:
    """The training texts' 10-word spans and their normalized text, built once for many checks."""

    def __init__(self, train_texts):
        self.shingles = set().union(*(_shingles(t) for t in train_texts))
        self.blob = " | ".join(evaldata.normalize_text(t) for t in train_texts)

    def leaks(self, eval_texts) -> list[str]:
        """Evaluation texts that share a 10-word span with training text, or are contained in it.

        A text of 12 or more words inside the training text shares its second to eleventh words,
        whole, with one training text (normalized text has no "|", so a match cannot straddle the
        separator): the span test finds it, and only shorter texts need the substring search."""
        out = []
        for t in eval_texts:
            norm = evaldata.normalize_text(t)
            contained = bool(norm) and len(norm.split()) < _SHINGLE + 2 and norm in self.blob
            if contained or _shingles(t) & self.shingles:
                out.append(t)
        return out


def _leaks(eval_texts, train_texts) -> list[str]:
    """:meth:`_TrainIndex.leaks` on a small training list."""
    return _TrainIndex(train_texts).leaks(eval_texts)


@pytest.fixture(scope="module")
def train():
    return traindata.training_texts()


@pytest.fixture(scope="module")
def train_index(train):
    return _TrainIndex(train)


def _unmasked_retrieval_text() -> list[str]:
    """Every substantive paragraph of every retrieval article: stricter than the queries/docs alone."""
    held = set(evaldata.retrieval_titles())
    return [p for title, text in evaldata.wiki_articles() if title in held for p in evaldata.substantive_paragraphs(text)]


def test_training_texts_disjoint_from_the_visible_sets(train_index):
    lee_docs, _ = evaldata.lee50()
    queries, docs = evaldata.wiki_retrieval()
    assert train_index.leaks(lee_docs) == []
    assert train_index.leaks(queries) == []
    assert train_index.leaks(docs) == []
    assert train_index.leaks(_unmasked_retrieval_text()) == []


def test_training_texts_disjoint_from_the_heldout_split(train, train_index):
    pq, pd = evaldata.heldout_passages()
    assert train_index.leaks(pq) == [] and train_index.leaks(pd) == []
    sq, sd = evaldata.heldout_short()
    # A definition is never inside a training text; a lemma or a word is never a training text of its own
    # (single words occur inside other texts, as any word does).
    assert train_index.leaks(sd) == []
    exact = {evaldata.normalize_text(t) for t in train}
    words = {w for rows in evaldata.heldout_words().values() for a, b, _ in rows for w in (a, b)}
    assert [q for q in [*sq, *words] if evaldata.normalize_text(q) in exact] == []


def test_no_text_of_a_heldout_synset_or_retrieval_article():
    sources = traindata.training_sources()
    assert [t for _, t in sources] == traindata.training_texts()
    wiki = {s.removeprefix("wiki:") for s, _ in sources if s.startswith("wiki:")}
    assert len(wiki) > 10  # the check below looks at real article titles
    assert not wiki & set(evaldata.retrieval_titles())
    from ternop.cli.wordnet import synsets

    held = evaldata.heldout_synset_keys()
    held_defs = {evaldata.normalize_text(s.definition) for s in synsets() if s.key in held}
    wordnet_defs = {evaldata.normalize_text(t) for s, t in sources if s == "wordnet:definition"}
    assert len(held_defs) >= 295 and not held_defs & wordnet_defs


def test_sources_and_length_buckets(train):
    summary = traindata.summary()
    for family in ("lee_background", "wiki", "pang_lee", "wordnet", "pydoc"):
        assert summary[family]["texts"] > 100, family
        assert family in traindata.SOURCES
    assert summary["total"]["texts"] == len(train) > 100_000
    assert summary["total"]["words"] > 1_000_000  # 84k words was the set before: far more text now
    for bucket in traindata.BUCKETS:
        assert summary[f"bucket:{bucket}"]["texts"] > 1000, bucket
    # Chunks end at sentence ends: one long sentence can pass 160 words, never by far.
    assert all(len(t.split()) <= 320 and "\n" not in t for t in train)
    assert len(set(train)) == len(train)


def test_leak_check_can_fail(train):
    lee_docs, _ = evaldata.lee50()
    queries, docs = evaldata.wiki_retrieval()
    _, short_docs = evaldata.heldout_short()
    head = train[:200]
    # A retrieval paragraph hidden inside a longer chunk, a re-cased, re-spaced Lee document, a planted definition.
    poisoned = [*head, "Some intro words here. " + docs[3] + " More words.", "  " + lee_docs[7].upper(),
                "as they say, " + short_docs[5] + "."]  # fmt: skip
    assert _leaks(docs, poisoned) == [docs[3]]
    assert _leaks(lee_docs, poisoned) == [lee_docs[7]]
    assert short_docs[5] in _leaks(short_docs, poisoned)


def test_decontamination_drops_planted_leaks(monkeypatch):
    _, short_docs = evaldata.heldout_short()
    _, docs = evaldata.wiki_retrieval()
    planted = [("x", "A clean sentence about rivers and boats that nobody evaluates."),
               ("x", "Intro. " + docs[0]), ("x", "we call it " + short_docs[0] + " today"),
               ("x", evaldata.heldout_words()["simlex"][0][0].upper())]  # fmt: skip
    kept = traindata.decontaminate(planted)
    assert kept == planted[:1]


# The generated text that `benchmarks/gen_text.py` wrote, for `quality_minilm_gpu.py prepare --extra-text`:
# every such file in the data folder.
GENERATED = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "data").glob("generated_*.txt.xz"))


def test_generated_text_files_are_found():
    assert {"generated_smollm2.txt.xz", "generated_smollm2_seed1.txt.xz"} <= {p.name for p in GENERATED}


@pytest.mark.parametrize("path", GENERATED, ids=lambda p: p.name)
def test_committed_generated_text_is_disjoint_from_every_evaluation_text(path):
    with lzma.open(path, "rt", encoding="utf-8") as f:
        texts = [line.strip() for line in f if line.strip()]
    assert len(texts) > 1000 and all(len(t.split()) >= 6 for t in texts)
    lee_docs, _ = evaldata.lee50()
    queries, docs = evaldata.wiki_retrieval()
    pq, pd = evaldata.heldout_passages()
    _, sd = evaldata.heldout_short()
    index = _TrainIndex(texts)
    for eval_texts in (lee_docs, queries, docs, _unmasked_retrieval_text(), pq, pd, sd):
        assert index.leaks(eval_texts) == []
