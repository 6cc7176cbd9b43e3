"""W2A8: per-token int8 activations. This docstring is the spec of ``activation_bits=8``.

For each row (token) m of x [M, K]:

    amax[m]  = max_k |x[m, k]|                      (in fp32)
    inv[m]   = 127 / amax[m]   (fp32, IEEE division; 0 when amax[m] = 0)
    q[m, k]  = round_half_even(fp32(x[m, k]) * inv[m]), clamped to [-127, 127]   (int8)
    s_x[m]   = amax[m] / 127   (fp32, IEEE division)

The product runs per 128-block b in integers and is scaled in fp32:

    P[m, n, b] = sum_{k in block b} q[m, k] * v[n, k]                (int32, exact)
    y[m, n]    = s_x[m] * sum_b fp32(P[m, n, b]) * fp32(scale[n, b])  (+ bias[n])

and y is rounded once to x's dtype. |P| <= 127 * 128, so every P is exact in fp32 too.
Kernels may add the block terms in any order; that order is the only freedom they have.

Row scales. ``weight_scale`` may instead be ``[N, 1]``: one scale s_w[n] for all of row n's
weights (BitNet b1.58 checkpoints carry one scale per tensor; a v1 checkpoint whose blocks of
a row share one scale loads this way, ``row_scales``). The integer sum then runs over all of K:

    S[m, n]    = sum_k q[m, k] * v[n, k]                          (int32, exact)
    y[m, n]    = fp32(fp32(S[m, n]) * fp32(s_w[n])) * s_x[m]   (+ bias[n])

each product rounded to fp32 in that order. |S| <= 127 * K < 2^24 for K <= ROW_SCALE_MAX_K, so
fp32(S) is exact, and kernels have no freedom at all: the result is bitwise the reference's.
With one block (K = 128) both forms are the same arithmetic. For 16-bit activations a row
scale means what its expansion to ``[N, K/128]`` means (``ternop.format.dequantize``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ternop.format import BLOCK_SIZE, codes_to_values, unpack_codes
from ternop.layouts import to_v1

QMAX = 127
# The largest K whose row-scale sums stay exact in fp32: 127 * K <= 2^24.
ROW_SCALE_MAX_K = (1 << 24) // QMAX // BLOCK_SIZE * BLOCK_SIZE


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (any float dtype) -> (q int8 [..., K], s_x fp32 [...]) as the module docstring says.

    Written in plain torch ops so that ``torch.compile`` can fuse it into what produces x (an
    RMSNorm, an activation) and hand int8 rows to ``ternop::linear_q8``; compiled or not, it
    gives these bits. The two divisions run in fp64 and round once to fp32: for fp32 operands
    a 53-bit quotient rounds to the IEEE fp32 quotient (double rounding is harmless from
    2 * 24 + 2 bits on), and compilers lower fp64 division exactly where their fp32 division
    may be approximate (Triton's ``/`` is ``div.full.f32``).
    """
    xf = x2.to(torch.float32)
    amax = xf.abs().amax(dim=-1)
    a64 = amax.to(torch.float64)
    # A tensor numerator: `QMAX / t` would run as t.reciprocal() * QMAX, two roundings.
    inv = torch.where(amax > 0, (torch.full_like(a64, QMAX) / torch.where(a64 > 0, a64, 1.0)).to(torch.float32), 0.0)
    q = torch.round(xf * inv.unsqueeze(-1)).clamp(-QMAX, QMAX).to(torch.int8)
    return q, (a64 / QMAX).to(torch.float32)


class QuantizedRows(NamedTuple):
    """Activations already quantized per token, as :func:`quantize_rows` makes them, with the
    dtype the product returns. A layer that quantizes its input takes these as they are (the
    vLLM plugin's linear method, after ``ternop::rms_norm_quant``; ``ternop/norm_quant.py``)."""

    q: torch.Tensor
    scale: torch.Tensor
    out_dtype: torch.dtype


def weight_values(weight_packed: torch.Tensor, layout: str = "v1") -> torch.Tensor:
    """uint8 [N, K/4] in ``layout`` -> int8 values [N, K] in {-1, 0, +1}."""
    return codes_to_values(unpack_codes(to_v1(weight_packed, layout) if layout != "v1" else weight_packed))


def block_partials(q: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q int8 [M, K], values int8 [N, K] -> P int32 [M, N, K/128] (exact)."""
    m, k = q.shape
    n = values.shape[0]
    nb = k // BLOCK_SIZE
    # Every partial is at most 127 * 128 in size, so fp32 sums of integers are exact.
    qb = q.to(torch.float32).view(m, nb, BLOCK_SIZE).transpose(0, 1)  # [B, M, 128]
    vb = values.to(torch.float32).view(n, nb, BLOCK_SIZE).permute(1, 2, 0)  # [B, 128, N]
    return torch.bmm(qb, vb).permute(1, 2, 0).to(torch.int32)


def row_sums(q: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q int8 [M, K], values int8 [N, K] -> S int32 [M, N], the sum over all of K (exact)."""
    # float64 holds every such sum exactly (|S| <= 127 * K), and CPU matmul in float64 is exact
    # for integers below 2^53.
    return (q.to(torch.float64) @ values.to(torch.float64).t()).to(torch.int32)


def row_scales(weight_scale: torch.Tensor) -> torch.Tensor | None:
    """weight_scale fp16 [N, B] -> its [N, 1] row-scale form when every row's B scales are equal
    (bitwise), else None. [N, 1] itself is returned as it is."""
    if weight_scale.dim() != 2:
        raise ValueError(f"weight_scale must be 2-D [N, K/128], got shape {tuple(weight_scale.shape)}")
    if weight_scale.shape[1] == 1:
        return weight_scale
    first = weight_scale[:, :1]
    # Bitwise: -0.0 and 0.0 differ, NaN never matches itself as a float, so compare the bits.
    if bool((weight_scale.view(torch.int16) == first.view(torch.int16)).all()):
        return first.contiguous()
    return None
