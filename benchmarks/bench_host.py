"""Host time of one eager ``ternop.linear`` call, with the kernel taken out.

    python benchmarks/bench_host.py [--json benchmarks/results/cpu/bench_host.json]

vLLM runs batches above its largest CUDA-graph size eagerly, so every ternary linear pays the
op's Python path (checks, dispatcher, backend choice) on the host. This measures that path on
the CPU with a backend that returns at once, beside ``F.linear`` on a tiny tensor (PyTorch's
own floor for one op call). On a GPU machine, add the launch of the chosen kernel
(``benchmarks/sweep_fused.py`` reports ``host_us_per_call`` for whole calls there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import ternop
from ternop import backends
from ternop.meta import check_linear_inputs


def per_call_us(fn, calls: int = 3000, repeats: int = 5) -> float:
    for _ in range(200):
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    x = torch.randn(4, 1024)
    w = torch.zeros(1024, 256, dtype=torch.uint8)
    s = torch.ones(1024, 8, dtype=torch.float16)
    real = backends.get("cpu")
    backends.register(backends.Backend("cpu", "cpu", 100, real.can_implement, lambda call: call.x))
    try:
        res = {
            "F.linear (tiny)": per_call_us(lambda: torch.nn.functional.linear(x[:1, :8], x[:2, :8])),
            "torch.ops.ternop.linear, no-op backend": per_call_us(lambda: torch.ops.ternop.linear(x, w, s)),
            "... activation_bits=8, layout a8": per_call_us(lambda: torch.ops.ternop.linear(x, w, s, None, 8, "a8")),
            "check_linear_inputs (the message path)": per_call_us(lambda: check_linear_inputs(x, w, s, None)),
        }
    finally:
        backends.register(real)
    for name, us in res.items():
        print(f"{name:45s} {us:7.2f} us")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"torch": torch.__version__, "us_per_call": res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
