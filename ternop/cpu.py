"""CPU reference backend of ternop::linear: unpack a chunk of rows, matmul in fp32.

It is the oracle for every other backend and accepts every layout and activation mode.
Memory stays bounded: at most ``_CHUNK_ELEMS`` weights are unpacked at a time, never the
whole [N, K] matrix.
"""

from __future__ import annotations

import torch

from ternop import backends
from ternop.activations import block_partials, quantize_rows, row_sums, weight_values
from ternop.format import BLOCK_SIZE, dequantize
from ternop.layouts import to_v1

# 4M fp32 weights = 16 MiB of scratch per chunk, whatever the layer size.
_CHUNK_ELEMS = 1 << 22


def _linear_a16(call: backends.LinearCall, out: torch.Tensor) -> None:
    x2, packed, scale, bias = call.x, call.weight_packed, call.weight_scale, call.bias
    xf = x2.to(torch.float32)
    rows = max(1, _CHUNK_ELEMS // call.k)
    for n0 in range(0, call.n, rows):
        n1 = min(call.n, n0 + rows)
        chunk = packed[n0:n1] if call.layout == "v1" else to_v1(packed[n0:n1], call.layout)
        acc = xf @ dequantize(chunk, scale[n0:n1], torch.float32).t()
        if bias is not None:
            acc += bias[n0:n1].to(torch.float32)
        out[:, n0:n1] = acc


def _linear_a8(call: backends.LinearCall, out: torch.Tensor) -> None:
    q, sx = (call.x, call.x_scale) if call.quantized else quantize_rows(call.x)
    nb = call.k // BLOCK_SIZE
    row_scaled = call.row_scales  # one scale per row: the sum runs over all of K
    rows = max(1, _CHUNK_ELEMS // (call.k + call.m * nb))
    for n0 in range(0, call.n, rows):
        n1 = min(call.n, n0 + rows)
        values = weight_values(call.weight_packed[n0:n1], call.layout)
        scale = call.weight_scale[n0:n1].to(torch.float32)
        if row_scaled:
            acc = (row_sums(q, values).to(torch.float32) * scale[:, 0]) * sx[:, None]
        else:
            p = block_partials(q, values)  # [M, n, B]
            acc = (p.to(torch.float32) * scale).sum(dim=2) * sx[:, None]
        if call.bias is not None:
            acc += call.bias[n0:n1].to(torch.float32)
        out[:, n0:n1] = acc


def _linear_cpu(call: backends.LinearCall) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32, or int8 rows with their scales) -> [M, N] in the call's dtype;
    fp32 accumulation (int32 per block, or per row, for A8)."""
    out = torch.empty((call.m, call.n), dtype=call.dtype, device=call.x.device)
    (_linear_a8 if call.activation_bits == 8 else _linear_a16)(call, out)
    return out


def _can_implement(call: backends.LinearCall) -> tuple[bool, str]:
    return True, ""


backends.register(
    backends.Backend(name="cpu", device_type="cpu", priority=100, can_implement=_can_implement, run=_linear_cpu)
)
