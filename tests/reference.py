"""An independent reading of format v1, written from docs/FORMAT.md with NumPy.

It shares no code with ternop.format, so tests that compare against it check the
library's unpacking as well as its kernels.
"""

from __future__ import annotations

import numpy as np
import torch

_VALUE_OF_CODE = {0b00: 0.0, 0b01: 1.0, 0b10: -1.0, 0b11: 0.0}


def unpack_values(weight_packed: torch.Tensor) -> np.ndarray:
    """uint8 [N, K/4] -> float64 values [N, K], code c at bits 2i..2i+1 of byte j is weight 4j+i."""
    b = weight_packed.cpu().numpy().astype(np.int64)
    n, k4 = b.shape
    values = np.zeros((n, 4 * k4), dtype=np.float64)
    for i in range(4):
        codes = (b >> (2 * i)) & 0b11
        values[:, i::4] = np.vectorize(_VALUE_OF_CODE.get, otypes=[np.float64])(codes)
    return values


def dense_weight(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> np.ndarray:
    """float64 [N, K]: value(c[n, k]) * scale[n, k // 128]."""
    values = unpack_values(weight_packed)
    scales = np.repeat(weight_scale.cpu().to(torch.float64).numpy(), 128, axis=1)
    return values * scales


def linear_fp64(x: torch.Tensor, weight_packed, weight_scale, bias=None) -> torch.Tensor:
    """The fp64 oracle: x [..., K] -> [..., N] float64."""
    w = torch.from_numpy(dense_weight(weight_packed, weight_scale))
    y = x.cpu().to(torch.float64) @ w.T
    if bias is not None:
        y = y + bias.cpu().to(torch.float64)
    return y


def random_packed(n: int, k: int, *, generator=None, reserved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Random legal (or, with reserved=True, possibly 0b11-holding) packed weights and positive scales."""
    hi = 4 if reserved else 3
    codes = torch.randint(0, hi, (n, k), generator=generator, dtype=torch.int64)
    packed = codes[:, 0::4] | codes[:, 1::4] << 2 | codes[:, 2::4] << 4 | codes[:, 3::4] << 6
    scale = (torch.rand((n, k // 128), generator=generator) * 0.1 + 0.01).to(torch.float16)
    return packed.to(torch.uint8), scale


def assert_within_2x_of_dense(y: torch.Tensor, x: torch.Tensor, weight_packed, weight_scale, bias=None,
                              eps: float = 1e-6) -> None:  # fmt: skip
    """The 2x rule: ``y``'s max error against the fp64 oracle is at most twice the error of
    ``F.linear`` on the dequantized weights in x's dtype, plus ``eps``."""
    want = linear_fp64(x, weight_packed, weight_scale, bias)
    dense = torch.from_numpy(dense_weight(weight_packed, weight_scale)).to(x.dtype)
    ref = torch.nn.functional.linear(x.cpu(), dense, None if bias is None else bias.cpu().to(x.dtype))
    ref_err = float((ref.to(torch.float64) - want).abs().max())
    err = float((y.cpu().to(torch.float64) - want).abs().max())
    assert err <= 2 * ref_err + eps, f"error {err:.3g} > 2 x F.linear's {ref_err:.3g} + {eps:g}"


# --- kernel layouts and W2A8, read from the specs in ternop/layouts.py and ternop/activations.py ---


def _k_of_field(layout: str, p: int) -> int:
    """Offset in its 16-weight word of the weight that field p holds, as the layout spec words it."""
    if layout == "v1":
        return p
    if layout == "a16":
        return 2 * p if p < 8 else 2 * (p - 8) + 1
    if layout == "a8":
        return 4 * (p % 2) + p // 2 if p < 8 else 8 + 4 * ((p - 8) % 2) + (p - 8) // 2
    raise ValueError(layout)


def unpack_layout_values(weight_packed: torch.Tensor, layout: str) -> np.ndarray:
    """uint8 [N, K/4] in ``layout`` -> float64 values [N, K]; bytes 4w..4w+3 are the little-endian word w."""
    b = weight_packed.cpu().numpy().astype(np.uint32)
    n, k4 = b.shape
    words = b[:, 0::4] | b[:, 1::4] << 8 | b[:, 2::4] << 16 | b[:, 3::4] << 24  # [N, K/16]
    values = np.zeros((n, 4 * k4), dtype=np.float64)
    for p in range(16):
        field = (words >> (2 * p)) & 0b11
        if layout == "a16":
            v = np.where(field == 3, 0.0, field.astype(np.float64) - 1.0)
        else:
            v = np.vectorize(_VALUE_OF_CODE.get, otypes=[np.float64])(field)
        values[:, _k_of_field(layout, p)::16] = v
    return values


def quantize_rows_np(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per-token int8 quantization as the W2A8 spec words it: (q int64 [M, K], s_x float32 [M])."""
    xf = x.detach().cpu().to(torch.float32).numpy()
    amax = np.abs(xf).max(axis=1).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xf * inv[:, None]), -127, 127).astype(np.int64)
    return q, (amax / np.float32(127)).astype(np.float32)


def exact_sum_rows(m: int, d: int, act: str, dtype, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, weight) for ``ternop::rms_norm_quant`` whose sums of squares are exact in float32 in
    any order, so that every implementation must give the spec's bits: x = k/8 (|x| <= 1, squares
    in steps of 2^-6) and weights k/4; with ``relu2_glu`` gates in {0, +-1/2, +-1}, so that
    h = g^2 * u keeps steps of 2^-5 and D * 2^10 steps stay below 2^24. Row 0 is partly zero."""
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    x = torch.randint(-8, 9, (m, d), generator=g) / 8
    if act == "relu2_glu":
        x = torch.cat([torch.randint(-2, 3, (m, d), generator=g) / 2, x], dim=1)
    x[0, : x.shape[1] // 3] = 0
    w = torch.randint(1, 9, (d,), generator=g) / 4
    return x.to(dtype), w.to(dtype)


def rms_norm_quant_np(x: torch.Tensor, weight: torch.Tensor, eps: float, act: str = "none"):
    """``ternop::rms_norm_quant`` as its spec words it, in NumPy (float16 or float32 x; NumPy has
    no bfloat16): (q int64 [M, D], s_x float32 [M]). The sum of squares runs in float64 and
    rounds once to float32, so inputs whose squares sum exactly give the kernels' bits."""
    dt = {torch.float16: np.float16, torch.float32: np.float32}[x.dtype]
    xs = x.reshape(-1, x.shape[-1]).numpy()
    if act == "relu2_glu":
        d = xs.shape[1] // 2
        g = np.maximum(xs[:, :d].astype(np.float32), 0)
        h = ((g * g).astype(dt).astype(np.float32) * xs[:, d:].astype(np.float32)).astype(dt)
    else:
        h = xs
    hf = h.astype(np.float32)
    ss = (hf.astype(np.float64) ** 2).sum(axis=1).astype(np.float32)
    r = np.float32(1) / np.sqrt(ss / np.float32(hf.shape[1]) + np.float32(eps))
    y = (hf * r[:, None]).astype(dt).astype(np.float32)
    y = (weight.numpy().astype(np.float32) * y).astype(dt)
    return quantize_rows_np(torch.from_numpy(y.astype(np.float32)))


def linear_a8_fp64(x: torch.Tensor, weight_packed, weight_scale, bias=None, layout: str = "v1") -> torch.Tensor:
    """The W2A8 oracle: exact int partials per 128-block, then the scales, in float64."""
    q, sx = quantize_rows_np(x.reshape(-1, x.shape[-1]))
    v = unpack_layout_values(weight_packed, layout).astype(np.int64)
    m, k = q.shape
    nb = k // 128
    partials = np.einsum("mbk,nbk->mnb", q.reshape(m, nb, 128), v.reshape(-1, nb, 128))  # exact int64
    s = weight_scale.cpu().to(torch.float64).numpy()
    y = sx.astype(np.float64)[:, None] * (partials * s[None]).sum(axis=2)
    if bias is not None:
        y = y + bias.cpu().to(torch.float64).numpy()
    return torch.from_numpy(y).reshape(*x.shape[:-1], -1)


def linear_a8_row_scales_np(x: torch.Tensor, weight_packed, row_scale, bias=None, layout: str = "v1") -> np.ndarray:
    """The W2A8 spec with one scale per row (row_scale [N, 1]), in the spec's own float32 steps:
    fp32(fp32(S) * s_w) * s_x (+ bias), S the exact integer sum over all of K. Returns float32
    [M, N] before the cast to x's dtype; there is no freedom left, so kernels must match it bit for bit."""
    q, sx = quantize_rows_np(x.reshape(-1, x.shape[-1]))
    v = unpack_layout_values(weight_packed, layout).astype(np.int64)
    s_sum = (q @ v.T).astype(np.float32)  # exact integers below 2^24
    sw = row_scale.cpu().to(torch.float32).numpy()[:, 0]
    y = (s_sum * sw[None, :]).astype(np.float32) * sx[:, None]
    if bias is not None:
        y = y + bias.cpu().to(torch.float32).numpy()[None, :]
    return y.astype(np.float32)
