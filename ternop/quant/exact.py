"""Dense weights that are already ternary -> format v1, exactly or not at all.

A model trained ternary (BitNet) or stored in a ternary type (GGUF ``TQ1_0`` / ``TQ2_0``)
dequantizes to a dense ``W [N, K]`` in which every 128-block along K holds only 0 and
``±a`` for one value ``a``. :func:`exact_pair` recovers the v1 pair of such a weight:

    weight_scale[n, b] = a = max |W[n, 128b : 128b + 128]|   (stored as float16)
    code[n, k]         = 01 where W = +a, 10 where W = -a, 00 where W = 0

so that ``ternop.format.dequantize(packed, scale, W.dtype)`` equals ``W`` bit for bit
(``torch.equal``). A block of zeros gets codes 00 and scale 0, and a negative source scale
becomes its absolute value with the signs in the codes, as docs/FORMAT.md asks of writers.
When that is impossible it raises :class:`NotExact`, naming the tensor and the first
offending row and block: K not a multiple of 128, a non-finite value, a block holding
values other than 0 and ``±a``, or an ``a`` that float16 cannot hold exactly.
"""

from __future__ import annotations

import torch

from ternop.checkpoint import CheckpointError
from ternop.format import BLOCK_SIZE, CODE_MINUS, CODE_PLUS, SCALE_DTYPE, dequantize, pack_codes

# Rows handled at a time, so the temporaries stay about 64 MiB whatever the layer size.
_CHUNK_ELEMS = 1 << 24


class NotExact(CheckpointError):
    """A weight that format v1 cannot store exactly; the message names the tensor and why."""


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def exact_pair(weight: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[N, K]`` (fp16, bf16 or fp32), ternary per 128-block -> (uint8 [N, K/4], float16 [N, K/128]).

    The pair dequantizes to exactly ``weight`` in its dtype; otherwise NotExact names ``name``.
    """
    if weight.dim() != 2:
        raise NotExact(f"{name}: a linear weight must be 2-D [N, K], got shape {list(weight.shape)}")
    if weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise NotExact(f"{name}: expected a float16, bfloat16 or float32 weight, got {weight.dtype}")
    n, k = weight.shape
    if n == 0 or k % BLOCK_SIZE != 0:
        raise NotExact(
            f"{name}: K={k} (shape {list(weight.shape)}) is not a positive multiple of {BLOCK_SIZE}, "
            f"so format v1 cannot store it (its scales cover blocks of {BLOCK_SIZE} inputs)"
        )
    nb = k // BLOCK_SIZE
    codes = torch.empty((n, k), dtype=torch.uint8)
    scales = torch.empty((n, nb), dtype=SCALE_DTYPE)
    rows = max(1, _CHUNK_ELEMS // k)
    for r0 in range(0, n, rows):
        w = weight[r0 : r0 + rows].to(torch.float32).reshape(-1, nb, BLOCK_SIZE)  # exact for all three dtypes
        finite = torch.isfinite(w)
        if not bool(finite.all()):
            r, b, i = _first(~finite)
            raise NotExact(f"{name}: non-finite value {float(w[r, b, i])} at row {r0 + r}, column {b * BLOCK_SIZE + i}")
        a = w.abs().amax(dim=-1)  # [rows, nb]
        plus, minus = w == a[..., None], w == -a[..., None]
        odd = ~(plus | minus | (w == 0))
        if bool(odd.any()):
            r, b, i = _first(odd)
            raise NotExact(
                f"{name}: row {r0 + r}, block {b} is not ternary: it holds {float(w[r, b, i])!r} beside the "
                f"block's largest magnitude {float(a[r, b])!r}; every value must be 0 or ±that magnitude"
            )
        a16 = a.to(SCALE_DTYPE)
        if not bool((a16.to(torch.float32) == a).all()):
            r, b = _first(a16.to(torch.float32) != a)
            raise NotExact(
                f"{name}: row {r0 + r}, block {b} has scale {float(a[r, b])!r}, which float16 cannot hold "
                f"exactly (it would round to {float(a16[r, b])!r}); format v1 stores scales as float16"
            )
        c = plus.to(torch.uint8) * CODE_PLUS + minus.to(torch.uint8) * CODE_MINUS
        c[(a == 0)[..., None].expand_as(c)] = 0
        codes[r0 : r0 + rows] = c.reshape(-1, k)
        scales[r0 : r0 + rows] = a16
    packed = pack_codes(codes)
    if not torch.equal(dequantize(packed, scales, weight.dtype), weight):  # the promise, checked on every layer
        raise NotExact(f"{name}: the v1 pair does not dequantize to the source weight")
    return packed, scales
