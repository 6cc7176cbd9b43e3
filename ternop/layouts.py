"""Kernel-native weight layouts: the same codes as format v1, reordered inside each 32-bit word.

This docstring is the spec of the layouts; docs/KERNELS.md explains why each exists.

The checkpoint format stays v1 (``ternop.format``). At load time a model may repack its
``weight_packed`` once into the layout that its kernels decode with the fewest
instructions, and pass the layout's tag to ``ternop.linear(..., layout=tag)``. Scales,
shapes and dtypes do not change: a repacked tensor is still ``uint8 [N, K/4]`` and
``weight_scale`` is still ``float16 [N, K/128]``.

Words
    Every layout groups the bytes of a row four at a time: bytes 4w..4w+3 form the
    little-endian 32-bit word w, which holds the 16 weights k in [16w, 16w + 16) of that
    row. Field p of a word is bits (2p, 2p + 1), p = 0..15. A layout says which k each
    field holds and how the field encodes the value v in {-1, 0, +1}.

``"v1"`` (the format itself)
    Field p holds the code of k = 16w + p: 0b00 is 0, 0b01 is +1, 0b10 is -1, 0b11 reads as 0.

``"a16"`` (fp16/bf16 activations)
    Field p holds u = v + 1 (0, 1 or 2) of k = 16w + 2p for p < 8 and of
    k = 16w + 2(p - 8) + 1 for p >= 8. Fields p and p + 8 are 16 bits apart and hold the
    neighbours (2p, 2p + 1), so one shift and one mask put a pair of weights into the two
    halves of a register, in the order the activations sit in memory.

``"a8"`` (int8 activations)
    Field p holds the v1 code of k = 16w + 4(p mod 2) + floor(p / 2) for p < 8, and of
    k = 16w + 8 + 4((p - 8) mod 2) + floor((p - 8) / 2) for p >= 8. Shifted right by
    s in {0, 2, 16, 18}, a word holds the codes of four neighbours 4r..4r+3 (r = 0..3 in
    that order) in its nibbles 0..3, which a mask with 0x3333 turns into the byte selectors
    of one PRMT: four int8 weights, in memory order, from a table of the four code values.

In ``"a16"`` the field value 3 never occurs: ``repack`` writes u from the v1 value, and a
reserved v1 code (value 0) becomes u = 1. ``"a8"`` keeps the v1 codes, so 0b11 reads as 0.
"""

from __future__ import annotations

import torch

from ternop.format import CODES_PER_BYTE, FormatError, codes_to_values, pack_codes, unpack_codes

LAYOUTS = ("v1", "a16", "a8")
# The integer tag of each layout that the GPU kernels take (0 = v1, 1 = a16, 2 = a8).
LAYOUT_CODES = {layout: code for code, layout in enumerate(LAYOUTS)}

CODES_PER_WORD = 16

# _K_OF_FIELD[layout][p]: which of the word's 16 weights field p holds.
_K_OF_FIELD = {
    "v1": tuple(range(16)),
    "a16": tuple(2 * p if p < 8 else 2 * (p - 8) + 1 for p in range(16)),
    "a8": tuple(4 * (p % 2) + p // 2 if p < 8 else 8 + 4 * ((p - 8) % 2) + (p - 8) // 2 for p in range(16)),
}

# Layouts whose fields hold u = v + 1 instead of the v1 code.
_OFFSET_CODED = ("a16",)

# Rows repacked at a time, so that the int8 temporaries stay near 16 MiB whatever the layer.
_CHUNK_CODES = 1 << 24


def check_layout(layout: str) -> None:
    """Raises ValueError unless ``layout`` is one of LAYOUTS."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown weight layout {layout!r}; the layouts are {', '.join(LAYOUTS)}")


def k_of_field(layout: str) -> tuple[int, ...]:
    """For each field p = 0..15 of a word, the offset k - 16w of the weight it holds."""
    check_layout(layout)
    return _K_OF_FIELD[layout]


def _check_packed(weight_packed: torch.Tensor) -> None:
    if weight_packed.dtype != torch.uint8 or weight_packed.dim() != 2:
        raise FormatError(
            f"weight_packed must be uint8 [N, K/4], got {weight_packed.dtype} {tuple(weight_packed.shape)}"
        )
    if (weight_packed.shape[1] * CODES_PER_BYTE) % CODES_PER_WORD:
        raise FormatError(f"K={weight_packed.shape[1] * CODES_PER_BYTE} must be a multiple of {CODES_PER_WORD}")


def _rows(weight_packed: torch.Tensor):
    n, k4 = weight_packed.shape
    step = max(1, _CHUNK_CODES // max(1, k4 * CODES_PER_BYTE))
    for r0 in range(0, n, step):
        yield r0, min(n, r0 + step)


def repack(weight_packed: torch.Tensor, layout: str) -> torch.Tensor:
    """v1 ``uint8 [N, K/4]`` -> the same weights in ``layout`` (a new tensor on the same device).

    ``repack(w, "v1")`` returns a copy. Runs with torch ops, on any device.
    """
    check_layout(layout)
    _check_packed(weight_packed)
    if layout == "v1":
        return weight_packed.clone()
    out = torch.empty_like(weight_packed)
    perm = torch.tensor(_K_OF_FIELD[layout], device=weight_packed.device)
    for r0, r1 in _rows(weight_packed):
        rows = weight_packed[r0:r1]
        if layout in _OFFSET_CODED:
            fields = (codes_to_values(unpack_codes(rows), torch.int8) + 1).to(torch.uint8)
        else:
            fields = unpack_codes(rows)
        fields = fields.view(rows.shape[0], -1, CODES_PER_WORD).index_select(2, perm)
        out[r0:r1] = pack_codes(fields.reshape(rows.shape[0], -1))
    return out


def to_v1(weight_packed: torch.Tensor, layout: str) -> torch.Tensor:
    """The inverse of ``repack``: ``layout`` -> v1 codes (a new tensor; a field value 3 reads as 0)."""
    check_layout(layout)
    _check_packed(weight_packed)
    if layout == "v1":
        return weight_packed.clone()
    out = torch.empty_like(weight_packed)
    inverse = torch.empty(CODES_PER_WORD, dtype=torch.long)
    inverse[torch.tensor(_K_OF_FIELD[layout])] = torch.arange(CODES_PER_WORD)
    inverse = inverse.to(weight_packed.device)
    for r0, r1 in _rows(weight_packed):
        rows = weight_packed[r0:r1]
        fields = unpack_codes(rows).view(rows.shape[0], -1, CODES_PER_WORD).index_select(2, inverse)
        fields = fields.reshape(rows.shape[0], -1)
        if layout in _OFFSET_CODED:
            u = fields.to(torch.int8)
            fields = torch.where(u == 2, 0b01, torch.where(u == 0, 0b10, 0)).to(torch.uint8)
        out[r0:r1] = pack_codes(fields)
    return out


def preferred_layout(activation_bits: int, device: torch.device | str) -> str:
    """The layout whose kernels are fastest for ``activation_bits`` on ``device``.

    CPU: "v1" (the reference unpacks any layout; repacking buys nothing). CUDA: "a8" for
    int8 activations, "a16" for fp16/bf16 ones.
    """
    if activation_bits not in (8, 16):
        raise ValueError(f"activation_bits must be 8 or 16, got {activation_bits}")
    device = torch.device(device)
    if device.type != "cuda":
        return "v1"
    return "a8" if activation_bits == 8 else "a16"
