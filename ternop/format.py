"""ternop format v1: how ternary weights are stored.

This docstring is the spec; docs/FORMAT.md states the same thing with a worked example.

Codes
    Each weight is a 2-bit code: 0b00 is 0, 0b01 is +1, 0b10 is -1.
    0b11 is reserved: writers never emit it, loaders and validators reject it,
    kernels read it as 0 (value = (c & 1) - (c >> 1)).

Packing
    Codes are packed along K (the input dimension), four per byte, little-endian
    inside the byte:
        byte[n, j] = c[n,4j] | c[n,4j+1] << 2 | c[n,4j+2] << 4 | c[n,4j+3] << 6
    ``weight_packed`` is ``uint8 [N, K/4]``, row-major.

Scales
    ``weight_scale`` is ``float16 [N, K/128]``; row n, block b scales the weights
    k in [128b, 128b + 128).

Dequantization
    W[n, k] = value(c[n, k]) * scale[n, k // 128]. K must be a multiple of 128.

Activations
    ``quantization_config.activation_bits`` says how a checkpoint's ternary layers treat
    their input x: 16 (the default; x is used as given) or 8 (x is quantized per token to
    int8 and products accumulate in int32 per 128-block; ternop/activations.py is the spec).
"""

from __future__ import annotations

import torch

FORMAT_VERSION = 1
BLOCK_SIZE = 128
CODES_PER_BYTE = 4

CODE_ZERO = 0b00
CODE_PLUS = 0b01
CODE_MINUS = 0b10
CODE_RESERVED = 0b11

PACKED_DTYPE = torch.uint8
SCALE_DTYPE = torch.float16

ACTIVATION_BITS = (16, 8)
DEFAULT_ACTIVATION_BITS = 16


class FormatError(ValueError):
    """A tensor does not follow format v1. The message names the tensor and the rule."""


def check_activation_bits(value, where: str = "quantization_config") -> int:
    """``value`` as an int if it is a valid ``activation_bits`` (16 or 8); else FormatError naming the field."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in ACTIVATION_BITS:
        raise FormatError(
            f"{where}: activation_bits {value!r} is not supported; it must be 16 (activations as given, "
            "the default) or 8 (int8 activations per token, see ternop/activations.py)"
        )
    return int(value)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise FormatError(msg)


def values_to_codes(values: torch.Tensor) -> torch.Tensor:
    """Ternary values {-1, 0, +1} (any integer or float dtype) -> uint8 codes, same shape."""
    _require(
        bool(((values == 0) | (values == 1) | (values == -1)).all()),
        "values must all be -1, 0 or +1",
    )
    codes = torch.zeros(values.shape, dtype=torch.uint8, device=values.device)
    codes[values == 1] = CODE_PLUS
    codes[values == -1] = CODE_MINUS
    return codes


def codes_to_values(codes: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """uint8 codes -> values in ``dtype``. The reserved code 0b11 reads as 0, as in the kernels."""
    c = codes.to(torch.int8)
    return ((c & 1) - ((c >> 1) & 1)).to(dtype)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, K]`` (each < 4) -> packed ``uint8 [N, K/4]``."""
    _require(codes.dtype == torch.uint8, f"codes must be uint8, got {codes.dtype}")
    _require(codes.dim() == 2, f"codes must be 2-D [N, K], got shape {tuple(codes.shape)}")
    n, k = codes.shape
    _require(k % CODES_PER_BYTE == 0, f"codes K={k} must be a multiple of {CODES_PER_BYTE}")
    _require(bool((codes < 4).all()), "codes must be 2-bit values (< 4)")
    c = codes.reshape(n, k // CODES_PER_BYTE, CODES_PER_BYTE)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """packed ``uint8 [N, K/4]`` -> uint8 codes ``[N, K]`` (reserved codes are kept as 3)."""
    _require(packed.dtype == torch.uint8, f"weight_packed must be uint8, got {packed.dtype}")
    _require(packed.dim() == 2, f"weight_packed must be 2-D [N, K/4], got shape {tuple(packed.shape)}")
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & 3
    return codes.reshape(packed.shape[0], packed.shape[1] * CODES_PER_BYTE)


def has_reserved_codes(packed: torch.Tensor) -> torch.Tensor:
    """Bool tensor, shape ``packed.shape``: True where a byte holds the reserved code 0b11.

    A 2-bit slot is 0b11 exactly when its low bit and its high bit are both set.
    """
    return ((packed & (packed >> 1)) & 0x55) != 0


def check_shapes(weight_packed: torch.Tensor, weight_scale: torch.Tensor, name: str = "weight") -> tuple[int, int]:
    """Checks dtypes and shapes of a (packed, scale) pair and returns (N, K)."""
    _require(
        weight_packed.dtype == PACKED_DTYPE,
        f"{name}: weight_packed must be uint8, got {weight_packed.dtype}",
    )
    _require(
        weight_scale.dtype == SCALE_DTYPE,
        f"{name}: weight_scale must be float16, got {weight_scale.dtype}",
    )
    _require(
        weight_packed.dim() == 2,
        f"{name}: weight_packed must be 2-D [N, K/4], got shape {tuple(weight_packed.shape)}",
    )
    n, k4 = weight_packed.shape
    k = k4 * CODES_PER_BYTE
    _require(n > 0 and k > 0, f"{name}: weight_packed is empty, shape {tuple(weight_packed.shape)}")
    _require(
        k % BLOCK_SIZE == 0,
        f"{name}: K={k} (weight_packed [N, K/4] = {tuple(weight_packed.shape)}) "
        f"must be a multiple of the block size {BLOCK_SIZE}",
    )
    expected = (n, k // BLOCK_SIZE)
    _require(
        tuple(weight_scale.shape) == expected,
        f"{name}: weight_scale must have shape [N, K/{BLOCK_SIZE}] = {list(expected)}, "
        f"got {list(weight_scale.shape)}",
    )
    return n, k


def validate(weight_packed: torch.Tensor, weight_scale: torch.Tensor, name: str = "weight") -> None:
    """Full v1 check of one layer: dtypes, shapes, no reserved code, finite scales.

    Raises FormatError naming ``name`` and the first offending row.
    """
    check_shapes(weight_packed, weight_scale, name)
    bad = has_reserved_codes(weight_packed)
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise FormatError(
            f"{name}: weight_packed holds the reserved code 0b11 (first at row {row}, byte {col}); "
            "the checkpoint is corrupt or was written by a non-conforming writer"
        )
    finite = torch.isfinite(weight_scale)
    if not bool(finite.all()):
        row, col = (int(i) for i in (~finite).nonzero()[0])
        raise FormatError(
            f"{name}: weight_scale holds a non-finite value {float(weight_scale[row, col])} "
            f"at row {row}, block {col}"
        )


def dequantize(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(uint8 [N, K/4], float16 [N, K/128]) -> dense ``[N, K]`` in ``dtype``.

    The product value * scale is formed in fp32 and then cast, so it is exact in any
    dtype that holds the fp16 scale.
    """
    n, k = check_shapes(weight_packed, weight_scale)
    values = codes_to_values(unpack_codes(weight_packed), torch.float32)
    scales = weight_scale.to(torch.float32).repeat_interleave(BLOCK_SIZE, dim=1)
    return (values * scales).to(dtype)


def packed_bytes(n: int, k: int) -> int:
    """Bytes that one N x K ternary layer takes (codes + scales)."""
    return n * k // CODES_PER_BYTE + n * (k // BLOCK_SIZE) * 2
