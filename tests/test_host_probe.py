"""benchmarks/host_probe.py: the garbage-collector window that bench_vllm.py records beside each
embedding batch counts the collections that ran inside it, and only those."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import host_probe  # noqa: E402


def test_gc_window_counts_the_collections_inside_it():
    gc.collect()
    window = host_probe.GcWindow()
    gc.collect(0)
    gc.collect(2)
    gc.collect(2)
    out = window.report()
    assert out["collections"][2] >= 2 and out["collections"][0] >= 1, out
    assert out["seconds"] > 0, out
    gc.collect(2)  # after report(): not counted, and the callback is gone
    assert window.report() == out
    assert not any(getattr(cb, "__self__", None) is window for cb in gc.callbacks)
