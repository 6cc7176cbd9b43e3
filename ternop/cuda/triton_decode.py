"""Triton decoders of ternary weight words, shared by the fused kernels and the dequantizer.

A program loads one 128-wide scale block of BLOCK_N rows as int32 words [BLOCK_N, 8]
(``weight_packed.view(int32)``); these helpers turn it into the block's weights in natural
k order. ``USE_ASM`` (on a GPU) decodes with inline PTX that yields two fp16/bf16 or four
int8 weights per short instruction group; without it (the Triton interpreter, or a layout
the asm does not read) the same values come from plain integer ops, bit for bit.

Layout codes: 0 = "v1", 1 = "a16", 2 = "a8" (``ternop.layouts`` is the spec).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _plus2(words):
    """v1 words -> words whose 2-bit fields hold v + 2 in {1, 2, 3} (no carries between fields).

    Per field lo - hi + 2 = v + 2, and the reserved 0b11 gives 2 (v = 0). -0x55555556 is
    0xAAAAAAAA as int32; wrap-around is intended.
    """
    return (words & 0x55555555) + (-0x55555556) - ((words >> 1) & 0x55555555)


def _pair_asm(ty: str, magic: int, offset: int) -> tl.constexpr:
    """PTX for two weights: fields (j, j + 8) of $1 shifted by $3 -> ((f_j - offset) * s, (f_{j+8} - offset) * s).

    OR-ing a field into the mantissa of `magic` (a half whose ulp is 1) gives magic + f exactly;
    one packed subtract leaves f - offset, one packed multiply by the scale pair $5 applies the
    scale (exact: +-1 * s).
    """
    pair, bias = magic * 0x10001, (magic + offset) * 0x10001
    return tl.constexpr(
        "{ .reg .b32 t, c; shr.u32 t, $1, $3; "
        f"lop3.b32 t, t, 0x00030003, {pair:#010x}, 0xea; mov.b32 c, {bias:#010x}; "
        f"sub.rn.{ty}x2 t, t, c; mul.rn.{ty}x2 $0, t, $5; }}"
    )


# 2^10 (fp16) and 2^7 (bf16) have ulp 1. v1 fields hold v + 2 (after _plus2), a16 fields v + 1.
_F16_V1 = _pair_asm("f16", 0x6400, 2)
_F16_A16 = _pair_asm("f16", 0x6400, 1)
_BF16_V1 = _pair_asm("bf16", 0x4300, 2)
_BF16_A16 = _pair_asm("bf16", 0x4300, 1)


@triton.jit
def _pair(d, j: tl.constexpr, s2, OFFSET: tl.constexpr, DTYPE: tl.constexpr):
    """d: the word twice per element pair; s2: the scale pair -> the pair (j, j + 8) of weights times s."""
    sh = tl.full(d.shape, 2 * j, tl.int32)
    if DTYPE == tl.float16:
        return tl.inline_asm_elementwise(
            asm=_F16_V1 if OFFSET == 2 else _F16_A16, constraints="=r,r,r,r,r,r", args=[d, sh, s2],
            dtype=tl.float16, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(
            asm=_BF16_V1 if OFFSET == 2 else _BF16_A16, constraints="=r,r,r,r,r,r", args=[d, sh, s2],
            dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def shift_of_k(kk, LAYOUT: tl.constexpr):
    """For the offsets kk = k - 16w of a word's weights: the bit position of their field.

    LAYOUT 0 = "v1", 1 = "a16", 2 = "a8" (ternop.layouts).
    """
    if LAYOUT == 0:
        p = kk
    elif LAYOUT == 1:
        p = kk // 2 + 8 * (kk % 2)
    else:
        r = kk // 4
        p = 8 * (r // 2) + (r % 2) + 2 * (kk % 4)
    return 2 * p


@triton.jit
def values_plain(words, LAYOUT: tl.constexpr, BLOCK_N: tl.constexpr):
    """words int32 [BLOCK_N, 8] -> int32 values v [BLOCK_N, 128] in natural k order (no asm)."""
    sh = shift_of_k(tl.arange(0, 16), LAYOUT)
    f = (words[:, :, None] >> sh[None, None, :]) & 3
    if LAYOUT == 1:
        v = f - 1
    else:
        v = (f & 1) - (f >> 1)
    return tl.reshape(v, (BLOCK_N, 128))


@triton.jit
def decode_a16(words, scale, LAYOUT: tl.constexpr, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
                USE_ASM: tl.constexpr):
    """words int32 [BLOCK_N, 8] (one scale block of BLOCK_N rows), scale [BLOCK_N] in DTYPE
    -> v * scale in DTYPE, [BLOCK_N, 128], natural k order. The asm path decodes LAYOUT 0
    ("v1") and 1 ("a16"); any layout decodes through the plain path."""
    if USE_ASM and LAYOUT != 2:
        if LAYOUT == 0:
            d = _plus2(words)
            OFFSET: tl.constexpr = 2
        else:
            d = words
            OFFSET: tl.constexpr = 1
        dd = tl.join(d, d)  # the asm reads one word per pair of outputs
        s2 = tl.broadcast_to(scale[:, None, None], dd.shape)
        p0 = _pair(dd, 0, s2, OFFSET, DTYPE)
        p1 = _pair(dd, 1, s2, OFFSET, DTYPE)
        p2 = _pair(dd, 2, s2, OFFSET, DTYPE)
        p3 = _pair(dd, 3, s2, OFFSET, DTYPE)
        p4 = _pair(dd, 4, s2, OFFSET, DTYPE)
        p5 = _pair(dd, 5, s2, OFFSET, DTYPE)
        p6 = _pair(dd, 6, s2, OFFSET, DTYPE)
        p7 = _pair(dd, 7, s2, OFFSET, DTYPE)
        # p_j holds fields (j, j + 8) as [.., h]; join j's bits in the order that makes a
        # row-major reshape give k: [.., h, b2, b1, b0] with j = 4 b2 + 2 b1 + b0.
        t = tl.join(tl.join(tl.join(p0, p4), tl.join(p2, p6)), tl.join(tl.join(p1, p5), tl.join(p3, p7)))
        if LAYOUT == 1:
            # a16: fields (j, j + 8) are the neighbours (2j, 2j + 1): k = 2j + h.
            t = tl.permute(t, (0, 1, 3, 4, 5, 2))
        # v1: fields (j, j + 8) are k = j and j + 8: k = 8h + j, already in order.
        return tl.reshape(t, (BLOCK_N, 128))
    else:
        v = values_plain(words, LAYOUT, BLOCK_N)
        return v.to(DTYPE) * scale[:, None]


@triton.jit
def _quad_i8(d, sh):
    """Four fields of d, 4 bits apart after the shift, -> four int8 values (one PRMT lookup).

    The a8 layout puts the codes of four neighbouring weights at bits (s, s+4, s+8, s+12)
    for s in {0, 2, 16, 18}; masked with 0x3333 they are PRMT byte selectors into the table
    0x00FF0100 = bytes (0, +1, -1, 0), the values of the codes 0b00, 0b01, 0b10, 0b11.
    """
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, tab;
        shr.u32 t, $1, $5;
        and.b32 t, t, 0x3333;
        mov.b32 tab, 0x00FF0100;
        prmt.b32 $0, tab, tab, t;
        }""",
        constraints="=r,r,r,r,r,r,r,r,r", args=[d, sh], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def decode_a8(words, LAYOUT: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
    """words int32 [BLOCK_N, 8] -> int8 values [BLOCK_N, 128], natural k order. The asm path
    decodes LAYOUT 2 ("a8"); any layout decodes through the plain path."""
    if USE_ASM and LAYOUT == 2:
        dd = tl.join(words, words)
        d4 = tl.reshape(tl.join(dd, dd), (BLOCK_N, 8, 4))
        q0 = _quad_i8(d4, tl.full(d4.shape, 0, tl.int32))  # k = 0..3 of the word
        q1 = _quad_i8(d4, tl.full(d4.shape, 2, tl.int32))  # k = 4..7
        q2 = _quad_i8(d4, tl.full(d4.shape, 16, tl.int32))  # k = 8..11
        q3 = _quad_i8(d4, tl.full(d4.shape, 18, tl.int32))  # k = 12..15
        # q_r holds k = 4r + i as [.., i]; join to [.., i, r1, r0] and move i last.
        t = tl.join(tl.join(q0, q2), tl.join(q1, q3))
        t = tl.permute(t, (0, 1, 3, 4, 2))
        return tl.reshape(t, (BLOCK_N, 128))
    else:
        return values_plain(words, LAYOUT, BLOCK_N).to(tl.int8)
