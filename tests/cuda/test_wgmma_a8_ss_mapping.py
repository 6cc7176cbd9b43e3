"""A NumPy replay of the decoders of the int8 shared-memory tile (ternop/cuda/csrc/ternary_wgmma_a8_ss.cu).

No GPU is needed. The decoders turn one 128-k block of a8-layout codes, 128 weight rows of 32
bytes, into the dense int8 tile that the consumers' wgmma reads by a K-major descriptor with the
128-byte swizzle. The replay takes the kernel's constants from its source and its formulas as
written (which word a decoder thread owns, where it stores the word's 16 values, the PRMT
decode), and the result must be the block's weights where the swizzle puts them: the byte of
row r and k at r * 128 + k with bits 4-6 of that offset XORed with bits 7-9, the layout a TMA
load with CU_TENSOR_MAP_SWIZZLE_128B gives a dense tile of 128-byte rows.

The epilogue's 16-bit staging is replayed the same way: the accumulators' wgmma layout through
stmatrix .trans, as PTX defines it, to the staging tile, and its banks.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from ternop import layouts
from ternop.cuda.cuda_ext import CSRC
from ternop.format import pack_codes
from tests.cuda.test_mma_mapping import U32, _const, prmt, s8

_SS_SRC = (CSRC / "ternary_wgmma_a8_ss.cu").read_text()
DECODERS = _const(_SS_SRC, "kSSDecoders")
ROWS = _const(_SS_SRC, "kSSRows")
TABLE = _const(_SS_SRC, "kTableSS")
SHIFTS = (0, 2, 16, 18)  # quad_ss's shifts for v.x, v.y, v.z, v.w


def quad_ss(word: np.ndarray, shift: int) -> np.ndarray:
    return prmt(np.full_like(word, TABLE), np.zeros_like(word), (word >> U32(shift)) & U32(0x3333))


def decode_block(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The decoders on one block: codes uint8 [ROWS, 32] (the a8 layout's bytes of the block) ->
    (the tile's bytes as stored, [ROWS * 128] int8; how many stores wrote each 16-byte chunk)."""
    words = np.ascontiguousarray(codes).view(U32).reshape(-1)  # the stage's code words, row-major
    decode_words = ROWS * 8 // DECODERS  # kDecodeWords
    row_step = DECODERS // 8  # kRowStep
    tile = np.zeros(ROWS * 128, np.int8)
    stores = np.zeros(ROWS * 8, np.int64)
    for t in range(DECODERS):
        word, row0 = t & 7, t >> 3
        w0 = row0 * 128 + ((word ^ (row0 & 7)) << 4)
        for j in range(decode_words):
            c = words[t + DECODERS * j : t + DECODERS * j + 1]
            v = np.concatenate([s8(quad_ss(c, shift))[0] for shift in SHIFTS])
            at = w0 + row_step * 128 * j
            tile[at : at + 16] = v
            stores[at // 16] += 1
    return tile, stores


def swizzled(r: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The byte offset of (row r, k) in a 1024-byte-aligned tile of 128-byte rows, 128-byte swizzle."""
    logical = r * 128 + k
    return logical ^ (((logical >> 7) & 7) << 4)


def test_the_decoders_cover_the_block_and_match_the_weights_where_the_swizzle_puts_them():
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 4, (ROWS, 128), generator=g).to(torch.uint8)
    codes[0, :16] = 3  # the reserved code reads as 0
    value = (codes & 1).long() - (codes >> 1).long()
    a8 = layouts.repack(pack_codes(codes), "a8").numpy()  # [ROWS, 32]
    tile, stores = decode_block(a8)
    assert stores.min() == stores.max() == 1, "every 16-byte chunk of the tile is stored exactly once"
    r, k = np.meshgrid(np.arange(ROWS), np.arange(128), indexing="ij")
    read = tile[swizzled(r, k)].astype(np.int64)
    assert np.array_equal(read, value.numpy()), np.argwhere(read != value.numpy())[:5]


def test_the_decoders_split_the_rows_evenly_and_keep_one_swizzle_position():
    """Each decoder owns words of rows kRowStep apart: a multiple of 8 keeps the chunk position of
    all of them, which is what lets the kernel store them at constant offsets from one base."""
    assert DECODERS % 8 == 0 and (ROWS * 8) % DECODERS == 0
    assert (DECODERS // 8) % 8 == 0


@pytest.mark.parametrize("decoders,right", [(64, True), (32, False)])
def test_the_replay_tells_a_wrong_mapping(monkeypatch, decoders, right):
    """The replay is not blind to the mapping: with 64 decoders (rows 8 apart) the same constant-offset
    stores would still be right; with 32 (rows 4 apart) they put half the words at the wrong chunk."""
    monkeypatch.setattr(sys.modules[__name__], "DECODERS", decoders)
    codes = torch.randint(0, 3, (ROWS, 128), generator=torch.Generator().manual_seed(6)).to(torch.uint8)
    value = (codes & 1).long() - (codes >> 1).long()
    tile, stores = decode_block(layouts.repack(pack_codes(codes), "a8").numpy())
    r, k = np.meshgrid(np.arange(ROWS), np.arange(128), indexing="ij")
    ok = stores.min() == stores.max() == 1 and np.array_equal(tile[swizzled(r, k)].astype(np.int64), value.numpy())
    assert ok == right


# The epilogue: 16-bit outputs staged by stmatrix .trans.
TOKENS = 256  # the larger tile; the smaller one takes the first 128 tokens' loop iterations
PITCH = ROWS * 2 + 16  # kPitch for a 16-bit output


def accumulators(cw: int, lane: int) -> dict[int, tuple[int, int]]:
    """acc[i] of consumer warp cw's lane as (weight row, token) of the CTA's tile: the wgmma
    m64nNk32 accumulator layout, lane g = lane / 4, q = lane % 4: acc[4 j + 2 h + e] holds row
    16 cw + g + 8 h (cw % 4 within its warpgroup's 64 rows) and token 8 j + 2 q + e."""
    g, q = lane // 4, lane % 4
    return {4 * j + 2 * h + e: (16 * cw + g + 8 * h, 8 * j + 2 * q + e)
            for j in range(TOKENS // 8) for h in (0, 1) for e in (0, 1)}  # fmt: skip


def stmatrix_address(cw: int, lane: int, pitch: int = PITCH) -> int:
    """The staging offset lane `lane` of consumer warp cw gives stmatrix for j = 0, as the kernel's
    st0: token 8 (mi / 2) + lane % 8 of the pair of groups, row half mi % 2 of the warp's 16 rows."""
    mi = lane // 8
    return (8 * (mi // 2) + lane % 8) * pitch + (16 * cw + 8 * (mi % 2)) * 2


def stage_16_bit(pitch: int = PITCH) -> tuple[dict[int, tuple[int, int]], np.ndarray]:
    """The kernel's stmatrix loop on the whole tile, with stmatrix .trans as PTX defines it: lane l
    holds element (l / 4, 2 (l % 4) + e) of matrix i in the e-th half of r[i]; (r, c) of matrix i goes
    to the address lane 8 i + c gives, plus 2 r. -> (what each byte offset of the staging holds, as
    (row, token) of its 16-bit element; how many times each 2-byte element was written)."""
    staged: dict[int, tuple[int, int]] = {}
    writes = np.zeros(TOKENS * pitch // 2, np.int64)
    for cw in range(8):
        frags = [accumulators(cw, lane) for lane in range(32)]
        for j in range(0, TOKENS // 8, 2):  # j < R / 4, R = BT / 2
            # p[2 jj + h] = pack2(acc[4 (j + jj) + 2 h], acc[4 (j + jj) + 2 h + 1])
            regs = [[(frags[lane][4 * (j + i // 2) + 2 * (i % 2)], frags[lane][4 * (j + i // 2) + 2 * (i % 2) + 1])
                     for i in range(4)] for lane in range(32)]  # fmt: skip
            addr = [stmatrix_address(cw, lane, pitch) + 8 * j * pitch for lane in range(32)]
            for i in range(4):
                for lane in range(32):
                    r, c0 = lane // 4, 2 * (lane % 4)
                    for e in (0, 1):
                        at = addr[8 * i + c0 + e] + 2 * r
                        staged[at] = regs[lane][i][e]
                        writes[at // 2] += 1
    return staged, writes


def test_the_16_bit_epilogue_stages_each_output_at_its_token_and_row():
    staged, writes = stage_16_bit()
    assert len(staged) == TOKENS * ROWS and writes.max() == 1
    for at, (row, token) in staged.items():
        assert at == token * PITCH + 2 * row, (at, row, token)


def matrix_banks(pitch: int) -> list[list[int]]:
    """The banks that each stored matrix's 8 addresses (8 tokens, 16 bytes each) cover."""
    out = []
    for cw in range(8):
        for lane0 in range(0, 32, 8):
            banks = []
            for lane in range(lane0, lane0 + 8):
                start = stmatrix_address(cw, lane, pitch)
                banks += [(start // 4 + w) % 32 for w in range(4)]
            out.append(sorted(banks))
    return out


def test_the_16_bit_epilogue_matrices_hit_every_bank_once():
    assert all(banks == list(range(32)) for banks in matrix_banks(PITCH))


def test_the_replay_tells_a_wrong_pitch():
    """Without the 16 bytes of padding the outputs still land right, but a matrix's 8 tokens all
    start in the same bank."""
    staged, _ = stage_16_bit(ROWS * 2)
    assert all(at == token * ROWS * 2 + 2 * row for at, (row, token) in staged.items())
    assert not any(banks == list(range(32)) for banks in matrix_banks(ROWS * 2))
