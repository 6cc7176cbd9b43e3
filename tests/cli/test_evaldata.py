"""Evaluation data, metrics, and the hygiene rule: no evaluation text in the training set."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ternop.cli import evaldata

# Word n-grams shared between two texts longer than this are treated as copied text.
_SHINGLE = 10


def _shingles(text: str, n: int = _SHINGLE) -> set[str]:
    words = evaldata.normalize_text(text).split()
    if len(words) < n:
        return {" ".join(words)} if words else set()
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def _leaks(eval_texts, train_texts) -> list[str]:
    """Evaluation texts that share a 10-word span with training text, or are contained in it."""
    train_shingles = set().union(*(_shingles(t) for t in train_texts))
    train_blob = " | ".join(evaldata.normalize_text(t) for t in train_texts)
    out = []
    for t in eval_texts:
        norm = evaldata.normalize_text(t)
        if _shingles(t) & train_shingles or (norm and norm in train_blob):
            out.append(t)
    return out


def _unmasked_retrieval_text() -> list[str]:
    """Every substantive paragraph of every retrieval article: stricter than the queries/docs alone."""
    held = set(evaldata.retrieval_titles())
    return [p for title, text in evaldata.wiki_articles() if title in held for p in evaldata.substantive_paragraphs(text)]


def test_lee50_shapes():
    docs, gold = evaldata.lee50()
    assert len(docs) == 50 and all(len(d.split()) > 20 for d in docs)
    assert gold.shape == (50, 50)
    # Gold scores live in the upper triangle; the metric reads only that.
    iu = np.triu_indices(50, k=1)
    assert (gold[iu] >= 0).all() and (gold[iu] <= 1).all() and gold[iu].std() > 0.05


def test_lee50_spearman_orders():
    docs, gold = evaldata.lee50()
    rng = np.random.default_rng(0)
    # Embeddings whose cosines follow the gold matrix: the top eigenvectors of the gold matrix.
    sym = np.triu(gold, 1) + np.triu(gold, 1).T + np.eye(50)
    vals, vecs = np.linalg.eigh(sym)
    good = vecs[:, -20:] * np.sqrt(np.maximum(vals[-20:], 0))
    random = rng.standard_normal((50, 20))
    assert evaldata.lee50_spearman(good) > 0.5
    assert abs(evaldata.lee50_spearman(random)) < 0.15
    assert evaldata.lee50_spearman(torch.tensor(good) * 3.0) == pytest.approx(evaldata.lee50_spearman(good))
    with pytest.raises(ValueError, match=r"\[50, D\]"):
        evaldata.lee50_spearman(np.zeros((49, 8)))


def test_retrieval_metrics_known_ranks():
    eye = torch.eye(12)
    assert evaldata.retrieval_metrics(eye, eye) == {"r1": 1.0, "r10": 1.0, "mrr": 1.0}
    # Query 0 points at doc 1 first, doc 0 second; everything else is exact.
    q = torch.eye(12)
    q[0] = torch.tensor([0.6, 0.8] + [0.0] * 10)
    m = evaldata.retrieval_metrics(q, eye)
    assert m["r1"] == pytest.approx(11 / 12)
    assert m["r10"] == 1.0
    assert m["mrr"] == pytest.approx((11 + 0.5) / 12)
    with pytest.raises(ValueError, match="equal shapes"):
        evaldata.retrieval_metrics(torch.zeros(3, 4), torch.zeros(4, 4))


def test_wiki_retrieval_task():
    queries, docs = evaldata.wiki_retrieval()
    titles = evaldata.retrieval_titles()
    assert len(queries) == len(docs) == len(titles) == 86
    assert len(set(docs)) == 86
    # Most lead sentences name their subject; those must all be masked.
    assert sum("<mask>" in q for q in queries) >= 75
    for title, query, doc in zip(titles, queries, docs):
        assert all(w.lower() not in query.lower().split() for w in title.split() if len(w) > 3), title
        assert len(doc.split()) >= 60
        assert query.replace("<mask>", "") not in doc


def test_training_texts_disjoint_from_evaluation():
    train = evaldata.training_texts()
    assert len(train) > 1000
    lee_docs, _ = evaldata.lee50()
    queries, docs = evaldata.wiki_retrieval()
    assert _leaks(lee_docs, train) == []
    assert _leaks(queries, train) == []
    assert _leaks(docs, train) == []
    assert _leaks(_unmasked_retrieval_text(), train) == []


def test_training_texts_take_no_chunk_of_a_retrieval_article():
    sources = evaldata.training_sources()
    assert [t for _, t in sources] == evaldata.training_texts()
    wiki = {s.removeprefix("wiki:") for s, _ in sources if s.startswith("wiki:")}
    assert len(wiki) > 10  # the check below looks at real article titles
    assert not wiki & set(evaldata.retrieval_titles())


def test_leak_check_can_fail():
    train = evaldata.training_texts(max_texts=200)
    lee_docs, _ = evaldata.lee50()
    queries, docs = evaldata.wiki_retrieval()
    # A retrieval paragraph hidden inside a longer chunk, and a re-cased, re-spaced Lee document.
    poisoned = [*train, "Some intro words here. " + docs[3] + " More words.", "  " + lee_docs[7].upper()]
    assert _leaks(docs, poisoned) == [docs[3]]
    assert _leaks(lee_docs, poisoned) == [lee_docs[7]]


def test_eval_texts_are_cheap_lists():
    assert len(evaldata.eval_sentences()) == 50 + 86 + 86
    ppl = evaldata.perplexity_texts()
    assert 0 < len(ppl) <= 64 and all(isinstance(t, str) for t in ppl)
