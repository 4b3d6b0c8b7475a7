"""Generation-quality metrics on text (METHOD §3).

Words are the lowercase whitespace-separated tokens of a text. diversity = product over
n = 2, 3, 4 of (unique n-grams / total n-grams), pooled over all samples (LD4LG's definition);
distinct-n is one factor of it; unigram entropy is in nats over the pooled word counts.
"""

from __future__ import annotations

import math
from collections import Counter


def words(text: str) -> list[str]:
    return text.lower().split()


def ngrams(tokens: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(texts: list[str], n: int) -> float:
    grams = [g for text in texts for g in ngrams(words(text), n)]
    return len(set(grams)) / len(grams) if grams else 0.0


def diversity(texts: list[str]) -> float:
    return math.prod(distinct_n(texts, n) for n in (2, 3, 4))


def unigram_entropy(texts: list[str]) -> float:
    counts = Counter(w for text in texts for w in words(text))
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values()) if total else 0.0


def token_entropy(samples: list[list[int]]) -> float:
    """Mean over samples of the entropy (nats) of each sample's own token-id distribution: low when a
    sample repeats itself, which also lowers Gen.PPL."""
    values = []
    for ids in samples:
        if ids:
            counts = Counter(ids)
            values.append(-sum(c / len(ids) * math.log(c / len(ids)) for c in counts.values()))
    return sum(values) / len(values) if values else 0.0


def text_metrics(texts: list[str]) -> dict[str, float]:
    return {
        "diversity": diversity(texts),
        **{f"distinct_{n}": distinct_n(texts, n) for n in (1, 2, 3, 4)},
        "unigram_entropy": unigram_entropy(texts),
        "mean_words": sum(len(words(t)) for t in texts) / len(texts) if texts else 0.0,
    }
