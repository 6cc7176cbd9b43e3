"""Why the dispatcher's row and the backend it runs, forced, differ at large M in bench_linear.

    python benchmarks/probe_dispatch.py [--out benchmarks/results/h200/probe_dispatch.json]

bench_linear (d26b62c) timed ``ternop.linear`` 8-14% slower at M = 8192 than ``cuda_dequant``
called through its backend, the backend the registry picks for those calls, while at M = 2048
the two agreed; the turn order rotated, so order did not seem to explain it. This times the same
call four ways, each as its own CUDA graph, taking turns through bench_linear's
``time_interleaved`` (an untimed replay before each timed one; the committed result ran when
that function rotated the order each round, since replaced by a shuffle per round):

- ``op``: ``ternop.linear`` (the registry inside ``torch.ops.ternop.linear``);
- ``op_again``: the same, captured last (a second graph of the same function);
- ``backend``: ``backends.get("cuda_dequant").run(call)``, as bench_linear's forced rows;
- ``cpp``: ``torch.ops.ternop.linear_cuda_dequant`` itself.

Each is also timed eagerly (CUDA events around R calls, after a warm-up), and the report keeps the
caching allocator's reserved bytes after each capture.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import ternop
from ternop import backends, layouts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_linear import DTYPE, capture, copies_for, make_weights, time_interleaved  # noqa: E402
from stamp import git_commit  # noqa: E402

SHAPES = [(1024, 6144), (4096, 14336)]
MS = [2048, 8192]


def eager_us(fn, calls: int, repeats: int = 5) -> float:
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200/probe_dispatch.json"))
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    results = []
    with torch.inference_mode():
        ternop.linear(torch.zeros(1, 128, device="cuda", dtype=DTYPE), *make_weights(128, 128, 1)[0])
        backend = backends.get("cuda_dequant")
        for k, n in SHAPES:
            weights = [(layouts.repack(p, "a16"), s) for p, s in make_weights(k, n, copies_for(n * k // 4))]
            calls = len(weights)
            for m in MS:
                x = torch.randn(m, k, device="cuda", dtype=DTYPE)
                fns = {
                    "op": lambda i: ternop.linear(x, *weights[i % calls], layout="a16"),
                    "backend": lambda i: backend.run(backends.LinearCall(x, *weights[i % calls], None, 16, "a16")),
                    "cpp": lambda i: torch.ops.ternop.linear_cuda_dequant(x, *weights[i % calls], None, 1),
                }
                fns["op_again"] = fns["op"]
                chosen = backends.select(backends.LinearCall(x, *weights[0], None, 16, "a16")).name
                graphs, reserved = {}, {}
                for name, fn in fns.items():
                    graphs[name] = capture(fn, calls)
                    reserved[name] = torch.cuda.memory_reserved()
                graph_us = time_interleaved(graphs, calls, replays=9)
                del graphs
                torch.cuda.empty_cache()
                eager = {name: eager_us(fn, calls) for name, fn in fns.items() if name != "op_again"}
                row = {"K": k, "N": n, "M": m, "calls": calls, "registry_choice": chosen,
                       "graph_us": {kk: round(v, 3) for kk, v in graph_us.items()},
                       "eager_us": {kk: round(v, 3) for kk, v in eager.items()},
                       "reserved_bytes_after_capture": reserved}  # fmt: skip
                results.append(row)
                print(json.dumps(row), flush=True)
    report = {"commit": git_commit(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "method": "graphs of R calls over rotated weight copies taking turns (bench_linear.time_interleaved: "
                        "an untimed replay before each timed one, median of 9 rounds after 2); eager: CUDA "
                        "events around R calls, median of 5",
              "results": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
