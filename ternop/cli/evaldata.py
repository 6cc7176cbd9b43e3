"""Offline evaluation and training text, and the quality metrics computed on it.

Every source ships inside the ``gensim`` wheel (``gensim.test.utils.datapath``), so
evaluation and training run without network access.

Evaluation only (never used for calibration or training):

``lee50``          The Lee-50 document-similarity set: 50 news documents (``lee.cor``) and a
                   50x50 matrix of human similarity scores (``similarities0-1.txt``).
                   Metric: Spearman of cosine similarity vs gold over the 1,225 upper-triangle pairs.
``wiki_retrieval`` 86 articles of the English Wikipedia sample. Query: the article's lead sentence
                   with the title words masked; document: its third substantive paragraph.
                   Metrics: R@1, R@10 and MRR of each query's own document among all 86.

Training / calibration only (``training_texts``), disjoint from the above:
``lee_background.cor`` (300 news documents), the Wikipedia-sample articles that are not in the
retrieval set (whole articles: no paragraph of a retrieval article is used), the articles of
``enwiki-table-markup.xml.bz2``, and the 200 movie-review sentences of ``pang_lee_polarity.cor``.

Heavy imports (gensim, transformers) happen inside the functions.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import torch

_WIKI_SAMPLE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
_WIKI_EXTRA = "enwiki-table-markup.xml.bz2"

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


def _datapath(name: str) -> str:
    require()
    from gensim.test.utils import datapath

    return datapath(name)


# --------------------------------------------------------------------------- Lee-50


@functools.lru_cache(maxsize=1)
def _lee50_cached() -> tuple[tuple[str, ...], np.ndarray]:
    with open(_datapath("lee.cor"), encoding="latin-1") as f:
        docs = tuple(line.strip() for line in f if line.strip())
    gold = np.loadtxt(_datapath("similarities0-1.txt"))
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


def _read_pages(name: str) -> list[tuple[str, str]]:
    import bz2

    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    out = []
    with bz2.BZ2File(_datapath(name)) as f:
        for title, text, _pageid in extract_pages(f):
            if text.lstrip().upper().startswith("#REDIRECT"):
                continue
            out.append((title, filter_wiki(text)))
    return out


@functools.lru_cache(maxsize=1)
def _wiki_cached() -> tuple[tuple[str, str], ...]:
    return tuple(_read_pages(_WIKI_SAMPLE))


def wiki_articles() -> list[tuple[str, str]]:
    """The 106 real articles of the Wikipedia sample as (title, wiki-filtered text)."""
    return list(_wiki_cached())


def clean_markup(text: str) -> str:
    """Drops bold/italic quotes and empty parentheses left by filter_wiki; collapses whitespace."""
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"\(\s*[;,]?\s*\)", "", text)
    return re.sub(r"\s+", " ", text).strip()


def _prose_lines(text: str) -> list[str]:
    """Non-empty lines of an article that are neither headings nor list/table/indent markup."""
    lines = (line.strip() for line in text.split("\n"))
    return [line for line in lines if line and not line.startswith("=") and line[0] not in "*#|{}!:;"]


def substantive_paragraphs(text: str) -> list[str]:
    """Cleaned prose paragraphs of at least 60 words, in article order."""
    paras = (clean_markup(p) for p in _prose_lines(text))
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


# --------------------------------------------------------------------------- training text


def _chunks(text: str, max_words: int = 160) -> list[str]:
    """Splits prose into sentence-aligned chunks of at most ~max_words words (at least 6)."""
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z\"'(])", text)
    out, cur, n = [], [], 0
    for s in sentences:
        w = len(s.split())
        if cur and n + w > max_words:
            out.append(" ".join(cur))
            cur, n = [], 0
        cur.append(s)
        n += w
    if cur:
        out.append(" ".join(cur))
    return [c for c in out if len(c.split()) >= 6]


@functools.lru_cache(maxsize=1)
def _training_cached() -> tuple[tuple[str, str], ...]:
    """(source, text) pairs: source is ``lee_background``, ``pang_lee`` or ``wiki:<article title>``."""
    out: list[tuple[str, str]] = []
    with open(_datapath("lee_background.cor"), encoding="latin-1") as f:
        for line in f:
            out.extend(("lee_background", c) for c in _chunks(line.strip()))
    held_out = set(retrieval_titles())
    for title, text in [*_wiki_cached(), *_read_pages(_WIKI_EXTRA)]:
        if title in held_out:
            continue
        for para in _prose_lines(text):
            out.extend((f"wiki:{title}", c) for c in _chunks(clean_markup(para)))
    with open(_datapath("pang_lee_polarity.cor"), encoding="latin-1") as f:
        for line in f:
            text = re.sub(r"^__label__\w+\s*", "", line).strip()
            if len(text.split()) >= 6:
                out.append(("pang_lee", text))
    # Decontamination: related articles quote each other (e.g. two Academy Award pages), so a
    # chunk sharing any 10-word span with an evaluation text is dropped.
    banned = set()
    for title, text in _wiki_cached():
        if title in held_out:
            banned |= _shingles(text)
    for doc in _lee50_cached()[0]:
        banned |= _shingles(doc)
    seen, unique = set(), []
    for source, t in out:
        if t not in seen and not (_shingles(t) & banned):
            seen.add(t)
            unique.append((source, t))
    return tuple(unique)


def _shingles(text: str, n: int = 10) -> set[str]:
    words = normalize_text(text).split()
    return {" ".join(words[i : i + n]) for i in range(max(1, len(words) - n + 1))}


def training_texts(max_texts: int | None = None) -> list[str]:
    """Calibration/distillation text chunks (sentence to paragraph size), disjoint from evaluation text."""
    texts = [t for _, t in _training_cached()]
    return texts[:max_texts] if max_texts is not None else texts


def training_sources() -> list[tuple[str, str]]:
    """(source, text) for each of :func:`training_texts`, in the same order: where each chunk came from."""
    return list(_training_cached())


def normalize_text(text: str) -> str:
    """Lower-case words separated by single spaces: the form used to check overlap."""
    return " ".join(re.findall(r"[a-z0-9]+", clean_markup(text).lower()))
