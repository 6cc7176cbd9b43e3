"""What each distillation step trains on, and at which learning rate.

Batches: with a length ``mix`` each step draws one length bucket (``word``: at most 3 words,
``short``: 4-30, ``long``) with the given probabilities and samples its texts from that bucket
only, so that padding stays small; a ``word`` batch holds 4x ``batch_size`` texts and a ``short``
one 2x (:data:`BUCKET_BATCH`). Without ``mix`` every step samples ``batch_size`` texts from all
of them. A step's texts are a function of (seed, step) alone, so a resumed run sees the same batches.

Learning rate: linear warm-up for ``warmup`` steps, then ``schedule`` (linear or cosine decay to
5% of the peak, or constant).
"""

from __future__ import annotations

import math
import random

BUCKETS = ("word", "short", "long")
BUCKET_BATCH = {"word": 4, "short": 2, "long": 1}
"""Texts per step of each length bucket, as a multiple of ``batch_size`` (short texts pad little)."""
SCHEDULES = ("linear", "cosine", "constant")
FLOOR = 0.05
"""The decaying schedules end at this fraction of the peak learning rate."""


def length_bucket(text: str) -> str:
    """``word`` (at most 3 words), ``short`` (4 to 30 words) or ``long``."""
    n = len(text.split())
    return "word" if n <= 3 else "short" if n <= 30 else "long"


def check_mix(mix) -> tuple[float, float, float] | None:
    """``mix`` as three floats (word, short, long), or None; raises ValueError naming the problem."""
    if mix is None:
        return None
    mix = tuple(float(x) for x in mix)
    if len(mix) != 3 or min(mix) < 0 or sum(mix) <= 0:
        raise ValueError(f"mix must be three probabilities >= 0 (word, short, long) with a positive sum, got {mix}")
    return mix


class Sampler:
    """The texts of each step (see the module docstring)."""

    def __init__(self, texts: list[str], batch_size: int, mix, seed: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        mix = check_mix(mix)
        self.texts, self.batch_size, self.seed = texts, batch_size, seed
        self.buckets: dict[str, list[str]] = {b: [] for b in BUCKETS}
        for t in texts:
            self.buckets[length_bucket(t)].append(t)
        self.weights = None
        if mix is not None:
            # An empty bucket drops out; the others keep their relative weights.
            self.weights = {b: w for b, w in zip(BUCKETS, mix) if w > 0 and self.buckets[b]}
            if not self.weights:
                raise ValueError(f"mix {mix} gives weight only to length buckets without texts")

    def batch(self, step: int) -> list[str]:
        rng = random.Random(self.seed * 1_000_003 + step)
        if self.weights is None:
            return rng.sample(self.texts, min(self.batch_size, len(self.texts)))
        bucket = rng.choices(list(self.weights), weights=list(self.weights.values()))[0]
        pool = self.buckets[bucket]
        return rng.sample(pool, min(self.batch_size * BUCKET_BATCH[bucket], len(pool)))

    def calibration(self, n: int) -> list[str]:
        """``n`` texts drawn like the batches (mixed lengths), for calibrating the start; all texts without a mix."""
        if self.weights is None:
            return self.texts
        rng = random.Random(self.seed)
        names, weights = list(self.weights), list(self.weights.values())
        return [rng.choice(self.buckets[rng.choices(names, weights=weights)[0]]) for _ in range(n)]


def lr_factor(step: int, total: int, schedule: str, warmup: int) -> float:
    """The learning rate of step ``step`` (0-based) of ``total`` as a fraction of the peak."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 1.0 - frac if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
    return max(FLOOR, decay)
