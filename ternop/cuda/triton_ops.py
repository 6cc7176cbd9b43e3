"""The Triton kernels as private torch ops, so torch.compile can see into them.

    ternop::_linear_triton_gemv(x, weight_packed, weight_scale, bias, block_n, block_k, num_warps, num_stages)
    ternop::_linear_triton_gemm(x, weight_packed, weight_scale, bias, block_m, block_n, group_m, num_warps, num_stages)
    ternop::_dequant_triton(weight_packed, weight_scale, dtype, block_n, block_k) -> dense [N, K] in dtype

x [M, K] contiguous fp16/bf16/fp32; weight_packed uint8 [N, K/4] (4-byte aligned, read as
int32 [N, K/16]); weight_scale fp16 [N, K/128]; bias [N] in x's dtype or None -> new [M, N]
in x's dtype. The launchers allocate only the output (caching allocator) and launch on
the current stream; nothing syncs, so they are capture-safe.
"""

from __future__ import annotations

import torch
import triton
from torch.library import triton_op, wrap_triton

import torch.nn.functional as F

from ternop.cuda.triton_kernels import ternary_dequant_kernel, ternary_gemm_kernel, ternary_gemv_kernel


def launch_gemv(kernel, x, weight_packed, weight_scale, bias, block_n, block_k, num_warps, num_stages):
    """Allocates out and launches the GEMV through ``kernel`` (the raw kernel, or wrap_triton of it)."""
    m, k = x.shape
    n = weight_packed.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    w32 = weight_packed.view(torch.int32)
    grid = (triton.cdiv(n, block_n), m)
    kernel[grid](
        x, w32, weight_scale, bias if bias is not None else x, out,
        n, k,
        x.stride(0), w32.stride(0), weight_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def launch_gemm(kernel, x, weight_packed, weight_scale, bias, block_m, block_n, group_m, num_warps, num_stages):
    """Allocates out and launches the GEMM through ``kernel`` (the raw kernel, or wrap_triton of it)."""
    m, k = x.shape
    n = weight_packed.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    w32 = weight_packed.view(torch.int32)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    kernel[grid](
        x, w32, weight_scale, bias if bias is not None else x, out,
        m, n, k,
        x.stride(0), w32.stride(0), weight_scale.stride(0), out.stride(0),
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


def launch_dequant(kernel, weight_packed, weight_scale, dtype, block_n, block_k):
    """Allocates and fills the dense weight [N, K] in ``dtype`` through ``kernel``."""
    n, k4 = weight_packed.shape
    k = 4 * k4
    out = torch.empty((n, k), dtype=dtype, device=weight_packed.device)
    w32 = weight_packed.view(torch.int32)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    kernel[grid](
        w32, weight_scale, out, n, k, w32.stride(0), weight_scale.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return out


@triton_op("ternop::_linear_triton_gemv", mutates_args={})
def linear_triton_gemv(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    return launch_gemv(
        wrap_triton(ternary_gemv_kernel), x, weight_packed, weight_scale, bias, block_n, block_k, num_warps, num_stages
    )


@triton_op("ternop::_linear_triton_gemm", mutates_args={})
def linear_triton_gemm(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_m: int,
    block_n: int,
    group_m: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    return launch_gemm(
        wrap_triton(ternary_gemm_kernel), x, weight_packed, weight_scale, bias,
        block_m, block_n, group_m, num_warps, num_stages,
    )


@triton_op("ternop::_dequant_triton", mutates_args={})
def dequant_triton(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype, block_n: int, block_k: int
) -> torch.Tensor:
    return launch_dequant(wrap_triton(ternary_dequant_kernel), weight_packed, weight_scale, dtype, block_n, block_k)


def linear_dequant_cublas(x, weight_packed, weight_scale, bias, block_n, block_k):
    """Large M: dequantize once to x's dtype (exact for fp16/fp32, the same rounding as
    ``ternop.dequantize`` for bf16), then the dense GEMM of cuBLAS with fp32 accumulation.
    The [N, K] temporary comes from the caching allocator."""
    w = torch.ops.ternop._dequant_triton(weight_packed, weight_scale, x.dtype, block_n, block_k)
    return F.linear(x, w, bias)
