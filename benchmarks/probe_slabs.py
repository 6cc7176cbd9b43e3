"""Every token-slab size of the small-M kernels, forced, beside cuBLAS bf16: where should slabs start?

    python benchmarks/probe_slabs.py [--out benchmarks/results/h100/probe_slabs.json]
        [--shapes 1024x4096,...] [--ms 9 12 16 65 80 96 128] [--row-groups -1 1 2 4 8]

The dispatcher's slab rules (``configs.mma_slab``, ``configs.mma_a8_slab``) were picked from forced
runs at M = 24..128. This calls the two C++ ops directly (``linear_cuda_mma`` over a16 weights,
``linear_cuda_mma_a8`` over row scales) with every slab each takes at each M: 0 (one CTA column
over all of M, where the kernel has a form for M), 8, 16 and, for int8, 32. The int8 rows are
quantized once beforehand, so their times are the GEMM's alone. ``--row-groups`` also sweeps the sets
of 16 weight rows a CTA owns (-1: the kernel's choice, which fills the GPU at one slab; a slabbed
launch has several times the CTAs, so more sets a CTA, sharing x, may pay there); each set count is
then an implementation of its own (``a16_slab16_r2``). Each (shape, M) captures one CUDA
graph per implementation over rotated weight copies (past the L2) and times them taking turns,
as bench_linear does; speed-ups are against cuBLAS bf16 in the same rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import ternop  # noqa: F401  (registers the ops)
from ternop import layouts
from ternop.activations import quantize_rows
from ternop.cuda import registry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_linear import DTYPE, _shape_list, capture, copies_for, dequant, make_weights, time_interleaved  # noqa: E402
from stamp import git_commit  # noqa: E402

SHAPES = [(1024, 4096), (1024, 6144), (2048, 1024), (3072, 1024), (4096, 4096)]
MS = [9, 12, 16, 65, 80, 96, 128]


def slabs(mode: str, m: int) -> list[int]:
    """The slabs the op takes at M: 0 only where one CTA column has a form for M."""
    one_column = m <= (registry.CUDA_MMA_MAX_M if mode == "a16" else registry.CUDA_MMA_A8_ROW_MAX_M)
    sizes = [8, 16] if mode == "a16" else [8, 16, 32]
    return ([0] if one_column else []) + [s for s in sizes if s < m]


def probe(k: int, n: int, m: int, row_groups=(-1,)) -> list[dict]:
    copies = copies_for(n * k * 2)
    weights = make_weights(k, n, copies)
    shifts = torch.arange(0, 8, 2, device="cuda", dtype=torch.uint8)
    dense = [dequant(p, s, shifts) for p, s in weights]
    a16 = [(layouts.repack(p, "a16"), s) for p, s in weights]
    a8 = [(layouts.repack(p, "a8"), s[:, :1].contiguous()) for p, s in weights]
    x = torch.randn(m, k, device="cuda", dtype=DTYPE)
    q, qs = quantize_rows(x)
    fns = {"cublas_bf16": lambda i: F.linear(x, dense[i % copies])}
    for r in row_groups:
        tag = "" if r == -1 else f"_r{r}"
        for slab in slabs("a16", m):
            fns[f"a16_slab{slab}{tag}"] = (lambda s, r: lambda i: torch.ops.ternop.linear_cuda_mma(
                x, *a16[i % copies], None, True, r, -1, s))(slab, r)
        for slab in slabs("a8", m):
            fns[f"a8row_slab{slab}{tag}"] = (lambda s, r: lambda i: torch.ops.ternop.linear_cuda_mma_a8(
                q, qs, *a8[i % copies], None, DTYPE, r, -1, s))(slab, r)
    graphs = {name: capture(fn, copies) for name, fn in fns.items()}
    us = time_interleaved(graphs, copies)
    return [{"K": k, "N": n, "M": m, "impl": name, "us": round(t, 3),
             "speedup_vs_bf16": round(us["cublas_bf16"] / t, 3)} for name, t in us.items()]  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h100/probe_slabs.json"))
    parser.add_argument("--shapes", type=_shape_list, default=SHAPES)
    parser.add_argument("--ms", type=int, nargs="+", default=MS)
    parser.add_argument("--row-groups", type=int, nargs="+", default=[-1], choices=[-1, 1, 2, 4, 8],
                        help="sets of 16 weight rows a CTA: -1 the kernel's choice (default), or 1, 2, 4, 8")
    args = parser.parse_args(argv)
    from ternop.cuda import cuda_ext

    ok, why = cuda_ext.load()  # the C++ ops' CUDA kernels (built on first use)
    if not ok:
        raise SystemExit(f"the CUDA extension did not load: {why}")
    results = []
    for k, n in args.shapes:
        for m in args.ms:
            rows = probe(k, n, m, args.row_groups)
            results += rows
            print(f"{k:5d}->{n:5d} M={m:4d} " + "  ".join(f"{r['impl']} x{r['speedup_vs_bf16']:.2f}" for r in rows),
                  flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "commit": git_commit(), "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": "CUDA-graph replays over rotated weight copies (> 2x the L2), implementations taking turns in "
                  "shuffled rounds (bench_linear.time_interleaved), median of 7; int8 rows quantized beforehand",
        "results": results}, indent=1) + "\n")  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
