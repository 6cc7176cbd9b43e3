"""Does the length of a timed CUDA graph change what a large-M call costs?

    python benchmarks/probe_sustained.py [--out benchmarks/results/h200/probe_sustained.json]

bench_linear.py captures R calls per graph, R from the bytes of one weight copy: cuBLAS bf16
on 1024->4096 replays 13 calls (1.2 ms at M = 8192), ternop 100 (10 ms). At large M both
are compute-bound GEMMs, and a GPU that lowers its clock under sustained load would make the
longer graph slower per call for reasons that have nothing to do with the kernel. This probe
times each implementation at both lengths (the shorter graph cycling fewer copies, the
longer one cycling its copies again), in the order short, long, long, short, and reads the SM
clock and power that NVML reports right after each timing, so that the two effects separate:

- the same implementation at two lengths: what the graph length alone costs;
- bf16 and ternop at the same length: the comparison bench_linear should make.

It also lists the GPU kernels of a few eager calls of each (torch.profiler), to see whether
cuBLAS picks the same GEMM for the dequantized weight as for the dense one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import ternop
from ternop import layouts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_linear import DTYPE, copies_for, make_weights, time_graph  # noqa: E402
from stamp import git_commit  # noqa: E402

SHAPES = [(1024, 4096), (3072, 1024), (4096, 4096), (4096, 14336)]
MS = [2048, 8192]


def gpu_state() -> dict:
    """SM clock (MHz), power (W) and temperature (C) as nvidia-smi reports them now."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        clock, power, temp = (v.strip() for v in out.split(","))
        return {"sm_mhz": float(clock), "power_w": float(power), "temp_c": float(temp)}
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return {}


def kernels(fn, calls: int = 5) -> list:
    """The GPU kernels of ``calls`` eager calls (name, count, mean us), from torch.profiler."""
    fn(0)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(i)
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.count:
            out.append({"name": e.key[:160], "count": e.count,
                        "mean_us": round(e.device_time_total / e.count, 2)})
    return sorted(out, key=lambda r: -r["mean_us"] * r["count"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200/probe_sustained.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_sustained needs a CUDA device", file=sys.stderr)
        return 2
    results = []
    with torch.inference_mode():
        ternop.linear(torch.zeros(1, 128, device="cuda", dtype=DTYPE), *make_weights(128, 128, 1)[0])
        for k, n in SHAPES:
            tern_copies = copies_for(n * k // 4 + 2 * n * (k // 128))
            dense_copies = copies_for(2 * n * k)
            base = make_weights(k, n, tern_copies)
            a16 = [(layouts.repack(p, "a16"), s) for p, s in base]
            dense = [ternop.dequantize(p, s, DTYPE) for p, s in base[:dense_copies]]
            for m in MS:
                x = torch.randn(m, k, device="cuda", dtype=DTYPE)
                fns = {
                    "cublas_bf16": lambda i: F.linear(x, dense[i % len(dense)]),
                    "ternop": lambda i: ternop.linear(x, *a16[i % len(a16)], layout="a16"),
                }
                order = [("cublas_bf16", dense_copies), ("cublas_bf16", tern_copies), ("ternop", tern_copies),
                         ("ternop", dense_copies), ("cublas_bf16", tern_copies), ("cublas_bf16", dense_copies)]
                row = {"K": k, "N": n, "M": m, "short_calls": dense_copies, "long_calls": tern_copies, "timings": []}
                for name, calls in order:
                    us = time_graph(fns[name], calls)
                    row["timings"].append({"impl": name, "calls": calls, "us": round(us, 3), **gpu_state()})
                try:
                    row["kernels"] = {name: kernels(fn) for name, fn in fns.items()}
                except Exception as exc:  # the timings above stand without the kernel list
                    row["kernels"] = f"{type(exc).__name__}: {exc}"
                results.append(row)
                t = {(r["impl"], r["calls"]): [] for r in row["timings"]}
                for r in row["timings"]:
                    t[(r["impl"], r["calls"])].append(r["us"])
                print(f"{k:6d}->{n:6d} M={m:5d} " + "  ".join(
                    f"{impl}x{calls}: {min(v):8.2f} us" for (impl, calls), v in t.items()), flush=True)
            del base, a16, dense
            torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    report = {
        "commit": git_commit(), "device": props.name, "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": "bench_linear's time_graph (CUDA-graph replays, median of 7 after 2 warm-ups) of R calls per "
                  "graph at two R: short = bf16's copy count, long = ternop's; order per cell: bf16 short, "
                  "bf16 long, ternop long, ternop short, bf16 long, bf16 short; nvidia-smi read after each",
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
