"""Launcher of the ``dequant_a8`` path (``triton_dequant_a8.py``).

    linear_dequant_a8(q int8 [M, K], qs fp32 [M], weight_packed uint8 [N, K/4] in ``layout``,
                      weight_scale fp16 [N, 1], bias [N] | None, layout, config, dtype) -> [M, N] in dtype

q and qs are x quantized per token (``launch_fused.quantize_rows``, or the caller's
``ternop::linear_q8`` arguments). Two launches on the current stream: decoding into an int8
workspace [N, K], and the dense int8 GEMM (``int8_gemm``, which the ``cuda_dequant_a8`` backend
runs after the C++ decode instead). Everything is allocated
from the caching allocator and nothing syncs, so the path is capture-safe.
"""

from __future__ import annotations

import torch
import triton

from ternop.cuda import configs
from ternop.cuda.triton_dequant_a8 import decode_int8_kernel, int8_gemm_kernel
from ternop.layouts import LAYOUT_CODES

_DECODE_ROWS = 32


def decode_int8(weight_packed: torch.Tensor, layout: str) -> torch.Tensor:
    """uint8 [N, K/4] codes in ``layout`` -> int8 values [N, K] in {-1, 0, +1} on their device."""
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 4
    out = torch.empty((n, k), dtype=torch.int8, device=weight_packed.device)
    w32 = weight_packed.view(torch.int32)
    decode_int8_kernel[(triton.cdiv(n, _DECODE_ROWS), k // 128)](
        w32, out, n, w32.stride(0), out.stride(0),
        LAYOUT=LAYOUT_CODES[layout], BLOCK_N=_DECODE_ROWS, USE_ASM=weight_packed.is_cuda, num_warps=4,
    )
    return out


def linear_dequant_a8(q, qs, weight_packed, weight_scale, bias, layout: str, config: configs.DequantA8Config,
                      dtype: torch.dtype) -> torch.Tensor:
    return int8_gemm(q, qs, decode_int8(weight_packed, layout), weight_scale, bias, config, dtype)


def int8_gemm(q, qs, w8, weight_scale, bias, config: configs.DequantA8Config, dtype: torch.dtype) -> torch.Tensor:
    """The second launch: q int8 [M, K] x w8 int8 [N, K] in int32, scaled by the row scale
    weight_scale [N, 1], the token scale qs [M] and the bias, to [M, N] in dtype. w8 may come from
    ``decode_int8`` or from the C++ decode (``ternop::decode_int8_cuda``): the same values."""
    m, k = q.shape
    n = w8.shape[0]
    out = torch.empty((m, n), dtype=dtype, device=q.device)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    int8_gemm_kernel[grid](
        q, qs, w8, weight_scale, bias if bias is not None else out, out, m, n, k,
        q.stride(0), w8.stride(0), weight_scale.stride(0), bias.stride(0) if bias is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages,
        enable_fp_fusion=False,  # the row scale, the token scale and the bias each round on their own
    )
    return out
