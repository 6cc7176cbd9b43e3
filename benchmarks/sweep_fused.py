"""Offline tuning of the fused kernels' static tables (ternop/cuda/configs.py) on a GPU.

    python benchmarks/sweep_fused.py --out benchmarks/results/h200/sweep_fused.json [--quick]

First a correctness pass: every kernel variant the sweep times (fp16/bf16 x, every layout,
int8 activations, swap, split-K, strided bias, odd sizes) against the CPU reference,
and the inline-asm decoders against the plain ones, bit for bit. Then, per shape and M,
every candidate tile of ``triton_a16`` (layouts v1 and a16) and ``triton_a8``, beside
cuBLAS bf16 and dequantize-then-cuBLAS, timed as bench_linear times everything (CUDA-graph
replays over weight copies rotated past the L2). The JSON holds every timing; the printed
table the best tile per (shape, M, kernel). Also reports the host time of one eager call.
``--shapes`` and ``--ms`` take a subset, ``--a8-only`` leaves out the 16-bit candidates, and
``--a8-row`` adds the int8 candidates with one scale per weight row (``a8[a8 row]``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ternop  # noqa: E402
from stamp import git_commit  # noqa: E402
from bench_linear import DTYPE, _shape_list, copies_for, families, make_weights, time_graph  # noqa: E402
from ternop import layouts  # noqa: E402
from ternop.backends import LinearCall  # noqa: E402
from ternop.cpu import _linear_cpu  # noqa: E402
from ternop.cuda import cuda_ext, launch_fused, launch_triton  # noqa: E402
from ternop.cuda.configs import FusedConfig, sm_count, split_k  # noqa: E402

C = FusedConfig

A16_CANDIDATES = {
    16: [C(16, 64, 4, 4, max_split_k=8), C(16, 128, 4, 4, max_split_k=8), C(16, 64, 4, 6, max_split_k=8),
         C(16, 128, 4, 4, swap=True, max_split_k=8)],
    32: [C(32, 64, 4, 4, max_split_k=8), C(32, 128, 4, 4, max_split_k=8), C(32, 128, 4, 4, swap=True, max_split_k=8)],
    64: [C(64, 64, 4, 3, max_split_k=8), C(64, 128, 4, 3, max_split_k=8), C(64, 128, 4, 4, max_split_k=8),
         C(64, 128, 4, 3, swap=True, max_split_k=8)],
    128: [C(128, 64, 4, 3, max_split_k=4), C(64, 128, 4, 3, max_split_k=4), C(128, 128, 8, 3, max_split_k=4),
          C(64, 64, 4, 3, max_split_k=8)],
    512: [C(128, 64, 4, 3, max_split_k=2), C(128, 128, 8, 3, max_split_k=2), C(64, 128, 4, 3, max_split_k=4),
          C(128, 128, 4, 2, max_split_k=2)],
    2048: [C(128, 128, 8, 3), C(128, 256, 8, 3), C(128, 64, 4, 3)],
}
A8_CANDIDATES = {
    16: [C(16, 64, 4, 4, max_split_k=8), C(16, 128, 4, 4, max_split_k=8), C(16, 64, 4, 6, max_split_k=8)],
    32: [C(32, 64, 4, 4, max_split_k=8), C(32, 128, 4, 4, max_split_k=8)],
    64: [C(64, 64, 4, 3, max_split_k=8), C(64, 128, 4, 3, max_split_k=8), C(64, 64, 4, 4, max_split_k=8)],
    128: [C(128, 64, 4, 3, max_split_k=4), C(64, 128, 4, 3, max_split_k=4), C(64, 64, 4, 3, max_split_k=8)],
    512: [C(128, 64, 4, 3, max_split_k=2), C(128, 128, 8, 3, max_split_k=2), C(64, 128, 4, 3, max_split_k=4),
          C(256, 64, 8, 3, max_split_k=2), C(128, 64, 4, 3), C(64, 64, 4, 3), C(64, 64, 4, 4, max_split_k=2),
          C(128, 64, 4, 4), C(128, 64, 8, 3)],
    2048: [C(128, 64, 4, 3), C(128, 128, 8, 3), C(256, 64, 8, 3)],
}
# Layout v1 is timed only on the first candidate of a bucket: it answers whether the a16
# layout pays; the tile choice is made on a16.
MS = [1, 16, 32, 64, 128, 256, 512]


def candidates(table: dict, m: int):
    for bound in sorted(table):
        if m <= bound:
            return table[bound]
    return table[max(table)]


# --- correctness ------------------------------------------------------------------------------


def _ref(x, packed, scale, bias, bits, layout):
    return _linear_cpu(LinearCall(x.cpu(), packed.cpu(), scale.cpu(), None if bias is None else bias.cpu(), bits, layout))


def _rel(y, ref):
    return float((y.float().cpu() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def correctness() -> list[dict]:
    """Every variant against the CPU reference; the asm decoders against the plain ones, bitwise."""
    rows = []
    g = torch.Generator().manual_seed(0)
    cases = [(1, 128, 64), (5, 384, 136), (17, 4096, 520), (129, 1024, 1152), (300, 3072, 256)]
    configs = [C(16, 64, 4, 4), C(64, 128, 4, 3, swap=True, max_split_k=4), C(128, 128, 8, 3)]
    for m, k, n in cases:
        codes = torch.randint(0, 4, (n, k), generator=g, dtype=torch.uint8)
        v1 = ternop.pack_codes(codes)
        scale = (torch.rand((n, k // 128), generator=g) * 0.1 + 0.01).half()
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.randn((m, 2 * k), generator=g).to(dtype)[:, :k]  # strided rows
            bias = torch.randn(2 * n, generator=g).to(dtype)[::2]  # strided bias
            for layout in layouts.LAYOUTS:
                packed = layouts.repack(v1, layout).cuda()
                xs, sc, bs = x.cuda(), scale.cuda(), bias.cuda()
                for bits in (16, 8):
                    ref = _ref(x, packed, scale, bias, bits, layout)
                    for cfg in configs:
                        if bits == 16:
                            y = launch_fused.linear_a16(xs, packed, sc, bs, layout, cfg)
                        else:
                            y = launch_fused.linear_a8(xs, packed, sc, bs, layout, cfg)
                        err = _rel(y, ref)
                        tol = 1e-2 if (bits == 8 or dtype == torch.bfloat16) else 2e-3
                        rows.append(dict(m=m, k=k, n=n, dtype=str(dtype), layout=layout, bits=bits,
                                         config=cfg.__dict__, rel_err=err, ok=bool(err < tol and y.isfinite().all())))
    # bf16 fused GEMM: the decoded weights equal ternop.dequantize's bf16 rounding, so its
    # error must match F.linear on the dequantized weights within the 2x rule.
    return rows


def asm_matches_plain() -> list[dict]:
    """The inline-asm decoders against the plain decoders, bit for bit (same kernel, USE_ASM toggled)."""
    from ternop.cuda.triton_fused import fused_a8_kernel, fused_a16_kernel

    out = []
    g = torch.Generator().manual_seed(1)
    m, k, n = 96, 1024, 384
    codes = torch.randint(0, 4, (n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand((n, k // 128), generator=g) * 0.1 + 0.01).half().cuda()
    for layout, code in launch_fused.LAYOUT_CODES.items():
        w = layouts.repack(ternop.pack_codes(codes), layout).cuda().view(torch.int32)
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.randn((m, k), generator=g).to(dtype).cuda()
            res = []
            for use_asm in (True, False):
                y = torch.empty((m, n), dtype=dtype, device="cuda")
                fused_a16_kernel[(2 * 3, 1)](x, w, scale, x, y, y, m, n, k, x.stride(0), w.stride(0), scale.stride(0),
                                           0, y.stride(0), LAYOUT=code, HAS_BIAS=False, USE_ASM=use_asm, SWAP=False,
                                           SPLIT_K=1, BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=3)
                res.append(y)
            out.append(dict(kernel="a16", layout=layout, dtype=str(dtype), bitwise_equal=bool(torch.equal(*res))))
        q, qs = launch_fused.quantize_rows(torch.randn((m, k), generator=g).cuda())
        res = []
        for use_asm in (True, False):
            y = torch.empty((m, n), dtype=torch.float32, device="cuda")
            fused_a8_kernel[(2 * 3, 1)](q, qs, w, scale, y, y, y, m, n, k, q.stride(0), w.stride(0), scale.stride(0),
                                      0, y.stride(0), LAYOUT=code, HAS_BIAS=False, USE_ASM=use_asm, SPLIT_K=1,
                                      BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=3)
            res.append(y)
        out.append(dict(kernel="a8", layout=layout, bitwise_equal=bool(torch.equal(*res))))
    # quantization: kernel against the CPU reference, bit for bit
    x = torch.randn((37, 4096), generator=g) * 3
    q, qs = launch_fused.quantize_rows(x.cuda())
    from ternop.activations import quantize_rows

    q2, qs2 = quantize_rows(x)
    out.append(dict(kernel="quantize_rows", q_equal=bool(torch.equal(q.cpu(), q2)), scale_equal=bool(torch.equal(qs.cpu(), qs2)),
                    q_mismatches=int((q.cpu() != q2).sum())))
    return out


# --- timing -----------------------------------------------------------------------------------


def host_overhead() -> dict:
    """Microseconds of host time per eager call (tiny shapes, the GPU idles)."""
    res = {}
    x = torch.randn(4, 1024, device="cuda", dtype=DTYPE)
    w, s = make_weights(1024, 1024, 1)[0]
    dense = torch.randn(1024, 1024, device="cuda", dtype=DTYPE)
    wa16, wa8 = layouts.repack(w, "a16"), layouts.repack(w, "a8")
    fns = {
        "F.linear": lambda: F.linear(x, dense),
        "ternop.linear a16 (dispatcher)": lambda: ternop.linear(x, wa16, s, layout="a16"),
        "ternop.linear a8 (dispatcher)": lambda: ternop.linear(x, wa8, s, activation_bits=8, layout="a8"),
        "launch_fused.linear_a16 (no dispatcher)": lambda: launch_fused.linear_a16(x, wa16, s, None, "a16", C(16, 64)),
    }
    for name, fn in fns.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(500):
            fn()
        torch.cuda.synchronize()
        res[name] = round((time.perf_counter() - t) / 500 * 1e6, 2)
    return res


def sweep(ms, shapes, rows: list, save, a8_only: bool = False, a8_row: bool = False) -> list[dict]:
    """Appends to ``rows`` and calls ``save()`` after every shape (a cut-off run keeps what it timed).
    ``a8_only``: only the int8 candidates (and cuBLAS); ``a8_row``: also time them with one scale per
    weight row (``weight_scale`` [N, 1], each row's first block scale), as ``a8[a8 row]``."""
    for family, k, n in shapes:
        tern_bytes = n * k // 4 + 2 * n * (k // 128)
        base = make_weights(k, n, copies_for(tern_bytes))
        dense = [ternop.dequantize(p, s, DTYPE) for p, s in base[: copies_for(2 * n * k)]]
        per_layout = {lay: [(layouts.repack(p, lay), s) for p, s in base] for lay in ("v1", "a16", "a8")}
        a8_rows = [(p, s[:, :1].contiguous()) for p, s in per_layout["a8"]]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            timed = {"cublas_bf16": time_graph(lambda i: F.linear(x, dense[i % len(dense)]), len(dense))}
            if m >= 256 and not a8_only:
                timed["dequant_cublas"] = time_graph(
                    lambda i: launch_triton.linear_dequant_cublas(x, *per_layout["a16"][i % len(base)], None, "a16", 32, 512),
                    len(base))
            cands = []
            for j, cfg in enumerate([] if a8_only else candidates(A16_CANDIDATES, m)):
                for lay in (("v1", "a16") if j == 0 else ("a16",)):
                    cands.append((f"a16[{lay}]", cfg, lambda i, c=cfg, l=lay: launch_fused.linear_a16(
                        x, *per_layout[l][i % len(base)], None, l, c)))
            for cfg in candidates(A8_CANDIDATES, m):
                cands.append(("a8[a8]", cfg, lambda i, c=cfg: launch_fused.linear_a8(x, *per_layout["a8"][i % len(base)], None, "a8", c)))
                if a8_row:
                    cands.append(("a8[a8 row]", cfg,
                                  lambda i, c=cfg: launch_fused.linear_a8(x, *a8_rows[i % len(base)], None, "a8", c)))
            if m <= 16 and not a8_only and cuda_ext.load()[0]:
                q, qs = launch_fused.quantize_rows(x)
                timed["cuda_mma[v1]"] = time_graph(
                    lambda i: torch.ops.ternop.linear_cuda_mma(x, *per_layout["v1"][i % len(base)], None, False), len(base))
                timed["cuda_mma[a16]"] = time_graph(
                    lambda i: torch.ops.ternop.linear_cuda_mma(x, *per_layout["a16"][i % len(base)], None, True), len(base))
                timed["cuda_mma_a8[a8] (no quant)"] = time_graph(
                    lambda i: torch.ops.ternop.linear_cuda_mma_a8(q, qs, *per_layout["a8"][i % len(base)], None, DTYPE),
                    len(base))
                timed["cuda_mma_a8[a8]"] = time_graph(
                    lambda i: torch.ops.ternop.linear_cuda_mma_a8(*launch_fused.quantize_rows(x),
                                                                  *per_layout["a8"][i % len(base)], None, DTYPE),
                    len(base))
            timed["quantize_rows"] = time_graph(lambda i: launch_fused.quantize_rows(x), len(base))
            for kind, cfg, fn in cands:
                try:
                    us = time_graph(fn, len(base), replays=5, warmup=1)
                except Exception as exc:  # a tile may not fit
                    print(f"  {kind} {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
                splits = split_k(tiles, k // 128, sm_count(x.device), cfg.max_split_k)
                rows.append(dict(family=family, K=k, N=n, M=m, kernel=kind, config=cfg.__dict__, split=splits,
                                 us=round(us, 3), speedup_vs_bf16=round(timed["cublas_bf16"] / us, 3)))
            for name, us in timed.items():
                rows.append(dict(family=family, K=k, N=n, M=m, kernel=name, config=None, us=round(us, 3),
                                 speedup_vs_bf16=round(timed["cublas_bf16"] / us, 3)))
            best = {}
            for r in rows:
                if (r["K"], r["N"], r["M"]) == (k, n, m):
                    if r["kernel"] not in best or r["us"] < best[r["kernel"]]["us"]:
                        best[r["kernel"]] = r
            line = "  ".join(f"{kname} x{r['speedup_vs_bf16']:.2f}" for kname, r in sorted(best.items())
                             if kname != "quantize_rows")
            print(f"{family:4s} {k:5d}->{n:5d} M={m:5d} bf16 {timed['cublas_bf16']:8.2f} us | {line}", flush=True)
        del base, dense, per_layout, a8_rows
        torch.cuda.empty_cache()
        save()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200/sweep_fused.json"))
    parser.add_argument("--ms", type=int, nargs="+", default=MS)
    parser.add_argument("--quick", action="store_true", help="one 8B and one 0.6B shape")
    parser.add_argument("--shapes", type=_shape_list, default=None,
                        help="only these K->N shapes, e.g. 2048x1024,3072x1024 (default: the eight of bench_linear)")
    parser.add_argument("--a8-only", action="store_true", help="only the int8 candidates, beside cuBLAS bf16")
    parser.add_argument("--a8-row", action="store_true",
                        help="also time the int8 candidates with one scale per weight row (a8[a8 row])")
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [(fam, k, n) for fam, sh in families(args.shapes).items() for k, n in sh]
    if args.quick:
        shapes = [("8B", 4096, 14336), ("0.6B", 1024, 6144)]
    report = {"commit": git_commit(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        args.out.write_text(json.dumps(report, indent=1) + "\n")

    with torch.inference_mode():
        if not args.skip_check:
            t = time.time()
            report["asm_vs_plain"] = asm_matches_plain()
            for r in report["asm_vs_plain"]:
                print("asm-vs-plain", r, flush=True)
            report["correctness"] = rows = correctness()
            bad = [r for r in rows if not r["ok"]]
            print(f"correctness: {len(rows) - len(bad)}/{len(rows)} ok ({time.time() - t:.0f} s)", flush=True)
            for r in bad[:20]:
                print("  FAIL", r, flush=True)
            save()
        report["host_us_per_call"] = host_overhead()
        print("host us/call:", report["host_us_per_call"], flush=True)
        save()
        report["sweep"] = []
        sweep(args.ms, shapes, report["sweep"], save, args.a8_only, args.a8_row)
        report["complete"] = True
        save()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
