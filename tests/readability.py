"""Cheap, dependency-free checks that generated text reads as English-like prose.

Used by the tiny model's tests and the demo: a model that emits byte noise, half words or
code soup scores low on at least one of the two ratios below. Pure Python, no torch.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Collection
from functools import lru_cache

# Letters, whitespace and the punctuation of ordinary sentences. Digits, brackets other than
# parentheses, underscores, operators and non-ASCII bytes count against readability.
ORDINARY_CHARS = frozenset(string.ascii_letters + " \t\n" + ".,;:!?'\"()-")

# A word is a run of letters, optionally with apostrophe parts ("doesn't", "object's").
WORD_RE = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")


def readable_ratio(text: str) -> float:
    """Fraction of characters that are letters, whitespace or ordinary punctuation."""
    if not text:
        return 0.0
    return sum(ch in ORDINARY_CHARS for ch in text) / len(text)


def words(text: str) -> list[str]:
    """The lowercased words of ``text``."""
    return [w.lower() for w in WORD_RE.findall(text)]


@lru_cache(maxsize=4)
def reference_words(min_count: int = 3) -> frozenset[str]:
    """Words that occur at least ``min_count`` times in Python's own reference documentation.

    ``pydoc_data.topics`` is human-written English that ships with every CPython, so the set
    is fixed for a Python version and never derived from a model's output. Requiring several
    occurrences drops one-off identifiers and typos; single letters other than "a" and "i"
    are dropped too, so text that falls apart into letters or word fragments ("ributes",
    "ethod", "x y") does not count as real words even though the model saw those bytes.
    """
    from pydoc_data.topics import topics

    counts = Counter(w for key in sorted(topics) for w in words(topics[key]))
    return frozenset(w for w, n in counts.items() if n >= min_count and (len(w) > 1 or w in "ai"))


def real_word_ratio(text: str, vocabulary: Collection[str] | None = None) -> float:
    """Fraction of the words in ``text`` that are real words (0.0 when there are none).

    ``vocabulary`` defaults to :func:`reference_words`; pass a set of lowercased words to
    check against another list.
    """
    found = words(text)
    if not found:
        return 0.0
    vocab = reference_words() if vocabulary is None else vocabulary
    return sum(w in vocab for w in found) / len(found)
