"""Probe: int8 x row-scaled ternary at large M as "decode to dense int8, then a dense int8 GEMM".

Times, per shape and M (weights rotated past L2, CUDA-graph replays, as bench_linear):
cuBLAS bf16, the dispatcher's ternop_a8_row, torch._int_mm on dense int8 weights (cuBLAS's
int8 ceiling, no scaling), the Triton dense int8 GEMM with the row-scale epilogue alone, the
decode kernel alone, and decode + GEMM + quantization together; checks the last against the
dispatcher bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

import ternop
from ternop import layouts
from ternop.cuda.launch_fused import quantize_rows
from ternop.cuda.triton_decode import decode_a8
from ternop.cuda.triton_fused import grouped_tile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_linear import SHAPES, copies_for, make_weights, time_graph  # noqa: E402
from stamp import git_commit  # noqa: E402


@triton.jit
def decode_kernel(w_ptr, out_ptr, N, stride_wn, stride_on, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kb = tl.program_id(1)
    mask = (rows < N)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    words = tl.load(w_ptr + r64 * stride_wn + kb * 8 + tl.arange(0, 8)[None, :], mask=mask, other=0)
    v = decode_a8(words, 2, BLOCK_N, USE_ASM)
    tl.store(out_ptr + r64 * stride_on + kb * 128 + tl.arange(0, 128)[None, :], v, mask=mask)


@triton.jit
def dense_ptr_kernel(q_ptr, qs_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_qm, stride_wn, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rows_w = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    a_ptrs = q_ptr + rows_a[:, None] * stride_qm + tl.arange(0, BLOCK_K)[None, :]
    b_ptrs = w_ptr + rows_w[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for _ in range(0, K, BLOCK_K):
        acc = tl.dot(tl.load(a_ptrs), tl.trans(tl.load(b_ptrs)), acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    y = acc.to(tl.float32) * tl.load(s_ptr + rows_w).to(tl.float32)[None, :]
    y = y * tl.load(qs_ptr + rows_a)[:, None]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dense_tma_kernel(q_ptr, qs_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_qm, stride_wn, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     WS: tl.constexpr, STAGES: tl.constexpr):
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[M, K], strides=[stride_qm, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES, warp_specialize=WS):
        a = q_desc.load([pid_m * BLOCK_M, k])
        b = w_desc.load([pid_n * BLOCK_N, k])
        acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rows_w = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    y = acc.to(tl.float32) * tl.load(s_ptr + rows_w).to(tl.float32)[None, :]
    y = y * tl.load(qs_ptr + rows_a)[:, None]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


CONFIGS = [  # (name, BM, BN, BK, warps, stages, kind)
    ("p128x128x128w8s4", 128, 128, 128, 8, 4, "ptr"),
    ("p128x256x128w8s3", 128, 256, 128, 8, 3, "ptr"),
    ("p256x128x128w8s3", 256, 128, 128, 8, 3, "ptr"),
    ("p128x128x64w4s5", 128, 128, 64, 4, 5, "ptr"),
    ("t128x128x128w8s4", 128, 128, 128, 8, 4, "tma"),
    ("t128x256x128w8s3", 128, 256, 128, 8, 3, "tma"),
    ("t256x128x128w8s3", 256, 128, 128, 8, 3, "tma"),
    ("ws128x256x128w8s3", 128, 256, 128, 8, 3, "ws"),
    ("ws128x128x128w4s4", 128, 128, 128, 4, 4, "ws"),
]


def decode(words32, out, block_n=32):
    n = words32.shape[0]
    decode_kernel[(triton.cdiv(n, block_n), out.shape[1] // 128)](
        words32, out, n, words32.stride(0), out.stride(0), BLOCK_N=block_n, USE_ASM=words32.is_cuda, num_warps=4)


def dense(q, qs, w8, s, out, cfg):
    name, bm, bn, bk, warps, stages, kind = cfg
    m, k = q.shape
    n = w8.shape[0]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    common = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, enable_fp_fusion=False)
    args = (q, qs, w8, s, out, m, n, k, q.stride(0), w8.stride(0), out.stride(0))
    if kind == "ptr":
        dense_ptr_kernel[grid](*args, num_stages=stages, **common)
    else:
        dense_tma_kernel[grid](*args, WS=kind == "ws", STAGES=stages, **common)


def probe_quant(out_path):
    """quant_rows_kernel's BLOCK_K and warps at large M: one read of the row (BLOCK_K >= K) or two."""
    from ternop.cuda.triton_fused import quant_rows_kernel

    rows = []
    for k in (1024, 2048, 3072, 4096, 14336):
        for m in (2048, 8192):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q = torch.empty((m, k), dtype=torch.int8, device="cuda")
            qs = torch.empty((m,), dtype=torch.float32, device="cuda")
            res = {}
            for bk in (1024, 2048, 4096, 8192, 16384):
                for warps in (4, 8, 16):
                    if bk < 1024 or bk // (32 * warps) < 4:
                        continue
                    fn = lambda i: quant_rows_kernel[(m,)](x, q, qs, k, x.stride(0), q.stride(0), BLOCK_K=bk,
                                                           num_warps=warps, enable_fp_fusion=False)
                    res[f"bk{bk}w{warps}"] = round(time_graph(fn, 10), 2)
            res["current"] = round(time_graph(lambda i: quantize_rows(x), 10), 2)
            best = min((v, kk) for kk, v in res.items())
            print(f"quant K={k:5d} M={m:5d} current {res['current']:7.1f}us best {best[1]} {best[0]:7.1f}us "
                  f"(HBM floor {3 * m * k / 4.0e6:6.1f}us at 4 TB/s)", flush=True)
            rows.append({"K": k, "M": m, "us": res})
    Path(out_path).write_text(json.dumps({"commit": git_commit(), "quant": rows}, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="128,512,2048,8192")
    ap.add_argument("--quant", action="store_true", help="time the quantization kernel's variants instead")
    ap.add_argument("--shapes", default="", help="K:N,... (default: every shape of bench_linear)")
    ap.add_argument("--dispatcher-only", action="store_true",
                    help="time cuBLAS bf16 and the dispatcher's ternop_a8_row only (no probe kernels)")
    args = ap.parse_args()
    if args.quant:
        probe_quant(args.out)
        return 0
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    configs = [] if args.dispatcher_only else CONFIGS
    ms = [int(v) for v in args.ms.split(",")]
    rows = []
    dt = torch.bfloat16
    for family, shapes in SHAPES.items():
        for k, n in shapes:
            if args.shapes and f"{k}:{n}" not in args.shapes.split(","):
                continue
            base = make_weights(k, n, copies_for(n * k // 4))
            tern = [(layouts.repack(p, "a8"), s[:, :1].contiguous()) for p, s in base]
            dense_copies = copies_for(n * k)
            w8s = [ternop.activations.weight_values(p, "a8").contiguous()
                   for p, _ in tern[:dense_copies]]
            bf = [w.to(dt) * s.to(dt) for w, (_, s) in zip(w8s, tern)][: copies_for(2 * n * k)]
            work = torch.empty((n, k), dtype=torch.int8, device="cuda")
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=dt)
                q, qs = quantize_rows(x)
                out = torch.empty((m, n), dtype=dt, device="cuda")
                t = {}
                t["cublas_bf16"] = time_graph(lambda i: torch.nn.functional.linear(x, bf[i % len(bf)]), len(bf))
                t["ternop_a8_row"] = time_graph(
                    lambda i: ternop.linear(x, *tern[i % len(tern)], activation_bits=8, layout="a8"), len(tern))
                t["quant"] = time_graph(lambda i: quantize_rows(x), 20)
                t["decode"] = time_graph(lambda i: decode(tern[i % len(tern)][0].view(torch.int32), work), len(tern))
                try:
                    if args.dispatcher_only:
                        raise RuntimeError("skipped (--dispatcher-only)")
                    t["int_mm"] = time_graph(lambda i: torch._int_mm(q, w8s[i % len(w8s)].t()), len(w8s))
                except Exception as exc:
                    print("int_mm failed", exc, flush=True)
                ref = ternop.linear(x, *tern[0], activation_bits=8, layout="a8")
                best = None
                for cfg in configs:
                    try:
                        t["dense:" + cfg[0]] = time_graph(
                            lambda i: dense(q, qs, w8s[i % len(w8s)], tern[i % len(w8s)][1], out, cfg), len(w8s))
                        decode(tern[0][0].view(torch.int32), work)
                        dense(q, qs, work, tern[0][1], out, cfg)
                        same = torch.equal(out, ref)
                        if not same:
                            print(f"  MISMATCH {cfg[0]} K={k} N={n} M={m}", flush=True)
                        if same and (best is None or t["dense:" + cfg[0]] < t["dense:" + best[0]]):
                            best = cfg
                    except Exception as exc:
                        print(f"  {cfg[0]} failed: {type(exc).__name__}: {exc}"[:300], flush=True)
                if best is not None:
                    def full(i, cfg=best):
                        qq, ss = quantize_rows(x)
                        w, s = tern[i % len(tern)]
                        decode(w.view(torch.int32), work)
                        dense(qq, ss, work, s, out, cfg)
                    t["full_best"] = time_graph(full, len(tern))
                    t["best_cfg"] = best[0]
                b = t["cublas_bf16"]
                line = {"family": family, "K": k, "N": n, "M": m, "us": {kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in t.items()}}
                line["x_vs_bf16"] = {kk: round(b / v, 3) for kk, v in t.items() if isinstance(v, float)}
                rows.append(line)
                if args.dispatcher_only:
                    print(f"{k:6d}->{n:6d} M={m:5d} bf16 {b:8.1f}us a8row x{b / t['ternop_a8_row']:.2f} "
                          f"{t['ternop_a8_row']:8.1f}us decode {t['decode']:.1f}us quant {t['quant']:.1f}us", flush=True)
                    continue
                print(f"{k:6d}->{n:6d} M={m:5d} bf16 {b:8.1f}us a8row x{b / t['ternop_a8_row']:.2f} "
                      f"int_mm x{b / t.get('int_mm', float('inf')):.2f} "
                      f"full x{b / t.get('full_best', float('inf')):.2f} ({t.get('best_cfg')}) "
                      f"dense-only x{b / t['dense:' + best[0]] if best else 0:.2f} "
                      f"decode {t['decode']:.1f}us quant {t['quant']:.1f}us", flush=True)
            del base, tern, w8s, bf, work
            torch.cuda.empty_cache()
            Path(args.out).write_text(json.dumps({"commit": git_commit(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
