"""Seconds taken by the quantizer on a 4096 x 14336 fp32 matrix (an 8B-class MLP layer).

    python benchmarks/bench_quantize.py [--rows 4096 --cols 14336] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from ternop import dequantize, quantize_weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=14336)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    w = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0))
    results = {}
    for method in ("absmean", "optimal"):
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            packed, scale = quantize_weight(w, method)
            times.append(time.perf_counter() - t0)
        rel = float((w - dequantize(packed, scale)).norm() / w.norm())
        results[method] = {"seconds_median": sorted(times)[len(times) // 2], "seconds_all": times, "rel_l2_error": rel}
        print(f"{method:8s} {results[method]['seconds_median']:.2f} s  relative L2 error {rel:.4f}")
    report = {
        "shape": [args.rows, args.cols],
        "dtype": "float32",
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "results": results,
    }
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
