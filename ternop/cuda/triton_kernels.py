"""Triton kernels of ternop::linear (format v1), with no torch registration in this file.

Both kernels read the packed weights as int32 words: ``weight_packed.view(int32)`` is
``[N, K/16]`` and word ``w`` holds the 16 consecutive codes of one row, code j in bits
(2j, 2j+1) (little-endian bytes, four codes per byte). They run on GPUs and under
``TRITON_INTERPRET=1`` on CPU tensors.

- ``ternary_gemv_kernel``: one x row per program row of the grid, CUDA cores, for M <= 4.
  It streams each weight tile once per x row; for tiny M the repeats hit L2.
- ``ternary_gemm_kernel``: tensor-core GEMM for every M. Codes decode to exact -1/0/+1 in
  x's dtype; ``tl.dot`` runs per 128-wide K block and the block's scale multiplies the
  fp32 partial sum. For fp16/fp32 x, ``v * scale`` is exact in x's dtype, so the scale is
  folded into the decoded tile and the dot accumulates straight into the accumulator.
- ``ternary_dequant_kernel``: writes the dense weight in x's dtype, for large M where one
  dequantization pass plus cuBLAS beats decoding inside the GEMM.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ternop.cuda.triton_decode import values_plain
from ternop.cuda.triton_fused import grouped_tile

# 2^23 as fp32 bits: OR-ing an integer i < 2^23 into the mantissa gives the float 2^23 + i.
_MAGIC = tl.constexpr(0x4B000000)
_MAGIC_PLUS_2 = tl.constexpr(8388610.0)


@triton.jit
def _fields_word(words):
    """int32 words -> int32 words whose 2-bit fields hold v + 2 in {1, 2, 3} (v = code value).

    Per field lo - hi + 2 is in {1, 2, 3}, so one add/sub over the whole word has no carries
    between fields, and 0b11 reads as 2, i.e. v = 0. -0x55555556 is 0xAAAAAAAA as int32;
    wrap-around is intended. Arithmetic shifts are harmless: every field is masked after it.
    """
    return (words & 0x55555555) + (-0x55555556) - ((words >> 1) & 0x55555555)


@triton.jit
def _fields_last(words):
    """int32 words [A, B] -> fields [A, B, 16] (code j of word b along the last axis)."""
    d = _fields_word(words)
    shifts = tl.arange(0, 16) * 2
    return (d[:, :, None] >> shifts[None, None, :]) & 3


@triton.jit
def _fields_mid(words):
    """int32 words [A, B] -> fields [A, 16, B] (code j of word a along the middle axis)."""
    d = _fields_word(words)
    shifts = tl.arange(0, 16) * 2
    return (d[:, None, :] >> shifts[None, :, None]) & 3


@triton.jit
def _values(fields):
    """fields v + 2 (int32) -> v as exact fp32: the magic-number trick, no int->float convert."""
    return (fields | _MAGIC).to(tl.float32, bitcast=True) - _MAGIC_PLUS_2


@triton.jit
def ternary_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    N, K,
    stride_xm, stride_wn, stride_sn, stride_b, stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[m, n0:n0+BLOCK_N] for one m (grid axis 1), CUDA-core dot products in fp32.

    x [M, K] fp16/bf16/fp32; w int32 [N, K/16]; s fp16 [N, K/128]; out [M, N] in x's dtype.
    BLOCK_K is a multiple of 128; K is masked, so any multiple of 128 works.
    """
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    WORDS: tl.constexpr = BLOCK_K // 16
    BLOCKS: tl.constexpr = BLOCK_K // 128
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_w = k0 // 16 + tl.arange(0, WORDS)
        mask_w = offs_w < K // 16
        words = tl.load(
            w_ptr + rows[:, None] * stride_wn + offs_w[None, :],
            mask=mask_n[:, None] & mask_w[None, :],
            other=0,
            eviction_policy="evict_first",
        )
        v = _values(_fields_last(words))  # [BLOCK_N, WORDS, 16]
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + m * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        prod = v * tl.reshape(xk, (WORDS, 16))[None, :, :]
        part = tl.sum(tl.reshape(prod, (BLOCK_N, BLOCKS, 128)), axis=2)  # [BLOCK_N, BLOCKS]
        offs_b = k0 // 128 + tl.arange(0, BLOCKS)
        scale = tl.load(
            s_ptr + rows[:, None] * stride_sn + offs_b[None, :],
            mask=mask_n[:, None] & (offs_b[None, :] < K // 128),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(part * scale, axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows * stride_b, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def ternary_gemm_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_b, stride_om,
    HAS_BIAS: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """out tile [BLOCK_M, BLOCK_N] = x [M, K] @ W^T, one 128-wide scale block per K step.

    x [M, K] fp16/bf16/fp32; w int32 [N, K/16]; s fp16 [N, K/128]; out [M, N] in x's dtype.
    """
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_kx = tl.arange(0, 128)
    offs_kw = tl.arange(0, 8)
    # 64-bit row offsets: M * K and N * K may pass 2^31 elements.
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_kx[None, :]
    w_ptrs = w_ptr + offs_kw[:, None] + offs_n.to(tl.int64)[None, :] * stride_wn
    s_ptrs = s_ptr + offs_n.to(tl.int64) * stride_sn
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // 128):
        xt = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        words = tl.load(w_ptrs, mask=mask_n[None, :], other=0)  # [8, BLOCK_N]
        scale = tl.load(s_ptrs, mask=mask_n, other=0.0)
        v = _values(_fields_mid(words))  # [8, 16, BLOCK_N]
        v = tl.reshape(v, (128, BLOCK_N))
        if FOLD_SCALE:
            # v * scale is exact in fp16 (and fp32): one dot over all of K.
            w = (v * scale.to(tl.float32)[None, :]).to(dtype)
            if dtype == tl.float32:
                acc = tl.dot(xt, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, w, acc)
        else:
            part = tl.dot(xt, v.to(dtype))
            acc += part * scale.to(tl.float32)[None, :]
        x_ptrs += 128
        w_ptrs += 8
        s_ptrs += 1
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n.to(tl.int64) * stride_b, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def ternary_dequant_kernel(
    w_ptr, s_ptr, out_ptr,
    N, K,
    stride_wn, stride_sn, stride_on,
    LAYOUT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out [N, K] = value * scale, formed in fp32 and cast to out's dtype (as ternop.dequantize).

    w int32 [N, K/16] in layout LAYOUT (0 = "v1", 1 = "a16", 2 = "a8"); s fp16 [N, K/128];
    BLOCK_K a multiple of 128; K is masked.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    WORDS: tl.constexpr = BLOCK_K // 16
    BLOCKS: tl.constexpr = BLOCK_K // 128
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n.to(tl.int64)
    offs_w = pid_k * WORDS + tl.arange(0, WORDS)
    mask_n = offs_n < N
    words = tl.load(
        w_ptr + rows[:, None] * stride_wn + offs_w[None, :],
        mask=mask_n[:, None] & (offs_w[None, :] < K // 16),
        other=0,
    )
    if LAYOUT == 0:
        v = _values(_fields_last(words))
    else:
        v = values_plain(words, LAYOUT, BLOCK_N * WORDS // 8).to(tl.float32)
    v = tl.reshape(v, (BLOCK_N, BLOCKS, 128))
    offs_b = pid_k * BLOCKS + tl.arange(0, BLOCKS)
    scale = tl.load(
        s_ptr + rows[:, None] * stride_sn + offs_b[None, :],
        mask=mask_n[:, None] & (offs_b[None, :] < K // 128),
        other=0.0,
    ).to(tl.float32)
    w = tl.reshape(v * scale[:, :, None], (BLOCK_N, BLOCK_K))
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(
        out_ptr + rows[:, None] * stride_on + offs_k[None, :],
        w.to(out_ptr.dtype.element_ty),
        mask=mask_n[:, None] & (offs_k[None, :] < K),
    )
