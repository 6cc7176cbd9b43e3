"""Times every tile of the mid-M and Hopper CUDA kernels against cuBLAS bf16.

    python benchmarks/sweep_tiles.py [--kernel mma_tiles|wgmma|wgmma_a8|wgmma_a8_row|mma|mma_a8|mma_a8_row|mma_a8_fused] [--out benchmarks/results/h200/sweep_tiles.json]

The kernel (``ternop/cuda/csrc/ternary_mma_tiles.cu``) has two tiles; ``auto_tile`` there
picks one by M, N and K, and ``ternop.cuda.configs`` gives the backend its M range. This sweep
is what both were chosen from (the committed ``sweep_tiles.json`` ran at a commit that still
had six tiles, 0-5; tiles 0 and 2 there are tiles 0 and 1 here): for each of bench_linear's eight shapes and each M, the time of
every tile (``tile:<i>``), of the kernel's own choice (``tile:auto``) and of cuBLAS bf16, with
bench_linear's method (CUDA-graph replays over weight copies rotated past the L2, all of a cell's
graphs taking turns in each round, a new order each round). Every tile's
output is first checked against ``F.linear`` on the dequantized weights (``max_rel_err``).

``--kernel wgmma`` does the same for the Hopper kernel (``ternop/cuda/csrc/ternary_wgmma.cu``,
tiles 0-7, ``WgTile0``-``WgTile7`` there; ``auto_wgmma_tile`` picks one), and ``--kernel wgmma_a8``
for its W2A8 form (``ternary_wgmma_a8.cu``, tiles 0 and 1, 64 and 128 tokens; each time includes
the per-token quantization of x, and the error is against bf16 ``F.linear`` on unquantized x);
``--kernel wgmma_a8_row`` times that kernel with one scale per weight row (``weight_scale`` [N, 1];
tiles 0-5, the last four for row scales only: 192 weight rows at 128 tokens, 256 at 64, and 128 at
128 and 256 with the weights decoded into shared memory, ``ternary_wgmma_a8_ss.cu``).

``--kernel mma`` and ``--kernel mma_a8`` time the small-M kernels (``ternary_mma.cu``,
``ternary_mma_a8.cu``; default ``--ms`` 1 4 8 12 16) with 1, 2, 4 and 8 sets of 16 weight
rows per CTA (``tile:<i>`` is 2^i sets; ``small_m_split`` in ``ternary_common.cuh`` picks for
``tile:auto``); ``mma_a8`` includes the per-token quantization of x (M <= 32), ``mma_a8_row`` is
the same with one scale per weight row (M <= 64, eight token tiles above 32), and ``--kernel mma_a8_fused``
times the form that quantizes x inside the kernel (``--ms`` 1 2 only). With ``--depths 2 4`` they
are also timed with four scale blocks of weight loads in flight a warp instead of two
(``tile:<i>:d4``, ``tile:auto:d4``; the result is the same bits at either depth).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import ternop
from ternop import layouts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_linear import DTYPE, _report, _shape_list, capture, copies_for, families, make_weights, time_interleaved  # noqa: E402

MS = [17, 32, 48, 64, 96, 128, 192, 256, 384, 512]
SMALL_MS = [1, 4, 8, 12, 16]
# kernel -> (op name, number of tiles, weight layout, one scale per row)
KERNELS = {
    "mma_tiles": ("linear_cuda_mma_tiles", 2, "a16", False),
    "wgmma": ("linear_cuda_wgmma", 8, "a16", False),
    "wgmma_a8": ("linear_cuda_wgmma_a8", 2, "a8", False),
    "wgmma_a8_row": ("linear_cuda_wgmma_a8", 6, "a8", True),
    "mma": ("linear_cuda_mma", 4, "a16", False),  # tile i: 2^i sets of 16 rows per CTA
    "mma_a8": ("linear_cuda_mma_a8", 4, "a8", False),
    "mma_a8_row": ("linear_cuda_mma_a8", 4, "a8", True),
    "mma_a8_fused": ("linear_cuda_mma_a8_fused", 4, "a8", False),  # M <= 2: quantizes x itself
}
# The small-M kernels: their tiles are set counts, and they also take a weight-load depth.
SMALL_KERNELS = ("mma", "mma_a8", "mma_a8_row", "mma_a8_fused")


def _caller(op, layout: str):
    """``f(x, packed, scale, tile, depth)`` for one kernel (``depth`` -1 or, for the small-M kernels, the
    scale blocks of weight loads in flight a warp); the W2A8 one times the per-token quantization of x
    with it, as the op pays it."""
    fused = op is torch.ops.ternop.linear_cuda_mma_a8_fused
    small = fused or op in (torch.ops.ternop.linear_cuda_mma, torch.ops.ternop.linear_cuda_mma_a8)

    def arg(tile):  # the small-M kernels take row_groups = 2^tile
        return 1 << tile if small and tile >= 0 else tile

    if fused:
        return lambda x, p, s, tile, depth: op(x, p, s, None, arg(tile), depth)
    if layout != "a8":
        if small:
            return lambda x, p, s, tile, depth: op(x, p, s, None, True, arg(tile), depth)
        return lambda x, p, s, tile, depth: op(x, p, s, None, tile)
    from ternop.cuda.launch_fused import quantize_rows

    def call(x, p, s, tile, depth):
        q, qs = quantize_rows(x)
        if small:
            return op(q, qs, p, s, None, x.dtype, arg(tile), depth)
        return op(q, qs, p, s, None, x.dtype, tile)

    return call


def run(ms, out_path: Path, kernel: str = "mma_tiles", shapes=None, depths=(2,)) -> dict:
    ternop.linear(torch.zeros(1, 128, device="cuda", dtype=DTYPE), *make_weights(128, 128, 1)[0])
    op_name, tiles, layout, row_scales = KERNELS[kernel]
    call = _caller(getattr(torch.ops.ternop, op_name), layout)
    results = []
    for family, family_shapes in families(shapes).items():
        for k, n in family_shapes:
            base = make_weights(k, n, copies_for(n * k // 4 + 2 * n * (k // 128)))
            if row_scales:  # every block of a row takes the row's first scale; the kernel reads [N, 1]
                base = [(p, s[:, :1].expand(-1, k // 128).contiguous()) for p, s in base]
            packed = [(layouts.repack(p, layout), s[:, :1].contiguous() if row_scales else s) for p, s in base]
            dense = [ternop.dequantize(p, s, DTYPE) for p, s in base[: copies_for(2 * n * k)]]
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=DTYPE)
                ref = F.linear(x, dense[0]).float()
                calls = max(len(dense), len(packed))
                graphs = {"cublas_bf16": capture(lambda i: F.linear(x, dense[i % len(dense)]), calls)}
                errs = {}
                runs = [(tile, -1, "") for tile in (*range(tiles), -1)]
                if kernel in SMALL_KERNELS:
                    runs += [(tile, d, f":d{d}") for d in depths if d != 2 for tile in (*range(tiles), -1)]
                for tile, depth, tag in runs:
                    name = f"tile:{tile if tile >= 0 else 'auto'}{tag}"
                    y = call(x, *packed[0], tile, depth).float()
                    errs[name] = float((y - ref).norm() / ref.norm())
                    graphs[name] = capture(lambda i, t=tile, d=depth: call(x, *packed[i % len(packed)], t, d), calls)
                # Taking turns, as bench_linear's implementations do: timed one after another, the
                # same kernel under two names (a tile and the auto pick of it) read up to 10% apart.
                row = time_interleaved(graphs, calls)
                del graphs
                base_us = row["cublas_bf16"]
                for name, us in row.items():
                    results.append({
                        "family": family, "K": k, "N": n, "M": m, "impl": name, "us": round(us, 3),
                        "speedup_vs_bf16": round(base_us / us, 3), "max_rel_err": errs.get(name),
                        "TFLOPs": round(2 * m * n * k / us / 1e6, 2),
                    })
                best = max((base_us / us, name) for name, us in row.items() if name.startswith("tile:"))
                print(f"{family:5s} {k:6d}->{n:6d} M={m:4d} bf16 {base_us:8.2f} us  "
                      + " ".join(f"{name[5:]}:x{base_us / us:4.2f}" for name, us in row.items() if name != "cublas_bf16")
                      + f"  best {best[1][5:]} x{best[0]:4.2f}  max err {max(errs.values()):.2e}", flush=True)
            del base, packed, dense
            torch.cuda.empty_cache()
            out_path.write_text(json.dumps(_report(results, complete=False), indent=1) + "\n")
    return _report(results, complete=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200/sweep_tiles.json"))
    parser.add_argument("--ms", type=int, nargs="+", default=None, help=f"default {MS}; mma, mma_a8, mma_a8_row: {SMALL_MS}; mma_a8_fused: 1 2")
    parser.add_argument("--shapes", type=_shape_list, default=None,
                        help="only these K->N shapes, e.g. 4096x14336,1024x4096")
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="mma_tiles")
    parser.add_argument("--depths", type=int, nargs="+", default=[2],
                        help="mma, mma_a8, mma_a8_row: weight-load depths to time (2 is the default kernel; 4 the deep one)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_tiles needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        ms = args.ms or ([1, 2] if args.kernel == "mma_a8_fused"
                         else SMALL_MS if args.kernel in SMALL_KERNELS else MS)
        report = run(ms, args.out, args.kernel, args.shapes, args.depths)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
