"""Benchmark ternop.linear on CUDA against cuBLAS bf16 and "dequantize, then F.linear".

    python benchmarks/bench_linear.py [--out benchmarks/results/h200/bench_linear.json]
    python benchmarks/bench_linear.py --sweep     # offline tuning of the static config table

Method (as a server runs: no per-call syncs):
- Weights are rotated: each timed graph calls the layer on R distinct weight copies, with R
  chosen so that the copies together exceed twice the 50 MB L2; every call reads its
  weights from HBM, for bf16 and ternary alike.
- Each implementation is captured once into a CUDA graph of R calls; CUDA events time
  whole replays; the time per call is the median over replays divided by R.
- Reported per (shape, M, implementation): microseconds per call, speed-up over cuBLAS
  bf16 at the same (shape, M), GB/s (the bytes the implementation must move: weights,
  x and out) and TFLOP/s (2*M*N*K).

Implementations: every ternop CUDA backend forced (``backend:<name>``), the dispatcher
(``ternop``: what ``ternop.linear`` picks from M), ``cublas_bf16`` (F.linear on bf16
weights) and ``dequant_bf16`` (dequantize to bf16 with torch ops, then F.linear, every call).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import ternop
from ternop import backends

SHAPES = {
    "0.6B": [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)],
    "8B": [(4096, 4096), (4096, 14336), (4096, 28672), (14336, 4096)],
}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 8192]
L2_BYTES = 50 * 2**20
DTYPE = torch.bfloat16


def copies_for(bytes_per_copy: int, cap: int = 256) -> int:
    return max(2, min(cap, math.ceil(2 * L2_BYTES / bytes_per_copy)))


def time_graph(fn, calls: int, replays: int = 7, warmup: int = 2) -> float:
    """Median microseconds per call of ``fn(i)`` for i in range(calls), timed as CUDA graph replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(calls, 2)):
            fn(i)  # compiles kernels and builds the extension outside capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    times = []
    for r in range(warmup + replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if r >= warmup:
            times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return statistics.median(times)


def make_weights(k: int, n: int, copies: int):
    g = torch.Generator(device="cuda").manual_seed(k * 7 + n)
    out = []
    for _ in range(copies):
        codes = torch.randint(0, 3, (n, k // 4, 4), device="cuda", dtype=torch.uint8, generator=g)
        packed = codes[..., 0] | codes[..., 1] << 2 | codes[..., 2] << 4 | codes[..., 3] << 6
        scale = (torch.rand((n, k // 128), device="cuda", generator=g) * 0.02 + 0.001).to(torch.float16)
        out.append((packed.contiguous(), scale))
    return out


def dequant(packed, scale, shifts):
    """Capture-safe dequantize to bf16 (ternop.format.dequantize builds a small CPU tensor per call)."""
    c = ((packed.unsqueeze(-1) >> shifts) & 3).reshape(packed.shape[0], -1).to(torch.int8)
    v = ((c & 1) - (c >> 1)).to(DTYPE)
    return (v.view(packed.shape[0], -1, 128) * scale.to(DTYPE).unsqueeze(-1)).view(packed.shape[0], -1)


def impls(x, tern, dense):
    """name -> (fn(i), n_copies) for one (shape, M)."""
    x2 = x
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device="cuda")
    res = {
        "cublas_bf16": (lambda i: F.linear(x, dense[i % len(dense)]), len(dense)),
        "dequant_bf16": (lambda i: F.linear(x, dequant(*tern[i % len(tern)], shifts)), len(dense)),
        "ternop": (lambda i: ternop.linear(x, *tern[i % len(tern)]), len(tern)),
    }
    for b in backends.available("cuda"):
        ok, _ = b.can_implement(x2, *tern[0], None)
        if ok:
            res[f"backend:{b.name}"] = ((lambda b: lambda i: b.run(x2, *tern[i % len(tern)], None))(b), len(tern))
    return res


def bytes_moved(name: str, m: int, k: int, n: int) -> int:
    act = 2 * m * k + 2 * m * n
    if name == "cublas_bf16":
        return 2 * n * k + act
    return n * k // 4 + 2 * n * (k // 128) + act


def run_bench(args, save=None) -> dict:
    """Times every implementation; ``save(report)`` is called after each shape (a cut-off run keeps what it measured)."""
    ternop.linear(torch.zeros(1, 128, device="cuda", dtype=DTYPE), *make_weights(128, 128, 1)[0])  # load backends
    results = []
    for family, shapes in SHAPES.items():
        for k, n in shapes:
            tern_bytes = n * k // 4 + 2 * n * (k // 128)
            tern = make_weights(k, n, copies_for(tern_bytes))
            dense = [ternop.dequantize(p, s, DTYPE) for p, s in tern[: copies_for(2 * n * k)]]
            for m in args.ms:
                x = torch.randn(m, k, device="cuda", dtype=DTYPE)
                row = {}
                for name, (fn, calls) in impls(x, tern, dense).items():
                    try:
                        row[name] = time_graph(fn, calls)
                    except Exception as exc:  # report a broken backend, keep measuring the rest
                        print(f"  {name} failed at K={k} N={n} M={m}: {type(exc).__name__}: {exc}"[:400], flush=True)
                base = row["cublas_bf16"]
                for name, us in row.items():
                    results.append({
                        "family": family, "K": k, "N": n, "M": m, "impl": name, "us": round(us, 3),
                        "speedup_vs_bf16": round(base / us, 3),
                        "GBps": round(bytes_moved(name, m, k, n) / us / 1e3, 1),
                        "TFLOPs": round(2 * m * n * k / us / 1e6, 2),
                    })
                best = min([(v, kname) for kname, v in row.items() if kname.startswith("backend:")] or [(math.inf, "-")])
                tern_us = row.get("ternop", math.inf)
                print(f"{family:5s} {k:6d}->{n:6d} M={m:5d}  bf16 {base:9.2f} us  ternop {tern_us:9.2f} us "
                      f"x{base / tern_us:5.2f}  best {best[1][8:]} x{base / best[0]:5.2f}"
                      + (f"  dequant x{base / row['dequant_bf16']:5.2f}" if "dequant_bf16" in row else ""),
                      flush=True)
            del tern, dense
            torch.cuda.empty_cache()
            if save is not None:
                save(_report(results, complete=False))
    return _report(results, complete=True)


def _report(results: list, complete: bool) -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _triton_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": "CUDA-graph replays of R calls over R rotated weight copies (> 2x the 50 MB L2), "
                  "CUDA events, median of 7 replays after 2 warm-ups; x and out in bf16",
        "complete": complete,
        "results": results,
    }


def _triton_version():
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def run_sweep(args) -> None:
    """Times candidate configs of the Triton kernels; the winners go into ternop/cuda/configs.py."""
    from ternop.cuda import triton_ops  # noqa: F401  (registers the private ops)

    ops = torch.ops.ternop
    cases = [(4096, 14336), (1024, 4096)]
    gemm_cands = {
        16: [(16, bn, 8, 4, s) for bn in (32, 64, 128) for s in (3, 5)],
        64: [(bm, bn, 8, 4, 4) for bm in (32, 64) for bn in (64, 128)],
        256: [(64, 128, 8, 4, 4), (128, 128, 8, 8, 3), (128, 64, 8, 4, 4), (64, 256, 8, 8, 3)],
        2048: [(128, 128, 8, 8, 3), (128, 256, 8, 8, 3), (128, 128, 8, 4, 4), (256, 128, 8, 8, 3), (128, 64, 8, 4, 4)],
    }
    gemv_cands = [(bn, bk, 4, 2) for bn in (8, 16, 32) for bk in (256, 512)]
    for k, n in cases:
        tern = make_weights(k, n, copies_for(n * k // 4))
        for m, cands in gemm_cands.items():
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            timed = []
            for c in cands:
                try:
                    us = time_graph(lambda i: ops._linear_triton_gemm(x, *tern[i % len(tern)], None, *c), len(tern), 5, 1)
                except Exception as exc:  # a config may not fit in shared memory
                    print(f"  gemm {c} failed: {type(exc).__name__}", flush=True)
                    continue
                timed.append((us, c))
            timed.sort()
            print(f"sweep gemm K={k} N={n} M={m}: " + "  ".join(f"{c}={us:.1f}" for us, c in timed[:4]), flush=True)
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            timed = []
            for c in gemv_cands:
                us = time_graph(lambda i: ops._linear_triton_gemv(x, *tern[i % len(tern)], None, *c), len(tern), 5, 1)
                timed.append((us, c))
            timed.sort()
            print(f"sweep gemv K={k} N={n} M={m}: " + "  ".join(f"{c}={us:.1f}" for us, c in timed[:4]), flush=True)
        del tern
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200/bench_linear.json"))
    parser.add_argument("--ms", type=int, nargs="+", default=MS)
    parser.add_argument("--sweep", action="store_true", help="time candidate Triton configs instead")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_linear needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.inference_mode():
        if args.sweep:
            run_sweep(args)
            return 0
        args.out.parent.mkdir(parents=True, exist_ok=True)

        def save(report):
            args.out.write_text(json.dumps(report, indent=1) + "\n")

        save(run_bench(args, save))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
