"""Fused Triton kernels: decode ternary weights in registers, multiply on tensor cores.

No dense copy of the weights ever reaches HBM. Each program owns an output tile
[BLOCK_M, BLOCK_N] and walks K one 128-wide scale block at a time:

- ``fused_a16_kernel`` (fp16/bf16 x): the block's words decode to ``v * scale`` in x's
  dtype, which is exact (fp16) or exactly the rounding of ``ternop.dequantize`` (bf16), and
  ``tl.dot`` accumulates in fp32 over all of K. Layouts "v1" and "a16".
- ``fused_a8_kernel`` (int8 x from ``quant_rows_kernel``): the block's words decode to int8
  v, ``tl.dot`` gives the block's exact int32 partial, and the fp32 accumulator adds
  ``partial * weight scale``; the token scale multiplies once at the end. With one scale
  per weight row (ROW_SCALE), the int32 sum runs over all of K instead. Layout "a8".
- ``quant_rows_kernel``: per-token absmax int8 quantization (``ternop.activations``).
- ``split_k_reduce_kernel``: adds the fp32 partials of a split-K launch, adds the bias and
  casts to the output dtype.

The weights decode in registers through ``triton_decode.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ternop.cuda.triton_decode import decode_a8, decode_a16


# --- GEMM kernels -----------------------------------------------------------------------------


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program in grouped order: programs that run together share
    weight tiles in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def load_rows(offs, count):
    """The rows a tile loads for ``offs``: its own where they exist, and for each one past ``count``
    the row ``offs % count`` instead of a masked load, so the loads pipeline unconditionally (their
    results are never stored). Spread over the real rows rather than all reading row 0, the spare
    loads of a partial tile stay off a single line of L2, which every program of the launch would
    otherwise read at the same K offset (benchmarks/results/h100/bench_linear_a8row_4096_mid_6b4e389.json:
    4096->4096 at M = 160 took 2.5x as long as at M = 128 in triton_a8)."""
    return (offs % count).to(tl.int64)


@triton.jit
def _operands(a_ptr, w_ptr, s_ptr, M, N, stride_am, stride_wn, stride_sn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's tile and the pointers to its first K block: activations [BLOCK_M, 128],
    words [BLOCK_N, 8], scales [BLOCK_N]. Program (tile, s) of a split-K launch starts at block s.

    Rows past M and N read other rows instead of masking (``load_rows``).
    """
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = load_rows(offs_m, M)
    rows_w = load_rows(offs_n, N)
    kb0 = tl.program_id(1)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + kb0 * 128 + tl.arange(0, 128)[None, :]
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + kb0 * 8 + tl.arange(0, 8)[None, :]
    s_ptrs = s_ptr + rows_w * stride_sn + kb0
    return offs_m, offs_n, rows_a, a_ptrs, w_ptrs, s_ptrs


