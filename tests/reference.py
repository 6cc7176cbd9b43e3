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
