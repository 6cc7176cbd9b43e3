"""The fake kernel of ``ternop::linear`` and the input checks every implementation shares.

The checks use ``torch._check`` so that they hold for symbolic shapes under
``torch.compile`` and raise a RuntimeError with the message in eager mode.
"""

from __future__ import annotations

import torch

from ternop.activations import ROW_SCALE_MAX_K
from ternop.format import BLOCK_SIZE, CODES_PER_BYTE
from ternop.layouts import LAYOUTS

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATION_BITS = (16, 8)


def check_linear_inputs(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    activation_bits: int = 16,
    layout: str = "v1",
) -> tuple[int, int]:
    """Checks the arguments of ``ternop::linear`` and returns (N, K).

    x: [..., K] float16/bfloat16/float32; weight_packed: uint8 [N, K/4] in ``layout``;
    weight_scale: float16 [N, K/128], or [N, 1] (a scale per row, K <= ROW_SCALE_MAX_K); bias: [N] in x's dtype, or None;
    activation_bits: 16 or 8; layout: one of ternop.layouts.LAYOUTS.
    """
    torch._check(
        activation_bits in ACTIVATION_BITS,
        lambda: f"ternop.linear: activation_bits must be 16 or 8, got {activation_bits}",
    )
    torch._check(
        layout in LAYOUTS,
        lambda: f"ternop.linear: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}",
    )
    torch._check(
        x.dtype in X_DTYPES,
        lambda: f"ternop.linear: x must be float16, bfloat16 or float32, got {x.dtype}",
    )
    torch._check(x.dim() >= 1, lambda: "ternop.linear: x must have at least 1 dimension [..., K], got a 0-d tensor")
    return check_weights(x, weight_packed, weight_scale, bias, x.dtype)


def check_weights(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    op: str = "ternop.linear",
    x_name: str = "x",
    out_what: str = "x's dtype",
) -> tuple[int, int]:
    """The checks of the weights, the bias and their agreement with the activations ``x``
    ([..., K], on the weights' device), shared by ``ternop::linear`` and ``ternop::linear_q8``.
    ``out_dtype`` is the output's dtype, which a bias must have. Returns (N, K)."""
    torch._check(
        weight_packed.dtype == torch.uint8,
        lambda: f"{op}: weight_packed must be uint8 [N, K/4], got dtype {weight_packed.dtype}",
    )
    torch._check(
        weight_packed.dim() == 2,
        lambda: f"{op}: weight_packed must be 2-D [N, K/4], got shape {tuple(weight_packed.shape)}",
    )
    torch._check(
        weight_scale.dtype == torch.float16,
        lambda: f"{op}: weight_scale must be float16 [N, K/{BLOCK_SIZE}], got dtype {weight_scale.dtype}",
    )
    torch._check(
        weight_scale.dim() == 2,
        lambda: f"{op}: weight_scale must be 2-D [N, K/{BLOCK_SIZE}], got shape {tuple(weight_scale.shape)}",
    )
    n = weight_packed.shape[0]
    k = weight_packed.shape[1] * CODES_PER_BYTE
    torch._check(
        n > 0 and k > 0,
        lambda: f"{op}: weight_packed is empty, shape {tuple(weight_packed.shape)}",
    )
    torch._check(
        k % BLOCK_SIZE == 0,
        lambda: f"{op}: K={k} must be a multiple of {BLOCK_SIZE} "
        f"(weight_packed [N, K/4] has shape {tuple(weight_packed.shape)})",
    )
    torch._check(
        x.shape[-1] == k,
        lambda: f"{op}: {x_name} has K={x.shape[-1]} in its last dimension, but weight_packed "
        f"{tuple(weight_packed.shape)} holds K={k} (K/4={weight_packed.shape[1]})",
    )
    torch._check(
        weight_scale.shape[0] == n and (weight_scale.shape[1] == k // BLOCK_SIZE or weight_scale.shape[1] == 1),
        lambda: f"{op}: weight_scale must have shape [N, K/{BLOCK_SIZE}] = [{n}, {k // BLOCK_SIZE}] "
        f"(or [{n}, 1], a scale per row), got {list(weight_scale.shape)}",
    )
    torch._check(
        weight_scale.shape[1] != 1 or k <= ROW_SCALE_MAX_K,
        lambda: f"{op}: row scales ([N, 1]) take K <= {ROW_SCALE_MAX_K}, where the int32 sums "
        f"stay exact in fp32; got K={k}",
    )
    torch._check(
        weight_packed.device == x.device and weight_scale.device == x.device,
        lambda: f"{op}: all tensors must be on one device, got {x_name} on {x.device}, "
        f"weight_packed on {weight_packed.device}, weight_scale on {weight_scale.device}",
    )
    if bias is not None:
        torch._check(
            bias.dim() == 1 and bias.shape[0] == n,
            lambda: f"{op}: bias must have shape [N] = [{n}], got {list(bias.shape)}",
        )
        torch._check(
            bias.dtype == out_dtype,
            lambda: f"{op}: bias must have {out_what} {out_dtype}, got {bias.dtype}",
        )
        torch._check(
            bias.device == x.device,
            lambda: f"{op}: bias is on {bias.device} but {x_name} is on {x.device}",
        )
    return n, k


def inputs_ok(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    activation_bits: int = 16,
    layout: str = "v1",
) -> bool:
    """True exactly when ``check_linear_inputs`` would pass, for real (not symbolic) tensors.

    The eager op calls this plain-Python test first (a few microseconds) and runs
    ``check_linear_inputs`` only to produce the message when it fails.
    """
    if x.dtype not in X_DTYPES or x.dim() < 1 or activation_bits not in ACTIVATION_BITS:
        return False
    return weights_ok(x, weight_packed, weight_scale, bias, x.dtype, layout)


def weights_ok(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    layout: str = "v1",
) -> bool:
    """True exactly when ``check_weights`` (and the layout check) would pass, for real tensors."""
    xs, ps, ss = x.shape, weight_packed.shape, weight_scale.shape
    if (
        weight_packed.dtype != torch.uint8
        or len(ps) != 2
        or weight_scale.dtype != torch.float16
        or len(ss) != 2
        or layout not in LAYOUTS
    ):
        return False
    n, k = ps[0], ps[1] * CODES_PER_BYTE
    if n <= 0 or k <= 0 or k % BLOCK_SIZE or xs[-1] != k or ss[0] != n:
        return False
    if ss[1] != k // BLOCK_SIZE and (ss[1] != 1 or k > ROW_SCALE_MAX_K):
        return False
    device = x.device
    if weight_packed.device != device or weight_scale.device != device:
        return False
    if bias is not None:
        bs = bias.shape
        if len(bs) != 1 or bs[0] != n or bias.dtype != out_dtype or bias.device != device:
            return False
    return True


def linear_fake(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation_bits: int = 16,
    layout: str = "v1",
) -> torch.Tensor:
    """Mirrors the real allocation: a new contiguous [..., N] tensor in x's dtype."""
    n, _ = check_linear_inputs(x, weight_packed, weight_scale, bias, activation_bits, layout)
    return x.new_empty((*x.shape[:-1], n))
