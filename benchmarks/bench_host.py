"""Host time of one eager ``ternop.linear`` call, with the kernel taken out.

    python benchmarks/bench_host.py [--json benchmarks/results/cpu/bench_host.json]

vLLM runs batches above its largest CUDA-graph size eagerly, so every ternary linear pays the
op's Python path (checks, dispatcher, backend choice) on the host. This measures that path on
the CPU, under inference mode as vLLM runs it, with a backend that only allocates its output,
beside ``F.linear`` on a tiny tensor (PyTorch's own floor for one op call) and ternop's Python
entry called directly (the difference is the dispatcher's hop into Python). ``linear_q8`` is
the call a vLLM int8 engine makes (rows quantized beforehand, a scale per weight row). Each
call repeats one signature, as a served layer does at one batch size, so it takes the entry's
path for calls seen before. On a GPU machine,
add the launch of the chosen kernel (``benchmarks/probe_host_call.py`` times whole eager calls
there, and the same pieces).
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
from ternop import TernaryLinear, backends, ops
from ternop.activations import quantize_rows
from ternop.meta import check_linear_inputs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stamp import git_commit  # noqa: E402


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
    real = backends.get("cpu")
    # A backend that only allocates its [M, N] output, as every real one does.
    backends.register(backends.Backend("cpu", "cpu", 100, real.can_implement,
                                       lambda call: call.x.new_empty((call.m, call.n))))  # fmt: skip
    try:
        # vLLM runs its model under inference mode, on tensors made there.
        with torch.inference_mode():
            x = torch.randn(4, 1024)
            x3 = x.view(2, 2, 1024)
            w = torch.zeros(1024, 256, dtype=torch.uint8)
            s = torch.ones(1024, 8, dtype=torch.float16)
            op = torch.ops.ternop.linear.default
            q, qs = quantize_rows(x)
            row_scale = s[:, :1].contiguous()
            call = backends.LinearCall(x, w, s, None)
            res = {
                "F.linear (tiny)": per_call_us(lambda: torch.nn.functional.linear(x[:1, :8], x[:2, :8])),
                "torch.ops.ternop.linear, 2-D x": per_call_us(lambda: op(x, w, s)),
                "... 3-D x": per_call_us(lambda: op(x3, w, s)),
                "... activation_bits=8, layout a8": per_call_us(lambda: op(x, w, s, None, 8, "a8")),
                "torch.ops.ternop.linear_q8, row scales": per_call_us(
                    lambda: torch.ops.ternop.linear_q8.default(q, qs, w, row_scale, None, x.dtype, "a8")),
                "ternop's Python entry alone (no dispatcher hop)": per_call_us(lambda: ops._linear_impl(x, w, s)),
                "check_linear_inputs (the message path)": per_call_us(lambda: check_linear_inputs(x, w, s, None)),
                "backends.select(call), a cached choice": per_call_us(
                    lambda: backends.select(call)),
            }
        # A TernaryLinear called as a PyTorch model calls it: under inference mode (what vLLM and
        # sentence-transformers' encode use) or under no_grad, where the op's autograd kernel
        # (torch.library.register_autograd, in Python) runs on every call.
        layer = TernaryLinear(1024, 1024, bias=False)
        plain = torch.randn(4, 1024)
        with torch.inference_mode():
            res["TernaryLinear, under torch.inference_mode()"] = per_call_us(lambda: layer(plain))
        with torch.no_grad():
            res["TernaryLinear, under torch.no_grad()"] = per_call_us(lambda: layer(plain))
    finally:
        backends.register(real)
    for name, us in res.items():
        print(f"{name:50s} {us:7.2f} us")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"commit": git_commit(), "torch": torch.__version__, "us_per_call": res}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
