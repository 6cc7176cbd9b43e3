"""Distillation batches (length buckets, determinism) and the learning-rate schedule."""

from __future__ import annotations

import pytest

from ternop.quant import batches

WORDS = [f"w{i}" for i in range(50)]
SHORT = [" ".join(f"s{i}x{j}" for j in range(8)) for i in range(50)]
LONG = [" ".join(f"l{i}x{j}" for j in range(40)) for i in range(50)]


def test_length_bucket_edges():
    assert batches.length_bucket("one two three") == "word"
    assert batches.length_bucket("one two three four") == "short"
    assert batches.length_bucket(" ".join(["x"] * 30)) == "short"
    assert batches.length_bucket(" ".join(["x"] * 31)) == "long"


def test_mixed_batches_come_from_one_bucket_with_its_size():
    s = batches.Sampler(WORDS + SHORT + LONG, 4, (1, 1, 1), seed=3)
    seen = set()
    for step in range(60):
        b = s.batch(step)
        kinds = {batches.length_bucket(t) for t in b}
        assert len(kinds) == 1, b
        kind = kinds.pop()
        seen.add(kind)
        assert len(b) == 4 * batches.BUCKET_BATCH[kind] and len(set(b)) == len(b)
    assert seen == set(batches.BUCKETS)


def test_mix_weights_steer_the_buckets():
    s = batches.Sampler(WORDS + SHORT + LONG, 2, (0, 0, 1), seed=0)
    assert all(batches.length_bucket(s.batch(i)[0]) == "long" for i in range(30))
    # An empty bucket drops out; a mix on empty buckets alone is an error.
    only_long = batches.Sampler(LONG, 2, (1, 0, 1), seed=0)
    assert all(batches.length_bucket(only_long.batch(i)[0]) == "long" for i in range(10))
    with pytest.raises(ValueError, match="only to length buckets without texts"):
        batches.Sampler(LONG, 2, (1, 1, 0), seed=0)


def test_batches_depend_on_seed_and_step_only():
    a = batches.Sampler(WORDS + SHORT + LONG, 4, (1, 2, 3), seed=5)
    b = batches.Sampler(WORDS + SHORT + LONG, 4, (1, 2, 3), seed=5)
    assert [b.batch(i) for i in (7, 3, 7)] == [a.batch(7), a.batch(3), a.batch(7)]
    assert batches.Sampler(WORDS + SHORT + LONG, 4, (1, 2, 3), seed=6).batch(7) != a.batch(7)
    plain = batches.Sampler(WORDS + SHORT + LONG, 4, None, seed=5)
    assert len(plain.batch(0)) == 4 and plain.calibration(10) == WORDS + SHORT + LONG


def test_calibration_sample_mixes_lengths():
    sample = batches.Sampler(WORDS + SHORT + LONG, 4, (1, 1, 1), seed=0).calibration(300)
    counts = {k: sum(batches.length_bucket(t) == k for t in sample) for k in batches.BUCKETS}
    assert len(sample) == 300 and all(60 < c < 140 for c in counts.values()), counts


@pytest.mark.parametrize("mix", [(1, 1), (1, -1, 1), (0, 0, 0)])
def test_bad_mix_is_refused(mix):
    with pytest.raises(ValueError, match="mix must be three probabilities"):
        batches.Sampler(WORDS, 2, mix, seed=0)


def test_lr_schedule_shapes():
    f = batches.lr_factor
    assert [f(i, 100, "linear", 4) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4, 100, "cosine", 4) == pytest.approx(1.0)
    assert f(52, 100, "cosine", 4) == pytest.approx(0.5)
    assert f(52, 100, "linear", 4) == pytest.approx(0.5)
    assert f(99, 100, "cosine", 4) == batches.FLOOR and f(500, 100, "linear", 0) == batches.FLOOR
    assert f(99, 100, "constant", 4) == 1.0
    # Cosine stays above linear in the first half of the decay: the curves differ.
    assert f(30, 100, "cosine", 0) > f(30, 100, "linear", 0)
    with pytest.raises(ValueError, match="schedule must be one of"):
        f(0, 10, "step", 0)
    with pytest.raises(ValueError, match="warmup must be >= 0"):
        f(0, 10, "linear", -1)
