"""Drive one ternop.linear backend on one shape, for Nsight Compute (ncu) to profile.

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats -k regex:ternary \
        python benchmarks/ncu_linear.py --backend cuda_mma --m 1 --k 4096 --n 14336 [--layout a16] \
        [--activation-bits 8] [--row-scales]

`--backend cublas` runs the dense bf16 `F.linear` of the same shape instead (profile it with
`-k regex:'nvjet|gemm'`), so that ternop's kernel and the one it is measured against are
profiled alike.

ncu flushes the caches before each profiled launch, so weights come from HBM as in serving.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True,
                        help="value for TERNOP_BACKEND, or 'cublas' for the dense bf16 F.linear of the shape")
    parser.add_argument("--m", type=int, nargs="+", default=[1])
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=14336)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--layout", default="v1",
                        help="weight layout to repack into (a16 for cuda_mma_tiles and cuda_wgmma, a8 for int8 x)")
    parser.add_argument("--activation-bits", type=int, choices=(8, 16), default=16)
    parser.add_argument("--row-scales", action="store_true", help="one weight scale per row (weight_scale [N, 1])")
    args = parser.parse_args(argv)
    if args.backend == "cublas":
        return _dense(args)
    os.environ["TERNOP_BACKEND"] = args.backend
    import ternop
    from ternop import layouts

    g = torch.Generator(device="cuda").manual_seed(0)
    codes = torch.randint(0, 3, (args.n, args.k // 4, 4), device="cuda", dtype=torch.uint8, generator=g)
    packed = codes[..., 0] | codes[..., 1] << 2 | codes[..., 2] << 4 | codes[..., 3] << 6
    packed = layouts.repack(packed, args.layout)
    scale = torch.full((args.n, 1 if args.row_scales else args.k // 128), 0.01, device="cuda", dtype=torch.float16)
    for m in args.m:
        x = torch.randn(m, args.k, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(args.calls):
            ternop.linear(x, packed, scale, layout=args.layout, activation_bits=args.activation_bits)
    torch.cuda.synchronize()
    return 0


def _dense(args) -> int:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16, generator=g)
    for m in args.m:
        x = torch.randn(m, args.k, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(args.calls):
            torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
