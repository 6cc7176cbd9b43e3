"""Host time of one eager ``ternop.linear`` call against one dense bf16 ``F.linear`` call.

    python benchmarks/probe_host_call.py [--out benchmarks/results/h200/probe_host_call.json] [--a8]

Above 512 tokens vLLM runs its compiled pieces without CUDA graphs, so every ternary linear
goes through the dispatcher, ternop's Python entry (checks, the registry's cached choice) and
the backend's C++ op on every step, where a bf16 linear is one cuBLAS call from Inductor's code.
Embedding throughput in vLLM is partly host-bound, so this host time per call, times the 112
linears of the Qwen3-0.6B-shaped embedder, bounds what the ternary op's own host work can cost
per engine step (docs/VLLM_SPEED.md).

Method: for each of the embedder's four layer shapes and M, ``calls`` back-to-back calls are
issued and the host's wall time of the loop is taken before synchronizing; the GPU is idle at
the start of each loop and ``calls`` stays far below the launch queue's depth, so the loop
measures issue time, not kernel time (``gpu_us`` is the kernel time, from CUDA events, for
comparison: where host time exceeds it, the host would be the bottleneck). Median of five loops.
The weights are shared across calls (the host time does not depend on them). Each call is also
timed in pieces: ``entry_host_us`` calls ternop's Python entry directly (without the
dispatcher's hop into Python), ``backend_host_us`` the chosen backend's ``run`` alone. So the
hop is ``ternop - entry``, the entry's own Python ``entry - backend``, and ``backend - bf16``
what the backend's launches cost beyond one cuBLAS call. ``select_host_us`` is the registry's
cached choice alone. With ``--a8`` the call is the one a vLLM int8 embedding engine makes, x
already quantized in the compiled graph: ``ternop::linear_q8`` on a8 codes with a scale per row;
where its backend is ``dequant_a8`` (two Triton launches), ``decode_host_us`` is the first launch
(decoding the codes to int8) alone. ``--all-backends`` also times every backend that can run the
call when forced (``TERNOP_BACKEND``), host and GPU (``by_backend``): what each would cost a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import ternop
from ternop import backends, layouts
from ternop import ops as ternop_ops
from ternop.activations import quantize_rows
from ternop.format import pack_codes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stamp import git_commit  # noqa: E402

SHAPES = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)]  # the embedder's qkv, o, gate_up, down
MS = [16, 128, 2048, 16384]


def host_and_gpu_us(fn, calls: int, repeats: int = 5) -> tuple[float, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t0) * 1e6 / calls)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(host), statistics.median(gpu)


def by_backend(call: backends.LinearCall, calls: int) -> dict[str, dict[str, float]]:
    """{backend: {"host_us", "gpu_us"}} for every backend of x's device that can run ``call`` when
    forced (some only take a call that way), each timed through its ``run``."""
    out = {}
    for backend in backends.available(call.x.device.type):
        with backends.forcing(backend.name):
            ok, _ = backend.can_implement(call)
            if ok:
                host, gpu = host_and_gpu_us(lambda b=backend: b.run(call), calls)
                out[backend.name] = {"host_us": host, "gpu_us": gpu}
    print("    by backend (host / gpu us): "
          + ", ".join(f"{name} {t['host_us']:.1f} / {t['gpu_us']:.1f}" for name, t in out.items()), flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200/probe_host_call.json"))
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--ms", type=int, nargs="+", default=MS, help="token counts (default: %(default)s)")
    parser.add_argument("--a8", action="store_true",
                        help="time ternop::linear_q8 (int8 rows, a8 codes, a scale per row) instead")
    parser.add_argument("--all-backends", action="store_true", help="also time each backend that can run the call")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_host_call needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    with torch.inference_mode():
        for k, n in SHAPES:
            codes = torch.randint(0, 3, (n, k), generator=gen, dtype=torch.uint8)
            packed_v1 = pack_codes(codes).to(dev)
            layout = "a8" if args.a8 else "a16"
            packed = layouts.repack(packed_v1, layout)
            scale = torch.rand(n, 1 if args.a8 else k // 128, generator=gen).to(torch.float16).to(dev) + 0.5
            dense = ternop.dequantize(packed_v1, scale.expand(n, k // 128), dtype=dtype)
            for m in args.ms:
                x = torch.randn(m, k, generator=gen).to(dtype).to(dev)
                if args.a8:
                    q, qs = quantize_rows(x)
                    op = lambda: torch.ops.ternop.linear_q8(q, qs, packed, scale, None, dtype, layout)  # noqa: E731
                    entry = lambda: ternop_ops._linear_q8_impl(q, qs, packed, scale, None, dtype, layout)  # noqa: E731
                    call = backends.LinearCall(q, packed, scale, None, 8, layout, qs, dtype)
                else:
                    op = lambda: ternop.linear(x, packed, scale, layout=layout)  # noqa: E731
                    entry = lambda: ternop_ops._linear_impl(x, packed, scale, None, 16, layout)  # noqa: E731
                    call = backends.LinearCall(x, packed, scale, None, 16, layout)
                t_host, t_gpu = host_and_gpu_us(op, args.calls)
                d_host, d_gpu = host_and_gpu_us(lambda: F.linear(x, dense), args.calls)
                # The same call in pieces: ternop's Python entry without the dispatcher's hop into
                # it, the registry's choice, and the chosen backend alone (for the C++ backends,
                # its C++ op and launches).
                impl_host, _ = host_and_gpu_us(entry, args.calls)
                backend = backends.select(call)
                s_host, _ = host_and_gpu_us(lambda: backends.select(call), args.calls)
                b_host, _ = host_and_gpu_us(lambda: backend.run(call), args.calls)
                row = {"K": k, "N": n, "M": m, "ternop_host_us": t_host, "ternop_gpu_us": t_gpu,
                       "bf16_host_us": d_host, "bf16_gpu_us": d_gpu, "backend": backend.name,
                       "entry_host_us": impl_host, "select_host_us": s_host, "backend_host_us": b_host}  # fmt: skip
                if backend.name == "dequant_a8":
                    from ternop.cuda.launch_dequant_a8 import decode_int8

                    row["decode_host_us"], _ = host_and_gpu_us(lambda: decode_int8(packed, layout), args.calls)
                if args.all_backends:
                    row["by_backend"] = by_backend(call, args.calls)
                rows.append(row)
                print(f"{k:5d}->{n:5d} M={m:6d}  host us: ternop {t_host:6.1f} (entry {impl_host:6.1f}, "
                      f"select {s_host:5.1f}, {backend.name} {b_host:6.1f}"
                      + (f", its decode {row['decode_host_us']:5.1f}" if "decode_host_us" in row else "")
                      + f")  bf16 {d_host:6.1f}   gpu us: ternop {t_gpu:7.1f}  bf16 {d_gpu:7.1f}", flush=True)
    report = {"commit": git_commit(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "method": __doc__.split("Method: ", 1)[1].strip(), "calls": args.calls, "ms": args.ms,
              "call": "linear_q8, a8, row scales" if args.a8 else "linear, a16, block scales", "results": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
