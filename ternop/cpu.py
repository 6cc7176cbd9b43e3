"""CPU reference backend of ternop::linear: unpack a chunk of rows, matmul in fp32.

It is the oracle for every other backend. Memory stays bounded: at most
``_CHUNK_ELEMS`` weights are dequantized at a time, never the whole [N, K] matrix.
"""

from __future__ import annotations

import torch

from ternop import backends
from ternop.format import dequantize

# 4M fp32 weights = 16 MiB of scratch per chunk, whatever the layer size.
_CHUNK_ELEMS = 1 << 22


def _linear_cpu(
    x2: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x2 [M, K] (fp16/bf16/fp32, contiguous) -> [M, N] in x2's dtype; fp32 accumulation."""
    m, k = x2.shape
    n = weight_packed.shape[0]
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    xf = x2.to(torch.float32)
    rows = max(1, _CHUNK_ELEMS // k)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        w = dequantize(weight_packed[n0:n1], weight_scale[n0:n1], torch.float32)
        acc = xf @ w.t()
        if bias is not None:
            acc += bias[n0:n1].to(torch.float32)
        out[:, n0:n1] = acc
    return out


def _can_implement(x2, weight_packed, weight_scale, bias) -> tuple[bool, str]:
    return True, ""


backends.register(
    backends.Backend(name="cpu", device_type="cpu", priority=100, can_implement=_can_implement, run=_linear_cpu)
)
