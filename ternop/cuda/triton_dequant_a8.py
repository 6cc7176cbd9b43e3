"""Triton kernels of the ``dequant_a8`` path: int8 x times row-scaled ternary weights at large M.

At thousands of tokens the fused kernels (``triton_fused.py``, ``ternary_wgmma_a8.cu``) lose
to a plain dense int8 GEMM: decoding codes inside the main loop keeps the weight operand out
of the asynchronous copy -> tensor core pipeline. This path decodes the layer's codes once
per call into a dense int8 weight (N * K bytes, in a workspace from the caching allocator)
and runs an ordinary int8 GEMM on it, the int8 analogue of "dequantize, then cuBLAS". Its
cost, N * K / 4 bytes read and N * K written, is paid once per call and shrinks against
the GEMM as M grows.

Only the row form (``weight_scale`` [N, 1], ``ternop.activations``) runs here: the int32
sum runs over all of K and the epilogue applies the spec's two roundings,
``fp32(fp32(S) * s_w[n]) * s_x[m]`` (+ bias), launched with ``enable_fp_fusion=False``, so
the output equals the CPU reference bit for bit. A scale per 128-block would need the
int32 partials scaled block by block on CUDA cores, which is what limits the fused kernels.

- ``decode_int8_kernel``: codes in any layout -> int8 values [N, K] (``triton_decode``).
- ``int8_gemm_kernel``: pointer loads, pipelined by ``num_stages``; every GPU with int8 ``tl.dot``.

A variant reading q and w through TMA descriptors with a warp-specialised loop was faster on
the layers whose K is large against N when its descriptors were built on the device
(benchmarks/probe_a8_dense.py), but that needs a process-wide Triton allocator, and with
host-built descriptors the first layers that took it (K >= 2N) never finished within the
runs' time limits on the H200 (Triton 3.6; a hang or a minutes-long compile, not told
apart); it is not part of the path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ternop.cuda.triton_decode import decode_a8
from ternop.cuda.triton_fused import grouped_tile, load_rows


@triton.jit
def decode_int8_kernel(w_ptr, out_ptr, N, stride_wn, stride_on, LAYOUT: tl.constexpr, BLOCK_N: tl.constexpr,
                       USE_ASM: tl.constexpr):
    """Program (i, b): rows [i * BLOCK_N, (i + 1) * BLOCK_N) of scale block b -> int8 values."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kb = tl.program_id(1)
    mask = (rows < N)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    words = tl.load(w_ptr + r64 * stride_wn + kb * 8 + tl.arange(0, 8)[None, :], mask=mask, other=0)
    values = decode_a8(words, LAYOUT, BLOCK_N, USE_ASM)
    tl.store(out_ptr + r64 * stride_on + kb * 128 + tl.arange(0, 128)[None, :], values, mask=mask)


@triton.jit
def _epilogue(acc, qs_ptr, s_ptr, b_ptr, out_ptr, pid_m, pid_n, M, N, stride_sn, stride_b, stride_om,
              HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """int32 sums [BLOCK_M, BLOCK_N] -> out, as the row-scale spec says (each step rounds)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_x = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rows_w = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    y = acc.to(tl.float32)  # exact: |S| <= 127 * K < 2^24 (ROW_SCALE_MAX_K)
    y = y * tl.load(s_ptr + rows_w * stride_sn).to(tl.float32)[None, :]
    y = y * tl.load(qs_ptr + rows_x)[:, None]
    if HAS_BIAS:
        y += tl.load(b_ptr + rows_w * stride_b).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def int8_gemm_kernel(q_ptr, qs_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K,
                     stride_qm, stride_wn, stride_sn, stride_b, stride_om,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    """out [M, N] = (q [M, K] @ w [N, K]^T) scaled per row and token; K a multiple of BLOCK_K.

    Rows past M and N read other rows instead of masking (``triton_fused.load_rows``).
    """
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_x = load_rows(offs_m, M)
    rows_w = load_rows(offs_n, N)
    q_ptrs = q_ptr + rows_x[:, None] * stride_qm + tl.arange(0, BLOCK_K)[None, :]
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for _ in range(0, K, BLOCK_K):
        acc = tl.dot(tl.load(q_ptrs), tl.trans(tl.load(w_ptrs)), acc, out_dtype=tl.int32)
        q_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _epilogue(acc, qs_ptr, s_ptr, b_ptr, out_ptr, pid_m, pid_n, M, N, stride_sn, stride_b, stride_om,
              HAS_BIAS, BLOCK_M, BLOCK_N)