@triton.jit
def _store_tile(acc, b_ptr, out_ptr, ws_ptr, offs_m, offs_n, M, N, stride_b, stride_om,
                HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Writes an fp32 tile: bias and cast into out, or (split-K) the raw partial into ws [SPLIT_K, M, N]."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n.to(tl.int64) * stride_b, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        split = tl.program_id(1).to(tl.int64)
        tl.store(ws_ptr + (split * M + rows) * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def fused_a16_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_b, stride_om,
    LAYOUT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_ASM: tl.constexpr,
    SWAP: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """out [M, N] = x [M, K] @ W^T (+ bias), x fp16/bf16, fp32 accumulation.

    w int32 [N, K/16] (layout LAYOUT), s fp16 [N, K/128], out [M, N] in x's dtype. With
    SPLIT_K > 1, program (tile, s) covers scale blocks s, s + SPLIT_K, ... and writes fp32
    partials to ws [SPLIT_K, M, N] for ``split_k_reduce_kernel``. SWAP computes
    out^T = W @ x^T, so that weight rows fill the MMA's 64-row dimension and a handful of
    tokens can use the 8..256-wide one.
    """
    dtype = x_ptr.dtype.element_ty
    offs_m, offs_n, _, x_ptrs, w_ptrs, s_ptrs = _operands(
        x_ptr, w_ptr, s_ptr, M, N, stride_xm, stride_wn, stride_sn, BLOCK_M, BLOCK_N, GROUP_M)
    kb0 = tl.program_id(1)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(kb0, K // 128, SPLIT_K):
        words = tl.load(w_ptrs)
        scale = tl.load(s_ptrs).to(dtype)
        wt = decode_a16(words, scale, LAYOUT, dtype, BLOCK_N, USE_ASM)
        xt = tl.load(x_ptrs)
        if SWAP:
            acc = tl.dot(wt, tl.trans(xt), acc)
        else:
            acc = tl.dot(xt, tl.trans(wt), acc)
        x_ptrs += 128 * SPLIT_K
        w_ptrs += 8 * SPLIT_K
        s_ptrs += SPLIT_K
    if SWAP:
        acc = tl.trans(acc)
    _store_tile(acc, b_ptr, out_ptr, ws_ptr, offs_m, offs_n, M, N, stride_b, stride_om, HAS_BIAS, SPLIT_K)


@triton.jit
def fused_a8_kernel(
    q_ptr, qs_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr,
    M, N, K,
    stride_qm, stride_wn, stride_sn, stride_b, stride_om,
    LAYOUT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_ASM: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    WAIT_PRIOR: tl.constexpr = False,
):
    """out [M, N] = s_x * sum_b P_b * scale_b (+ bias) with int8 x on int8 tensor cores.

    q int8 [M, K] and qs fp32 [M] from ``quant_rows_kernel``; w int32 [N, K/16] in layout
    LAYOUT (2, "a8", decodes fastest); s fp16 [N, K/128]; out [M, N] in the caller's dtype. Split-K as in fused_a16_kernel.

    The product is computed transposed, out^T = W @ q^T: weight rows are the MMA's M
    dimension, so each thread's accumulator covers a few weight rows and applies a few
    block scales per step (tokens as the MMA's M would need a scale per accumulator
    column, loaded anew every step), and M down to 8 still fits an MMA.
    """
    offs_m, offs_n, rows_x, q_ptrs, w_ptrs, s_ptrs = _operands(
        q_ptr, w_ptr, s_ptr, M, N, stride_qm, stride_wn, stride_sn, BLOCK_M, BLOCK_N, GROUP_M)
    kb0 = tl.program_id(1)
    if WAIT_PRIOR:
        # Launched early (sm_90+): the kernel before it, which wrote q and qs, may still run.
        # Nothing is read or written before this wait returns.
        tl.extra.cuda.gdc_wait()
    if ROW_SCALE:
        # One scale per row (s [N, 1]): the int32 sum runs over all of K, scaled once at the end.
        iacc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
        for _ in range(kb0, K // 128, SPLIT_K):
            wt = decode_a8(tl.load(w_ptrs), LAYOUT, BLOCK_N, USE_ASM)
            iacc = tl.dot(wt, tl.trans(tl.load(q_ptrs)), iacc, out_dtype=tl.int32)
            q_ptrs += 128 * SPLIT_K
            w_ptrs += 8 * SPLIT_K
        acc = iacc.to(tl.float32)  # exact: |S| <= 127 * K < 2^24
        if SPLIT_K == 1:
            acc = acc * tl.load(s_ptr + tl.where(offs_n < N, offs_n, 0).to(tl.int64) * stride_sn).to(tl.float32)[:, None]
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for _ in range(kb0, K // 128, SPLIT_K):
            words = tl.load(w_ptrs)
            scale = tl.load(s_ptrs).to(tl.float32)
            wt = decode_a8(words, LAYOUT, BLOCK_N, USE_ASM)
            qt = tl.load(q_ptrs)
            part = tl.dot(wt, tl.trans(qt), out_dtype=tl.int32)
            # |part| <= 127 * 128 < 2^22: adding it to the bits of 1.5 * 2^23 and subtracting
            # 1.5 * 2^23 converts it exactly with two full-rate ops instead of one quarter-rate I2F.
            part_f = (part + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
            acc += part_f * scale[:, None]
            q_ptrs += 128 * SPLIT_K
            w_ptrs += 8 * SPLIT_K
            s_ptrs += SPLIT_K
    if SPLIT_K == 1:
        acc = acc * tl.load(qs_ptr + rows_x)[None, :]
    # Split-K: the token scale (and a row scale) multiplies the sum of the slices, in
    # split_k_reduce_kernel, so that it rounds once, after the sum, as the spec says.
    _store_tile(tl.trans(acc), b_ptr, out_ptr, ws_ptr, offs_m, offs_n, M, N, stride_b, stride_om, HAS_BIAS, SPLIT_K)


@triton.jit
def split_k_reduce_kernel(ws_ptr, rs_ptr, cs_ptr, b_ptr, out_ptr, M, N, stride_b, stride_om,
                          HAS_ROW_SCALE: tl.constexpr, HAS_COL_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                          SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = sum_s ws[s, m, n] (* cs[n]) (* rs[m]) (+ bias[n]), in a fixed order
    (deterministic); cs is fp16 (a weight row's scale), rs fp32 (a token's)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    m = offs // N
    n = offs % N
    if HAS_COL_SCALE:
        acc = acc * tl.load(cs_ptr + n, mask=mask, other=0.0).to(tl.float32)
    if HAS_ROW_SCALE:
        acc = acc * tl.load(rs_ptr + m, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n * stride_b, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def quant_rows_kernel(x_ptr, q_ptr, qs_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr,
                      LAUNCH_DEPENDENTS: tl.constexpr = False):
    """One row of x -> int8 q and its fp32 scale, exactly as ``ternop.activations`` says.

    When BLOCK_K covers K the row is read once (at small M this kernel's latency is on the
    critical path of every layer); otherwise twice, for the absmax and for the rounding.
    Launch with enable_fp_fusion=False: the product x * inv must round before the rounding
    to an integer, as in the reference. With LAUNCH_DEPENDENTS (sm_90+) each program first lets
    the next kernel on the stream start, if that kernel was launched for it (programmatic
    dependent launch): the small-M int8 kernel then loads its first weights while this one
    runs, and waits for it before it reads q (``csrc/ternary_common.cuh``).
    """
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + m * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
    amax = tl.abs(x)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        xk = tl.load(x_ptr + m * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(xk))
    a = tl.max(amax, axis=0)
    inv = tl.where(a > 0, tl.math.div_rn(127.0, tl.where(a > 0, a, 1.0)), 0.0)
    for k0 in range(0, K, BLOCK_K):
        if k0 > 0:
            x = tl.load(x_ptr + m * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        # Round half to even: for |t| < 2^22, t + 1.5 * 2^23 rounds t to an integer.
        r = (x * inv + 12582912.0) - 12582912.0
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        tl.store(q_ptr + m * stride_qm + k0 + offs, r.to(tl.int8), mask=k0 + offs < K)
    tl.store(qs_ptr + m, tl.math.div_rn(a, 127.0))
