"""Launchers of the first Triton kernels (``triton_kernels.py``) and of dequantize-then-cuBLAS.

    launch_gemv(kernel, x, weight_packed, weight_scale, bias, block_n, block_k, num_warps, num_stages)
    launch_gemm(kernel, x, weight_packed, weight_scale, bias, block_m, block_n, group_m, num_warps, num_stages)
    launch_dequant(kernel, weight_packed, weight_scale, dtype, block_n, block_k, layout) -> dense [N, K] in dtype
    linear_dequant_cublas(x, weight_packed, weight_scale, bias, layout, block_n, block_k)

x [M, K] fp16/bf16/fp32 with unit stride along K; weight_packed uint8 [N, K/4] (4-byte
aligned, read as int32 [N, K/16]; format v1 for the GEMV and GEMM, any layout for the
dequantizer); weight_scale fp16 [N, K/128]; bias [N] in x's dtype (any stride) or None ->
new [M, N] in x's dtype. The launchers allocate only the output (caching allocator) and launch on
the current stream; nothing syncs, so they are capture-safe. The kernels are launched
plainly: they run inside the opaque ``ternop::linear``, where a ``triton_op`` registration
would only add a dispatcher hop.
"""

from __future__ import annotations

import torch
import triton
import torch.nn.functional as F

from ternop.cuda.triton_kernels import ternary_dequant_kernel, ternary_gemm_kernel, ternary_gemv_kernel
from ternop.layouts import LAYOUT_CODES


def launch_gemv(kernel, x, weight_packed, weight_scale, bias, block_n, block_k, num_warps, num_stages):
    """Allocates out and launches the GEMV through ``kernel``."""
    m, k = x.shape
    n = weight_packed.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    w32 = weight_packed.view(torch.int32)
    grid = (triton.cdiv(n, block_n), m)
    kernel[grid](
        x, w32, weight_scale, bias if bias is not None else x, out,
        n, k,
        x.stride(0), w32.stride(0), weight_scale.stride(0), bias.stride(0) if bias is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def launch_gemm(kernel, x, weight_packed, weight_scale, bias, block_m, block_n, group_m, num_warps, num_stages):
    """Allocates out and launches the GEMM through ``kernel``."""
    m, k = x.shape
    n = weight_packed.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    w32 = weight_packed.view(torch.int32)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    kernel[grid](
        x, w32, weight_scale, bias if bias is not None else x, out,
        m, n, k,
        x.stride(0), w32.stride(0), weight_scale.stride(0), bias.stride(0) if bias is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None,
        # v * scale is exact in fp16 and fp32 but not in bf16 (8-bit mantissa).
        FOLD_SCALE=x.dtype != torch.bfloat16,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        GROUP_M=group_m,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def launch_dequant(kernel, weight_packed, weight_scale, dtype, block_n, block_k, layout="v1"):
    """Allocates and fills the dense weight [N, K] in ``dtype`` through ``kernel``."""
    n, k4 = weight_packed.shape
    k = 4 * k4
    out = torch.empty((n, k), dtype=dtype, device=weight_packed.device)
    w32 = weight_packed.view(torch.int32)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    kernel[grid](
        w32, weight_scale, out, n, k, w32.stride(0), weight_scale.stride(0), out.stride(0),
        LAYOUT=LAYOUT_CODES[layout], BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return out


def linear_dequant_cublas(x, weight_packed, weight_scale, bias, layout, block_n, block_k):
    """Large M: dequantize once to x's dtype (exact for fp16/fp32, the same rounding as
    ``ternop.dequantize`` for bf16), then the dense GEMM of cuBLAS with fp32 accumulation.
    The [N, K] temporary comes from the caching allocator."""
    w = launch_dequant(ternary_dequant_kernel, weight_packed, weight_scale, x.dtype, block_n, block_k, layout)
    return F.linear(x, w, bias)
