"""Dense weights -> format v1 (packed codes, per-128-block fp16 scales).

Two methods, both per block of 128 weights along K, or with ``scales="row"`` per whole row
(every block of the row then stores the row's one scale, as BitNet's one scale per tensor is
stored; W2A8 kernels sum such rows in int32 over all of K, ``ternop.activations``):

``absmean``  scale = mean(|w|); code = round(clamp(w / scale, -1, 1)) (BitNet b1.58).
``optimal``  the threshold and scale that minimise ||w - scale * t||^2 over ternary t.
             For a fixed set S of nonzero positions the best scale is mean(|w_S|) and the
             error is ||w||^2 - (sum |w_S|)^2 / |S|; for a given |S| = j the best S is the
             j largest magnitudes. So sorting |w| once per block and scanning the prefix sums
             finds the exact optimum: j* = argmax_j (cumsum_j)^2 / j. Vectorised over blocks.
"""

from __future__ import annotations

import torch

from ternop.format import BLOCK_SIZE, SCALE_DTYPE, pack_codes

METHODS = ("optimal", "absmean")
SCALES = ("block", "row")

_FP16_MAX = float(torch.finfo(torch.float16).max)
# Rows processed at a time, so the sort's int64 indices stay a few hundred MiB at most.
_ROWS_PER_CHUNK_ELEMS = 1 << 24


def _ternary_absmean(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [B, 128] fp32 -> (values int8 [B, 128], scale fp32 [B])."""
    scale = blocks.abs().mean(dim=-1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = torch.round(torch.clamp(blocks / safe[:, None], -1.0, 1.0)).to(torch.int8)
    values[scale == 0] = 0
    return values, scale


def _ternary_optimal(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [B, 128] fp32 -> (values int8 [B, 128], scale fp32 [B]) minimising the L2 error."""
    mag = blocks.abs()
    sorted_mag, order = torch.sort(mag, dim=-1, descending=True)
    prefix = torch.cumsum(sorted_mag.to(torch.float64), dim=-1)
    counts = torch.arange(1, blocks.shape[-1] + 1, dtype=torch.float64, device=blocks.device)
    best = torch.argmax(prefix * prefix / counts, dim=-1)  # j* - 1
    keep = best + 1
    scale = (prefix.gather(-1, best[:, None]).squeeze(-1) / keep).to(torch.float32)
    rank_kept = torch.arange(blocks.shape[-1], device=blocks.device)[None, :] < keep[:, None]
    nonzero = torch.zeros_like(rank_kept).scatter_(-1, order, rank_kept)
    values = torch.where(nonzero, torch.sign(blocks), torch.zeros_like(blocks)).to(torch.int8)
    scale = torch.where(prefix[:, -1] > 0, scale, torch.zeros_like(scale))
    return values, scale


_METHOD_FNS = {"optimal": _ternary_optimal, "absmean": _ternary_absmean}


def quantize_to_values(
    w: torch.Tensor, method: str = "optimal", scales: str = "block"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[N, K]`` -> (values int8 [N, K] in {-1, 0, 1}, scales fp16 [N, K/128]).

    ``scales="row"`` fits each row as one block: its K/128 scales are all the row's one scale."""
    if method not in _METHOD_FNS:
        raise ValueError(f"unknown quantization method {method!r}; choose one of {METHODS}")
    if scales not in SCALES:
        raise ValueError(f"unknown scale granularity {scales!r}; choose one of {SCALES}")
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"weight must be a floating-point tensor, got {w.dtype}")
    n, k = w.shape
    if n == 0 or k == 0:
        raise ValueError(f"weight is empty, shape {tuple(w.shape)}")
    if k % BLOCK_SIZE != 0:
        raise ValueError(f"weight K={k} (shape {tuple(w.shape)}) must be a multiple of {BLOCK_SIZE}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("weight holds NaN or Inf; cannot quantize")
    fn = _METHOD_FNS[method]
    values = torch.empty((n, k), dtype=torch.int8, device=w.device)
    out = torch.empty((n, k // BLOCK_SIZE), dtype=torch.float32, device=w.device)
    rows = max(1, _ROWS_PER_CHUNK_ELEMS // k)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        blocks = w[r0:r1].to(torch.float32).reshape(-1, k if scales == "row" else BLOCK_SIZE)
        v, sc = fn(blocks)
        values[r0:r1] = v.reshape(r1 - r0, k)
        out[r0:r1] = sc.reshape(r1 - r0, -1)  # [rows, 1] broadcasts over a row's blocks
    if bool((out > _FP16_MAX).any()):
        raise ValueError(
            f"a block scale exceeds the float16 range ({float(out.max()):.4g} > {_FP16_MAX}); "
            "format v1 stores scales as float16"
        )
    return values, out.to(SCALE_DTYPE)


def quantize_weight(
    w: torch.Tensor, method: str = "optimal", scales: str = "block"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[N, K]`` (any float dtype) -> (weight_packed uint8 [N, K/4], weight_scale fp16 [N, K/128]);
    ``scales="row"``: one scale per row, repeated over its blocks."""
    values, scales = quantize_to_values(w, method, scales)
    codes = (values == 1).to(torch.uint8) | ((values == -1).to(torch.uint8) << 1)
    return pack_codes(codes), scales
