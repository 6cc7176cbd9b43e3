"""What a Python call costs at the edge of a frame-stack chunk, with and without the plugin's fix.

    python benchmarks/probe_stack_chunks.py [--out benchmarks/results/cpu/probe_stack_chunks.json]

CPython (3.11 and later, before its upstream fix) keeps frames in 16 KiB chunks that it maps
when the stack grows past one and unmaps when it shrinks back. This calls a small function in a
loop at every stack depth from 0 to ``--depths`` and reports, per depth where it happens, the
time per call and the calling thread's minor page faults per call; then it installs
``ternop.vllm_plugin.stack_chunks`` in this process and scans again. Runs in a second or two on
any Linux machine; no GPU, no vLLM.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stamp import git_commit  # noqa: E402

from ternop.vllm_plugin import stack_chunks  # noqa: E402


def leaf(a=1, b=2, c=3, d=4):
    return a


def _spin(calls: int) -> None:
    for _ in range(calls):
        leaf()


def _at_depth(k: int, calls: int) -> tuple[float, int]:
    if k:
        return _at_depth(k - 1, calls)
    f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    t0 = time.perf_counter()
    _spin(calls)
    dt = time.perf_counter() - t0
    return dt * 1e9 / calls, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0


def scan(depths: int, calls: int) -> dict:
    rows = [(k, *_at_depth(k, calls)) for k in range(depths)]
    typical = statistics.median(ns for _, ns, _ in rows)
    edges = [{"depth": k, "ns_per_call": ns, "faults_per_call": f / calls}
             for k, ns, f in rows if f >= calls // 2]  # fmt: skip
    return {"typical_ns_per_call": typical, "edges": edges}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/probe_stack_chunks.json"))
    parser.add_argument("--depths", type=int, default=400)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args(argv)
    ok, why = stack_chunks.applies()
    if not ok:
        print(f"nothing to show: {why}", file=sys.stderr)
        return 2
    before = scan(args.depths, args.calls)
    stack_chunks.keep_stack_chunks()
    after = scan(args.depths, args.calls)
    report = {"commit": git_commit(), "python": sys.version.split()[0], "machine": platform.machine(),
              "depths": args.depths, "calls": args.calls, "without": before, "with_kept_chunks": after,
              "allocator": stack_chunks.stats()}  # fmt: skip
    for name, r in (("without", before), ("with kept chunks", after)):
        at = ", ".join(f"depth {e['depth']}: {e['ns_per_call']:.0f} ns, {e['faults_per_call']:.2f} faults a call"
                       for e in r["edges"]) or "none"  # fmt: skip
        print(f"{name:17s} typical {r['typical_ns_per_call']:.0f} ns a call; chunk edges: {at}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
