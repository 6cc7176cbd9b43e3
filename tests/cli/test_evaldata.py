"""Evaluation data (the visible sets and the held-out split) and the metrics computed on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ternop.cli import evaldata

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


def test_eval_texts_are_cheap_lists():
    assert len(evaldata.eval_sentences()) == 50 + 86 + 86
    ppl = evaldata.perplexity_texts()
    assert 0 < len(ppl) <= 64 and all(isinstance(t, str) for t in ppl)


def test_heldout_passages_are_other_paragraphs_of_the_retrieval_articles():
    queries, docs = evaldata.heldout_passages()
    vq, vd = evaldata.wiki_retrieval()
    assert 70 <= len(queries) == len(docs) <= 86
    assert len(set(docs)) == len(docs) and not set(docs) & set(vd)
    assert all(len(d.split()) >= 60 for d in docs)
    assert sum("<mask>" in q for q in queries) >= len(queries) // 3
    assert not {evaldata.normalize_text(q) for q in queries} & {evaldata.normalize_text(q) for q in vq}


def test_heldout_short_queries_are_wordnet_lemmas_and_definitions():
    queries, docs = evaldata.heldout_short()
    assert len(queries) == len(docs) == 300
    lengths = sorted(len(q.split()) for q in queries)
    assert lengths[0] >= 1 and lengths[150] <= 2 and lengths[-1] <= 8
    assert len({q.lower() for q in queries}) == 300 and len(set(docs)) >= 295
    assert all(len(d.split()) >= 4 for d in docs)
    assert len(evaldata.heldout_synset_keys()) == 300
    # The split is a fixed hash of the synset ids: the same on every machine.
    assert evaldata.heldout_short() == (queries, docs)


def test_heldout_word_pairs():
    words = evaldata.heldout_words()
    assert {k: len(v) for k, v in words.items()} == {"simlex": 999, "wordsim": 353}
    assert all(isinstance(g, float) and a and b for rows in words.values() for a, b, g in rows)


def test_suite_scores_every_set_from_one_embedding_matrix():
    suite = evaldata.suite()
    assert suite.n_visible == 50 + 86 + 86 and suite.texts[: suite.n_visible] == evaldata.eval_sentences()
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((len(suite.texts), 32))
    # Plant perfect matches for the held-out passages: query i's vector is document i's.
    (qa, qb), (da, db) = suite.parts["passages_q"], suite.parts["passages_d"]
    emb[qa:qb] = emb[da:db]
    scores = suite.score(emb)
    assert scores["heldout_passage_mrr"] == 1.0 and scores["heldout_passage_r1"] == 1.0
    assert scores["heldout_short_mrr"] < 0.2 and abs(scores["heldout_simlex_spearman"]) < 0.15
    assert set(scores) >= {"lee50_spearman", "wiki_mrr", "heldout_short_r10", "heldout_wordsim_spearman"}
    visible = evaldata.suite(heldout=False)
    assert visible.texts == suite.texts[: suite.n_visible] and set(visible.score(emb[: suite.n_visible])) == {
        "lee50_spearman", "wiki_r1", "wiki_r10", "wiki_mrr"}
    with pytest.raises(ValueError, match=f"expected {len(suite.texts)} embeddings"):
        suite.score(emb[:10])
