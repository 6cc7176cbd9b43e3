"""The fake kernel of ``ternop::linear_q8`` and its input checks.

``ternop::linear_q8`` is ``ternop::linear`` with ``activation_bits=8`` after the per-token
quantization: it takes the int8 rows q [..., K] and their fp32 scales [...] that
``ternop.activations.quantize_rows`` makes, so that a compiled graph can fuse that
quantization into whatever produces x. The weight checks are ``check_weights``'s.
"""

from __future__ import annotations

import torch

from ternop.layouts import LAYOUTS
from ternop.meta.linear import X_DTYPES, check_weights, weights_ok

OP = "ternop.linear_q8"


def check_q8_inputs(
    q: torch.Tensor,
    x_scale: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    layout: str = "v1",
) -> tuple[int, int]:
    """Checks the arguments of ``ternop::linear_q8`` and returns (N, K).

    q: int8 [..., K]; x_scale: float32 with q's leading shape [...]; out_dtype: float16,
    bfloat16 or float32 (a bias has it); the weights as for ``ternop::linear``.
    """
    torch._check(
        layout in LAYOUTS,
        lambda: f"{OP}: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}",
    )
    torch._check(q.dtype == torch.int8, lambda: f"{OP}: q must be int8 [..., K], got dtype {q.dtype}")
    torch._check(q.dim() >= 1, lambda: f"{OP}: q must have at least 1 dimension [..., K], got a 0-d tensor")
    torch._check(
        x_scale.dtype == torch.float32,
        lambda: f"{OP}: x_scale must be float32 (one scale per row of q), got dtype {x_scale.dtype}",
    )
    torch._check(
        x_scale.dim() == q.dim() - 1 and all(a == b for a, b in zip(x_scale.shape, q.shape[:-1])),
        lambda: f"{OP}: x_scale must have q's leading shape {list(q.shape[:-1])}, got {list(x_scale.shape)}",
    )
    torch._check(
        x_scale.device == q.device,
        lambda: f"{OP}: x_scale is on {x_scale.device} but q is on {q.device}",
    )
    torch._check(
        out_dtype in X_DTYPES,
        lambda: f"{OP}: out_dtype must be float16, bfloat16 or float32, got {out_dtype}",
    )
    return check_weights(q, weight_packed, weight_scale, bias, out_dtype, op=OP, x_name="q", out_what="out_dtype")


def q8_inputs_ok(
    q: torch.Tensor,
    x_scale: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    layout: str = "v1",
) -> bool:
    """True exactly when ``check_q8_inputs`` would pass, for real tensors: the op's fast test,
    about a microsecond, before the checks that name a problem."""
    if q.dtype != torch.int8 or x_scale.dtype != torch.float32 or out_dtype not in X_DTYPES or q.dim() < 1:
        return False
    if x_scale.shape != q.shape[:-1] or x_scale.device != q.device:
        return False
    return weights_ok(q, weight_packed, weight_scale, bias, out_dtype, layout)


def linear_q8_fake(
    q: torch.Tensor,
    x_scale: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    layout: str = "v1",
) -> torch.Tensor:
    """Mirrors the real allocation: a new contiguous [..., N] tensor in ``out_dtype``."""
    n, _ = check_q8_inputs(q, x_scale, weight_packed, weight_scale, bias, out_dtype, layout)
    return q.new_empty((*q.shape[:-1], n), dtype=out_dtype)
