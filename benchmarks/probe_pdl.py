"""Programmatic dependent launch (PDL) for `cuda_wgmma`: the same calls with and without it, beside
cuBLAS bf16, back to back and with a small kernel between calls.

    python benchmarks/probe_pdl.py [--out OUT]

Each cell times CUDA graphs of R calls on R rotated weight copies (as bench_linear.py does):
`cublas` (F.linear), `wgmma` (the `cuda_wgmma` backend, forced; TERNOP_WGMMA_PDL=0 at capture)
and `wgmma_pdl` (programmatic launches); the `_gap` rows put a one-block elementwise kernel
before every call, as a norm or an activation stands before each linear in a model. Back to
back, a kernel launched programmatically can start while the one ahead finishes; after an
ordinary kernel it cannot start earlier than that kernel's end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_linear as bl  # noqa: E402
from stamp import git_commit  # noqa: E402

import ternop  # noqa: E402
from ternop import backends, layouts  # noqa: E402

CELLS = [(1024, 4096, m) for m in (64, 128, 256, 512)] + [(1024, 6144, m) for m in (64, 128, 256, 512)] + [
    (2048, 1024, m) for m in (64, 128, 256, 512)] + [(3072, 1024, m) for m in (64, 128, 256, 512)] + [
    (4096, 4096, 128), (4096, 4096, 512), (4096, 14336, 128), (4096, 14336, 512)]


def wgmma_backend():
    for b in backends.available("cuda"):
        if b.name == "cuda_wgmma":
            return b
    raise SystemExit("cuda_wgmma is not available on this device or build")


def capture_with(env: str, fn, calls: int):
    saved = os.environ.get("TERNOP_WGMMA_PDL")
    os.environ["TERNOP_WGMMA_PDL"] = env
    try:
        return bl.capture(fn, calls)
    finally:
        if saved is None:
            del os.environ["TERNOP_WGMMA_PDL"]
        else:
            os.environ["TERNOP_WGMMA_PDL"] = saved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200/probe_pdl.json"))
    args = parser.parse_args(argv)
    ternop.linear(torch.zeros(1, 128, device="cuda", dtype=bl.DTYPE), *bl.make_weights(128, 128, 1)[0])  # loads backends
    b = wgmma_backend()
    gap = torch.zeros(256, device="cuda", dtype=torch.float32)
    rows = []
    t0 = time.time()
    for k, n, m in CELLS:
        tern_bytes = n * k // 4 + 2 * n * (k // 128)
        base = bl.make_weights(k, n, bl.copies_for(tern_bytes))
        a16 = [(layouts.repack(p, "a16"), s) for p, s in base]
        dense = [ternop.dequantize(p, s, bl.DTYPE) for p, s in base[: bl.copies_for(2 * n * k)]]
        x = torch.randn(m, k, device="cuda", dtype=bl.DTYPE)
        calls = max(len(a16), len(dense))

        def dense_fn(i, with_gap=False):
            if with_gap:
                gap.add_(1.0)
            return F.linear(x, dense[i % len(dense)])

        def wg_fn(i, with_gap=False):
            if with_gap:
                gap.add_(1.0)
            return b.run(backends.LinearCall(x, *a16[i % len(a16)], None, 16, "a16"))

        graphs = {
            "cublas": capture_with("0", lambda i: dense_fn(i), calls),
            "cublas_gap": capture_with("0", lambda i: dense_fn(i, True), calls),
            "wgmma": capture_with("0", lambda i: wg_fn(i), calls),
            "wgmma_pdl": capture_with("1", lambda i: wg_fn(i), calls),
            "wgmma_gap": capture_with("0", lambda i: wg_fn(i, True), calls),
            "wgmma_pdl_gap": capture_with("1", lambda i: wg_fn(i, True), calls),
        }
        us = bl.time_interleaved(graphs, calls)
        ref = ternop.dequantize(*base[0], torch.float32)
        got = b.run(backends.LinearCall(x, *a16[0], None, 16, "a16")).float()
        err = ((got - x.float() @ ref.t()).abs().max() / (x.float() @ ref.t()).abs().max()).item()
        row = {"K": k, "N": n, "M": m, "calls": calls, "us": us, "max_rel_err": err,
               "wgmma_vs_cublas": us["cublas"] / us["wgmma"], "wgmma_pdl_vs_cublas": us["cublas"] / us["wgmma_pdl"],
               "gap_wgmma_vs_cublas": us["cublas_gap"] / us["wgmma_gap"],
               "gap_wgmma_pdl_vs_cublas": us["cublas_gap"] / us["wgmma_pdl_gap"]}
        rows.append(row)
        print(f"{k:5d}->{n:5d} M={m:4d}  " + "  ".join(f"{name} {t:7.2f}" for name, t in us.items())
              + f"  | x{row['wgmma_vs_cublas']:.2f} pdl x{row['wgmma_pdl_vs_cublas']:.2f}"
              + f"  gap: x{row['gap_wgmma_vs_cublas']:.2f} pdl x{row['gap_wgmma_pdl_vs_cublas']:.2f}  err {err:.1e}",
              flush=True)
        del graphs, base, a16, dense
    report = {"commit": git_commit(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "method": __doc__, "seconds": round(time.time() - t0, 1), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
