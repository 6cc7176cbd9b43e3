"""Launchers of the fused Triton kernels (``triton_fused.py``).

The registry has already checked the call; these allocate the output (and a split-K
workspace) from the caching allocator and launch on the current stream. Nothing syncs, so
they are capture-safe. The kernels are launched plainly: they run inside the opaque
``ternop::linear``, where a ``triton_op`` registration would only add a dispatcher hop.

    linear_a16(x [M, K] fp16/bf16, weight_packed uint8 [N, K/4], weight_scale fp16 [N, K/128],
               bias [N] | None, layout, config) -> [M, N] in x's dtype
    linear_a8(x [M, K] any float, ...same, or weight_scale [N, 1]...) -> [M, N] in x's dtype
    quantize_rows(x [M, K]) -> (q int8 [M, K], s_x fp32 [M])
"""

from __future__ import annotations

import torch
import triton

from ternop.cuda import configs
from ternop.cuda.triton_fused import fused_a8_kernel, fused_a16_kernel, quant_rows_kernel, split_k_reduce_kernel
from ternop.layouts import LAYOUT_CODES

_REDUCE_BLOCK = 1024
# From this M on, quantize_rows reads long rows in blocks of 4096.
QUANT_TWO_PASS_MIN_M = 1024


def tiles_and_splits(m: int, n: int, k: int, config: configs.FusedConfig, device: torch.device) -> tuple[int, int]:
    """(output tiles, slices of K) of a fused launch for [M, K] x [N, K]^T."""
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    sms = configs.sm_count(device) if device.type == "cuda" else 1
    return tiles, configs.split_k(tiles, k // 128, sms, config.max_split_k)


def _setup(rows: torch.Tensor, n: int, config: configs.FusedConfig, dtype: torch.dtype):
    """(grid, splits, out [M, N] in dtype, split-K workspace [splits, M, N] fp32 or out)."""
    m, k = rows.shape
    tiles, splits = tiles_and_splits(m, n, k, config, rows.device)
    out = torch.empty((m, n), dtype=dtype, device=rows.device)
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=rows.device) if splits > 1 else out
    return (tiles, splits), splits, out, ws


def _reduce(ws: torch.Tensor, bias, out: torch.Tensor, splits: int, row_scale=None, col_scale=None) -> None:
    m, n = out.shape
    split_k_reduce_kernel[(triton.cdiv(m * n, _REDUCE_BLOCK),)](
        ws, row_scale if row_scale is not None else ws, col_scale if col_scale is not None else ws,
        bias if bias is not None else out, out, m, n, bias.stride(0) if bias is not None else 0, out.stride(0),
        HAS_ROW_SCALE=row_scale is not None, HAS_COL_SCALE=col_scale is not None, HAS_BIAS=bias is not None,
        SPLIT_K=splits, BLOCK=_REDUCE_BLOCK, num_warps=4,
        enable_fp_fusion=False,  # each scale, then the bias, rounds on its own, as the specs say
    )


def linear_a16(x, weight_packed, weight_scale, bias, layout: str, config: configs.FusedConfig) -> torch.Tensor:
    m, k = x.shape
    n = weight_packed.shape[0]
    grid, splits, out, ws = _setup(x, n, config, x.dtype)
    w32 = weight_packed.view(torch.int32)
    fused_a16_kernel[grid](
        x, w32, weight_scale, bias if bias is not None else x, out, ws,
        m, n, k,
        x.stride(0), w32.stride(0), weight_scale.stride(0), bias.stride(0) if bias is not None else 0, out.stride(0),
        LAYOUT=LAYOUT_CODES[layout],
        HAS_BIAS=bias is not None and splits == 1,
        USE_ASM=x.is_cuda,
        SWAP=config.swap,
        SPLIT_K=splits,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1:
        _reduce(ws, bias, out, splits)
    return out


def quant_block_k(m: int, k: int) -> int:
    """The K extent ``quantize_rows`` reads of a row at a time, for x [M, K] (see there)."""
    return min(16384 if m < QUANT_TWO_PASS_MIN_M else 4096, triton.next_power_of_2(k))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8 quantization of x [M, K] on its device, exactly as ``ternop.activations``."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    qs = torch.empty((m,), dtype=torch.float32, device=x.device)
    # Small M: one read of the row up to K = 16384 (this kernel's latency is on every layer's
    # critical path). Large M: blocks of at most 4096, the row read twice (the second time from
    # L2), which keeps the kernel near HBM speed (probe_a8_dense.py --quant on the H200: 101 us
    # against 172 us at M = 8192, K = 14336; the same time where K <= 4096).
    block_k = quant_block_k(m, k)
    quant_rows_kernel[(m,)](
        x, q, qs, k, x.stride(0), q.stride(0),
        BLOCK_K=block_k, num_warps=8 if block_k >= 8192 else 4,
        LAUNCH_DEPENDENTS=configs.signals_dependents(x.device),
        # x * inv must round to fp32 before the rounding to an integer, as in the reference.
        enable_fp_fusion=False,
    )
    return q, qs


def linear_a8(x, weight_packed, weight_scale, bias, layout: str, config: configs.FusedConfig) -> torch.Tensor:
    q, qs = quantize_rows(x)
    return linear_a8_quantized(q, qs, weight_packed, weight_scale, bias, layout, config, x.dtype,
                               after_quantize_rows=True)


def linear_a8_quantized(q, qs, weight_packed, weight_scale, bias, layout: str, config: configs.FusedConfig,
                        dtype: torch.dtype, after_quantize_rows: bool = False) -> torch.Tensor:
    """The A8 product from already quantized rows (q int8 [M, K], qs fp32 [M]); out in ``dtype``.
    ``weight_scale`` [N, 1] is a scale per row (``ternop.activations``). ``after_quantize_rows``: the
    launch just before this one was ``quantize_rows``, which lets this kernel start early
    (``configs.triton_a8_starts_early``)."""
    m, k = q.shape
    row_scaled = weight_scale.shape[1] == 1  # with K = 128 both forms are the same arithmetic
    n = weight_packed.shape[0]
    grid, splits, out, ws = _setup(q, n, config, dtype)
    w32 = weight_packed.view(torch.int32)
    early = after_quantize_rows and configs.triton_a8_starts_early(m, k, q.device)
    fused_a8_kernel[grid](
        q, qs, w32, weight_scale, bias if bias is not None else out, out, ws,
        m, n, k,
        q.stride(0), w32.stride(0), weight_scale.stride(0), bias.stride(0) if bias is not None else 0, out.stride(0),
        LAYOUT=LAYOUT_CODES[layout],
        HAS_BIAS=bias is not None and splits == 1,
        USE_ASM=q.is_cuda,
        ROW_SCALE=row_scaled,
        SPLIT_K=splits,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        # Row scales leave no freedom: the two scales and the bias each round on their own.
        enable_fp_fusion=not row_scaled,
        # Started early, after the kernel that quantized the rows signalled (configs.triton_a8_starts_early).
        WAIT_PRIOR=early,
        **({"launch_pdl": True} if early else {}),
    )
    if splits > 1:
        _reduce(ws, bias, out, splits, qs, weight_scale.view(-1) if row_scaled else None)
    return out
