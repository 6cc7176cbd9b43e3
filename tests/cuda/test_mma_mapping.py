"""A NumPy replay of the tensor-core kernels' index mapping (ternop/cuda/csrc/ternary_mma.cu
for fp16/bf16 x in format v1 and the a16 layout, ternary_mma_a8.cu for int8 x in the a8 layout,
and their work split over sets of rows and warps, small_m_split in ternary_common.cuh).

No GPU is needed: each function below transliterates one piece of a kernel (the constants are
read from the sources, the formulas are the same), the mma.sync fragment layouts are
assembled as the PTX ISA defines them, and the result must equal x @ W.T. With integer-valued
x and power-of-two scales every product and sum is exact in fp32, so any wrong k, row, token
or decode shows up as an exact mismatch. The final rounding to x's dtype is not replayed
(the result is compared before it).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from ternop import layouts
from ternop.cuda.cuda_ext import CSRC
from ternop.format import dequantize, pack_codes

_MMA_SRC = (CSRC / "ternary_mma.cu").read_text()
_A8_SRC = (CSRC / "ternary_mma_a8.cu").read_text()
_COMMON_SRC = (CSRC / "ternary_common.cuh").read_text()


def _const(src: str, name: str) -> int:
    """The value of ``constexpr ... name = <literal>`` in a kernel source."""
    m = re.search(rf"\b{name}\s*=\s*(0x[0-9a-fA-F]+|\d+)u?;", src)
    assert m, f"{name} not found in the kernel source"
    return int(m.group(1), 0)


def _struct_const(src: str, dtype: str, name: str) -> int:
    cpp = {"fp16": "__half", "bf16": "__nv_bfloat16"}[dtype]
    body = re.search(rf"struct Mma<{cpp}> \{{(.*?)\}};", src, re.S).group(1)
    return _const(body, name)


MAX_WARPS = _const(_MMA_SRC, "kMaxWarps")
DEPTH = _const(_MMA_SRC, "kDepth")
MAGIC = {d: _struct_const(_MMA_SRC, d, "kMagic") for d in ("fp16", "bf16")}
BIAS = {d: _struct_const(_MMA_SRC, d, "kBias") for d in ("fp16", "bf16")}
BIAS_A16 = {d: _struct_const(_MMA_SRC, d, "kBiasA16") for d in ("fp16", "bf16")}
A8_MAX_WARPS = _const(_A8_SRC, "kMaxWarpsA8")
A8_DEPTH = _const(_A8_SRC, "kDepthA8")
A8_TABLE = _const(_A8_SRC, "kTable")
MIN_CTAS_PER_2_SMS = _const(_COMMON_SRC, "kSmallMMinCtasPer2Sms")
# x in shared memory (the a16 one-tile kernel where a CTA holds two or more sets): each token's
# K / 8 16-byte chunks plus XS_PAD, and at most XS_MAX_BYTES a CTA.
XS_PAD = int(re.search(r"xs_stride\(int K\) \{ return K / 8 \+ (\d+); \}", _MMA_SRC).group(1))
XS_MAX_BYTES = int(re.search(r"kMaxXSmemBytes = (\d+) \* 1024;", _MMA_SRC).group(1)) * 1024
A8_ONE_TILE_CTAS_PER_SM = _const(_A8_SRC, "kOneTileCtasPerSm")
A8_FUSED_MAX_SETS = _const(_A8_SRC, "kFusedMaxSets")
SMS = 132  # an H200's multiprocessors, for the kernels' own choice of the split
U32 = np.uint32


def halves_to_float(r: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """uint32 registers -> (low half, high half) as float32 values of fp16 or bf16 bits."""
    lo, hi = (r & 0xFFFF).astype(np.uint16), (r >> 16).astype(np.uint16)
    if dtype == "fp16":
        return lo.view(np.float16).astype(np.float32), hi.view(np.float16).astype(np.float32)
    return ((lo.astype(U32) << 16).view(np.float32), (hi.astype(U32) << 16).view(np.float32))


def float_to_bits(v: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values exactly representable in fp16/bf16 -> uint16 bits."""
    if dtype == "fp16":
        out = v.astype(np.float16)
        assert np.array_equal(out.astype(np.float32), v)
        return out.view(np.uint16)
    bits = v.astype(np.float32).view(U32)
    assert not np.any(bits & 0xFFFF), "value is not a bf16"
    return (bits >> 16).astype(np.uint16)


def sub2(a: np.ndarray, b: int, dtype: str) -> np.ndarray:
    """HSUB2 on packed pairs; the operands here are exact, so rounding never happens."""
    alo, ahi = halves_to_float(a, dtype)
    blo, bhi = halves_to_float(np.full_like(a, b), dtype)
    lo, hi = alo - blo, ahi - bhi
    return float_to_bits(lo, dtype).astype(U32) | (float_to_bits(hi, dtype).astype(U32) << 16)


def plus2(w: np.ndarray) -> np.ndarray:
    w = w.astype(np.uint64)  # the kernel's uint32 arithmetic, wrapped below
    return ((w & 0x55555555) + 0xAAAAAAAA - ((w >> 1) & 0x55555555)).astype(np.uint64).__and__(0xFFFFFFFF).astype(U32)


def pair(d: np.ndarray, j: int, dtype: str, a16: bool = False) -> np.ndarray:
    r = ((d >> U32(2 * j)) & U32(0x00030003)) | U32(MAGIC[dtype])  # lop3 0xEA: (a & b) | c
    return sub2(r, (BIAS_A16 if a16 else BIAS)[dtype], dtype)


def byte_perm(x: np.ndarray, y: np.ndarray, s: int) -> np.ndarray:
    """CUDA __byte_perm: result byte n is byte ((s >> 4n) & 7) of the 8-byte {y, x}."""
    both = x.astype(np.uint64) | (y.astype(np.uint64) << 32)
    out = np.zeros_like(x, dtype=U32)
    for n in range(4):
        sel = (s >> (4 * n)) & 7
        out |= (((both >> np.uint64(8 * sel)) & np.uint64(0xFF)).astype(U32)) << U32(8 * n)
    return out


def warps_for(blocks: int, max_warps: int = MAX_WARPS) -> int:
    w = 1
    while w < max_warps and blocks // (2 * w) >= 2:
        w *= 2
    return w


def small_m_split(n: int, k: int, sms: int, row_groups: int, max_warps: int) -> tuple[int, int]:
    """small_m_split: (sets of 16 rows per CTA, warps per set)."""
    w = warps_for(k // 128, max_warps)
    r = row_groups
    if r <= 0:
        r = 1
        while 2 * r <= max_warps and 2 * -(-n // (32 * r)) >= MIN_CTAS_PER_2_SMS * sms:
            r *= 2
    return r, (1 if r >= w else w // r)


def mma(c: np.ndarray, a: list[np.ndarray], b: list[np.ndarray], dtype: str) -> np.ndarray:
    """mma.sync.m16n8k16.row.col: a[4], b[2] are [32] lane registers, c [32, 4] fp32.

    Fragment layouts (PTX ISA): lane = 4 * groupID + tq.
      A reg i holds (row groupID + 8 * (i % 2), cols 2tq + 8 * (i // 2) + {0, 1}).
      B reg i holds (rows 2tq + 8 * i + {0, 1}, col groupID).
      C element i is (row groupID + 8 * (i // 2), col 2tq + i % 2).
    """
    A = np.zeros((16, 16), np.float32)
    B = np.zeros((16, 8), np.float32)
    for lane in range(32):
        gid, tq = divmod(lane, 4)
        for i in range(4):
            lo, hi = halves_to_float(a[i][lane : lane + 1], dtype)
            row, col = gid + 8 * (i % 2), 2 * tq + 8 * (i // 2)
            A[row, col], A[row, col + 1] = lo[0], hi[0]
        for i in range(2):
            lo, hi = halves_to_float(b[i][lane : lane + 1], dtype)
            B[2 * tq + 8 * i, gid], B[2 * tq + 8 * i + 1, gid] = lo[0], hi[0]
    D = A.astype(np.float64) @ B.astype(np.float64)  # exact for these inputs
    out = c.copy()
    for lane in range(32):
        gid, tq = divmod(lane, 4)
        for i in range(4):
            out[lane, i] += np.float32(D[gid + 8 * (i // 2), 2 * tq + i % 2])
    return out


def xs_stride(k: int) -> int:
    return k // 8 + XS_PAD


def takes_shared_x(m: int, k: int, sets: int, a16: bool) -> bool:
    """launch_t's rule for x in shared memory."""
    return a16 and m <= 8 and sets >= 2 and m * xs_stride(k) * 16 <= XS_MAX_BYTES


RING_TOKEN_CHUNKS = _const(_MMA_SRC, "kRingTokenChunks")


def takes_x_ring(m: int, n: int, k: int, a16: bool) -> bool:
    """launch_t's rule for the x ring (takes_x_ring): the two-tile a16 kernel, except on layers with
    N <= K and at least 2^24 weights."""
    return a16 and m > 8 and not (n <= k and n * k >= 1 << 24)


def ring_chunk(lane: int) -> int:
    """The chunk of a block's 16 that lanes lane and lane + 16 copy (ring_chunk)."""
    return ((lane & 7) >> 1) * 4 + (lane & 1) + ((lane >> 3) & 1) * 2


def ring_copy_index(lane: int, m: int, slot: int, M: int) -> int:
    """Where lane's copy of token m goes: slot * M * 20 + m * 20 + (r & 3) * 4 + (r >> 2), r = ring_chunk(lane % 16)."""
    rk = ring_chunk(lane & 15)
    return (slot * M + m) * RING_TOKEN_CHUNKS + (rk & 3) * 4 + (rk >> 2)


def ring_copy(slots: np.ndarray, x_words: np.ndarray, b_begin: int, j: int, slot: int) -> None:
    """ring_copy(j, slot): lane l copies chunk ring_chunk(l % 16) of block b_begin + j for tokens
    l / 16, l / 16 + 2, ... (ring_copy_index)."""
    M = x_words.shape[0]
    for lane in range(32):
        rk, rm = ring_chunk(lane & 15), lane >> 4
        for m in range(rm, M, 2):
            c = (b_begin + j) * 16 + rk  # chunk of token m's row
            slots[ring_copy_index(lane, m, slot, M)] = x_words[m, 4 * c : 4 * c + 4]


def ring_index(g: np.ndarray, q: np.ndarray, M: int, t: int, u: int, i: int) -> np.ndarray:
    """The chunk a lane reads from slot u for tile t, mma steps (i, i + 4): (u * M + 8t + g) * 20 + 4i + q."""
    return (u * M + t * 8 + g) * RING_TOKEN_CHUNKS + 4 * i + q


def ring_read(slots: np.ndarray, g: np.ndarray, q: np.ndarray, M: int, t: int, u: int) -> np.ndarray:
    """Tile t's 16 registers from slot u; the lanes of tokens past M read nothing (zeros)."""
    m = t * 8 + g
    idx = [np.where(m < M, ring_index(g, q, M, t, u, i), 0) for i in range(4)]
    v = np.concatenate([slots[ix] for ix in idx], axis=1)
    return np.where((m < M)[:, None], v, U32(0))


def copy_x_to_shared(x_words: np.ndarray) -> np.ndarray:
    """The kSmemX copy: chunk c (16 bytes, words 4c..4c+3) of token m at
    m * xs_stride(K) + (c >> 4) * 16 + (c & 3) * 4 + ((c >> 2) & 3). Unwritten chunks hold NaN bits."""
    M, words = x_words.shape
    k = 2 * words
    xs = np.full((M * xs_stride(k), 4), 0xFFFFFFFF, U32)
    for m in range(M):
        for c in range(k // 8):
            xs[m * xs_stride(k) + (c >> 4) * 16 + (c & 3) * 4 + ((c >> 2) & 3)] = x_words[m, 4 * c : 4 * c + 4]
    return xs


def shared_x_index(g: np.ndarray, q: np.ndarray, M: int, k: int, blk: int, i: int) -> np.ndarray:
    """The chunk a lane reads for mma steps (i, i + 4) of block blk: xo + 16 u + 4 i, with
    xo = (g < M ? g : (M > 1 ? g & 1 : 0)) * xs_stride(K) + b_begin * 16 + q and b_begin + u = blk."""
    return np.where(g < M, g, (g & 1) if M > 1 else 0) * xs_stride(k) + blk * 16 + 4 * i + q


def _block(acc, wa, wb, ws, r0, r1, blk, x_words, g, q, M, NT, dtype, a16, xs=None, xring=None):
    """One scale block of one warp: 8 mma steps into C per n8 tile, then acc += C * scale.
    x from shared memory (xs), from the ring (xring: the registers read from it), or global memory."""
    lanes = np.arange(32)
    sa = ws[r0, blk].astype(np.float32)
    sb = ws[r1, blk].astype(np.float32)
    xv = []
    if xs is not None:  # one tile: four 16-byte chunks from shared memory
        k = 2 * x_words.shape[1]
        xv.append(np.concatenate([xs[shared_x_index(g, q, M, k, blk, i)] for i in range(4)], axis=1))
    elif xring is not None:
        xv.extend(xring)
    else:
        for t in range(NT):
            m = t * 8 + g
            tok = np.where(m < M, m, 0)
            # load_x: 16 registers from element blk * 128 + 32q, i.e. word (blk * 128 + 32q) / 2
            xv.append(np.stack([x_words[tok[lane], (blk * 128 + 32 * q[lane]) // 2 :][:16] for lane in lanes]))
    c = np.zeros((NT, 32, 4), np.float32)
    for h in range(2):
        d_g, d_g8 = (wa[:, h], wb[:, h]) if a16 else (plus2(wa[:, h]), plus2(wb[:, h]))
        for s in range(4):
            a = [pair(d_g, 2 * s, dtype, a16), pair(d_g8, 2 * s, dtype, a16),
                 pair(d_g, 2 * s + 1, dtype, a16), pair(d_g8, 2 * s + 1, dtype, a16)]
            for t in range(NT):
                if a16:
                    b = [xv[t][:, 8 * h + 2 * s], xv[t][:, 8 * h + 2 * s + 1]]
                else:
                    lo, hi = xv[t][:, 8 * h + s], xv[t][:, 8 * h + s + 4]
                    b = [byte_perm(lo, hi, 0x5410), byte_perm(lo, hi, 0x7632)]
                c[t] = mma(c[t], a, b, dtype)
    for t in range(NT):
        acc[t][:, 0] = c[t][:, 0] * sa + acc[t][:, 0]
        acc[t][:, 1] = c[t][:, 1] * sa + acc[t][:, 1]
        acc[t][:, 2] = c[t][:, 2] * sb + acc[t][:, 2]
        acc[t][:, 3] = c[t][:, 3] * sb + acc[t][:, 3]
    return acc


def kernel(x_bits: np.ndarray, wp: np.ndarray, ws: np.ndarray, bias: np.ndarray | None, dtype: str,
           a16: bool = False, row_groups: int = -1, x_ring: bool | None = None) -> np.ndarray:
    """Replays launch_ternary_mma: x_bits uint16 [M, K], wp uint8 [N, K/4] (v1, or a16), ws fp16 [N, K/128].
    x_ring: whether the two-tile a16 kernel reads x through the ring; None takes the launcher's rule."""
    M, K = x_bits.shape
    N = wp.shape[0]
    NT = 1 if M <= 8 else 2
    blocks = K // 128
    sets, warps = small_m_split(N, K, SMS, row_groups, MAX_WARPS)
    per_warp = (blocks + warps - 1) // warps
    x_words = np.ascontiguousarray(x_bits).view(U32)  # [M, K/2]: little-endian pairs of halves
    xs = copy_x_to_shared(x_words) if takes_shared_x(M, K, sets, a16) else None
    use_ring = takes_x_ring(M, N, K, a16) if x_ring is None else (x_ring and a16 and NT == 2)
    w_bytes = np.ascontiguousarray(wp)
    out = np.full((M, N), np.nan, np.float32)
    lanes = np.arange(32)
    g, q = lanes // 4, lanes % 4
    for cta, s in np.ndindex(-(-N // (16 * sets)), sets):  # set s of CTA cta: its own 16 rows
        n0 = (cta * sets + s) * 16
        row0, row1 = n0 + g, n0 + g + 8
        r0, r1 = np.where(row0 < N, row0, 0), np.where(row1 < N, row1, 0)
        accs = []
        for warp in range(warps):
            b_begin = min(warp * per_warp, blocks)
            count = min(per_warp, blocks - b_begin)
            acc = np.zeros((NT, 32, 4), np.float32)

            def words(r, blk):  # load_stream8 at byte blk * 32 + 8q of each row: two words
                raw = np.stack([w_bytes[r[i], blk * 32 + 8 * q[i] : blk * 32 + 8 * q[i] + 8] for i in lanes])
                return raw.view(U32)  # [32, 2]

            # The kernel's ring of DEPTH prefetched blocks; `base` is where its pointers stand.
            ring = [(words(r0, b_begin + u), words(r1, b_begin + u), b_begin + u) for u in range(min(DEPTH, count))]
            if use_ring:  # this warp's DEPTH slots of x, NaN bits until written
                slots = np.full((DEPTH * M * RING_TOKEN_CHUNKS, 4), 0xFFFFFFFF, U32)
                for u in range(min(DEPTH, count)):
                    ring_copy(slots, x_words, b_begin, u, u)
            base, left = b_begin, count
            while left > 0:
                for u in range(DEPTH):
                    if u >= left:
                        break
                    wa, wb, blk = ring[u]
                    assert blk == base + u
                    if u + DEPTH < left:
                        ring[u] = (words(r0, base + u + DEPTH), words(r1, base + u + DEPTH), base + u + DEPTH)
                    xring = None
                    if use_ring:  # read slot u, then refill it with the block DEPTH ahead
                        xring = [ring_read(slots, g, q, M, t, u) for t in range(NT)]
                        if u + DEPTH < left:
                            ring_copy(slots, x_words, b_begin, count - left + u + DEPTH, u)
                    acc = _block(acc, wa, wb, ws, r0, r1, blk, x_words, g, q, M, NT, dtype, a16, xs, xring)
                base += DEPTH
                left -= DEPTH
            accs.append(acc)
        total = accs[0].copy()
        for acc in accs[1:]:  # warp 0 adds warps 1..W-1 in order
            total += acc
        for t in range(NT):
            for r in range(4):
                n = np.where(r < 2, row0, row1)
                m = t * 8 + 2 * q + (r & 1)
                for lane in lanes:
                    if n[lane] < N and m[lane] < M:
                        bv = 0.0 if bias is None else bias[n[lane]]
                        out[m[lane], n[lane]] = total[t][lane, r] + bv
    return out


def _inputs(m, k, n, dtype, seed, reserved=True):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 4 if reserved else 3, (n, k), generator=g).to(torch.uint8)
    packed = pack_codes(codes)
    scale = (2.0 ** torch.randint(-3, 2, (n, k // 128), generator=g)).to(torch.float16)
    x = torch.randint(-8, 9, (m, k), generator=g).to(torch.float32)
    bias = torch.randint(-4, 5, (n,), generator=g).to(torch.float32)
    return x, packed, scale, bias


def test_decode_pairs_every_code_and_shift():
    rng = np.random.default_rng(0)
    words = rng.integers(0, 1 << 32, size=512, dtype=np.uint64).astype(U32)
    words[:4] = [0xFFFFFFFF, 0x0, 0x55555555, 0xAAAAAAAA]  # all reserved, all 0, all +1, all -1
    codes = (words[:, None] >> (2 * np.arange(16, dtype=U32))) & 3
    value = (codes & 1).astype(np.int64) - (codes >> 1).astype(np.int64)
    for dtype in ("fp16", "bf16"):
        d = plus2(words)
        for j in range(8):
            lo, hi = halves_to_float(pair(d, j, dtype), dtype)
            assert np.array_equal(lo, value[:, j]) and np.array_equal(hi, value[:, j + 8]), (dtype, j)


def test_byte_perm_selects_low_and_high_halves():
    lo, hi = np.array([0x22221111], U32), np.array([0x44443333], U32)
    assert byte_perm(lo, hi, 0x5410)[0] == 0x33331111
    assert byte_perm(lo, hi, 0x7632)[0] == 0x44442222


def test_warps_split_k():
    assert [warps_for(b) for b in (1, 3, 4, 8, 16, 32, 112)] == [1, 1, 2, 4, 8, 8, 8]


def test_row_sets_per_cta_while_the_ctas_still_fill_the_gpu():
    # 132 SMs: 4096 -> 14336 in 224 CTAs of four sets (112 of eight would idle SMs), 4096 -> 28672
    # in 224 of eight; 4096 and 6144 rows stay at one set (128 and 192 CTAs of two measured slower).
    assert small_m_split(14336, 4096, SMS, -1, MAX_WARPS) == (4, 2)
    assert small_m_split(28672, 4096, SMS, -1, MAX_WARPS) == (8, 1)
    assert small_m_split(4096, 4096, SMS, -1, MAX_WARPS) == (1, 8)
    assert small_m_split(6144, 1024, SMS, -1, MAX_WARPS) == (1, 4)
    assert small_m_split(4096, 4096, 66, -1, MAX_WARPS) == (2, 4)  # half the SMs: two sets fill them
    assert small_m_split(28672, 384, SMS, 8, MAX_WARPS) == (8, 1)  # more sets than K's warps


def a8_split(m: int, n: int, k: int, row_groups: int = -1, fused: bool = False) -> tuple[int, int]:
    """launch_a8_t's split: the fused form takes the default rule, at most A8_FUSED_MAX_SETS sets; the
    one-tile kernel given quantized rows (M <= 8) the fewest sets whose CTAs all run at once."""
    if row_groups <= 0 and fused:
        row_groups = min(small_m_split(n, k, SMS, -1, A8_MAX_WARPS)[0], A8_FUSED_MAX_SETS)
    elif row_groups <= 0 and m <= 8:
        row_groups = 1
        while 2 * row_groups <= A8_MAX_WARPS and -(-n // (16 * row_groups)) > A8_ONE_TILE_CTAS_PER_SM * SMS:
            row_groups *= 2
    return small_m_split(n, k, SMS, row_groups, A8_MAX_WARPS)


def test_int8_one_tile_kernels_take_the_fewest_sets_that_run_in_one_wave():
    # 132 SMs, 4 CTAs each: 528 CTAs at once. Measured fastest on the wide layers; the two-tile
    # kernel (M > 8) keeps small_m_split's rule.
    assert [a8_split(m, 14336, 4096) for m in (1, 8, 9, 16)] == [(2, 4), (2, 4), (4, 2), (4, 2)]
    assert [a8_split(m, 28672, 4096) for m in (1, 8, 9, 16)] == [(4, 2), (4, 2), (8, 1), (8, 1)]
    assert a8_split(1, 24576, 4096) == a8_split(16, 24576, 4096) == (4, 2)  # 768 CTAs would take two waves
    assert a8_split(1, 13824, 2560) == (2, 4)
    assert a8_split(1, 8448, 4096) == (1, 8)  # 528 CTAs: exactly one wave
    assert a8_split(1, 8464, 4096) == (2, 4)
    assert a8_split(1, 4096, 14336) == a8_split(16, 4096, 14336) == (1, 8)
    assert a8_split(1, 6144, 4096) == (1, 8)
    assert a8_split(1, 28672, 4096, row_groups=8) == (8, 1)


def test_the_fused_int8_kernel_takes_at_most_four_sets():
    # Its CTAs each quantize x: the default rule's split, but four sets instead of eight on 4096->28672.
    assert [a8_split(m, n, k, fused=True) for m in (1, 2) for k, n in ((4096, 14336), (4096, 28672), (2560, 13824))] \
        == [(4, 2), (4, 2), (4, 2)] * 2
    assert a8_split(1, 4096, 4096, fused=True) == a8_split(1, 4096, 4096) == (1, 8)
    assert a8_split(2, 28672, 4096, row_groups=8, fused=True) == (8, 1)


# 1, 2, 4 and 8 warps; odd block counts (the ring's tail); K = 2176: 17 blocks over 8 warps,
# the last two with none; N not a multiple of 16.
SHAPES = [(1, 128, 16), (3, 384, 20), (8, 512, 16), (9, 256, 24), (16, 1024, 16), (2, 2176, 8), (12, 640, 33)]


@pytest.mark.parametrize("layout", ["v1", "a16"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_kernel_mapping_equals_x_wt(dtype, m, k, n, layout):
    x, packed, scale, bias = _inputs(m, k, n, dtype, seed=m * 1000 + k + n)
    x_bits = float_to_bits(x.numpy(), dtype)
    wp = layouts.repack(packed, layout).numpy()
    y = kernel(x_bits, wp, scale.numpy(), bias.numpy(), dtype, a16=layout == "a16")
    ref = (x.double() @ dequantize(packed, scale, torch.float64).T + bias.double()).numpy()
    assert np.array_equal(y.astype(np.float64), ref), np.argwhere(y != ref)[:5]


# Sets of rows per CTA: N not a multiple of 16 * sets (the last CTA's sets past N read row 0),
# sets with fewer warps each, and more sets than K gives warps (one warp a set).
@pytest.mark.parametrize("m,k,n,row_groups", [(12, 640, 33, 2), (16, 1024, 40, 4), (5, 2176, 24, 8), (2, 384, 70, 8)])
def test_kernel_mapping_with_row_sets_equals_x_wt(m, k, n, row_groups):
    x, packed, scale, bias = _inputs(m, k, n, "bf16", seed=m * 1000 + k + n + row_groups)
    x_bits = float_to_bits(x.numpy(), "bf16")
    for layout in ("v1", "a16"):
        wp = layouts.repack(packed, layout).numpy()
        y = kernel(x_bits, wp, scale.numpy(), bias.numpy(), "bf16", a16=layout == "a16", row_groups=row_groups)
        ref = (x.double() @ dequantize(packed, scale, torch.float64).T + bias.double()).numpy()
        assert np.array_equal(y.astype(np.float64), ref), (layout, np.argwhere(y != ref)[:5])


def test_shared_x_is_taken_where_the_launcher_takes_it():
    """Both row-set cases above with M <= 8 replay the shared-memory reads (so a wrong layout fails
    them), and the rule keeps to one tile, two or more sets and the size bound."""
    assert takes_shared_x(5, 2176, 8, True) and takes_shared_x(2, 384, 8, True)
    assert not takes_shared_x(5, 2176, 8, False)  # v1
    assert not takes_shared_x(9, 256, 8, True)  # two tiles
    assert not takes_shared_x(1, 4096, 1, True)  # one set: nothing to share
    assert takes_shared_x(1, 4096, 4, True) and takes_shared_x(4, 4096, 2, True)
    assert not takes_shared_x(8, 4096, 2, True)  # 66 KB of x


@pytest.mark.parametrize("x_ring", [False, True])
@pytest.mark.parametrize("m,k,n,row_groups", [(9, 256, 24, -1), (16, 1024, 40, 4), (12, 2176, 33, 1), (16, 640, 16, 2)])
def test_two_tile_a16_mapping_with_and_without_the_x_ring_equals_x_wt(m, k, n, row_groups, x_ring):
    """Both x sources of the two-tile a16 kernel: the ring's copies and reads (slots, chunk order,
    tokens past M, odd block counts a warp, ragged N) and the loads from global memory, which the
    launcher keeps for layers too large to replay here."""
    x, packed, scale, bias = _inputs(m, k, n, "bf16", seed=m * 1000 + k + n + 7)
    x_bits = float_to_bits(x.numpy(), "bf16")
    wp = layouts.repack(packed, "a16").numpy()
    y = kernel(x_bits, wp, scale.numpy(), bias.numpy(), "bf16", a16=True, row_groups=row_groups, x_ring=x_ring)
    ref = (x.double() @ dequantize(packed, scale, torch.float64).T + bias.double()).numpy()
    assert np.array_equal(y.astype(np.float64), ref), np.argwhere(y != ref)[:5]


def test_x_ring_is_taken_where_the_launcher_takes_it():
    """The replays above with M > 8 and the a16 layout run the ring by the rule; the rule keeps to
    two tiles and the a16 layout, and leaves out the layers where it measured no faster."""
    assert takes_x_ring(9, 24, 256, True) and takes_x_ring(12, 33, 640, True) and takes_x_ring(16, 16, 1024, True)
    assert not takes_x_ring(8, 4096, 1024, True)  # one tile
    assert not takes_x_ring(16, 4096, 1024, False)  # v1
    for k, n in [(1024, 4096), (1024, 6144), (2048, 1024), (3072, 1024), (4096, 14336), (4096, 28672)]:
        assert takes_x_ring(16, n, k, True), (k, n)
    assert not takes_x_ring(16, 4096, 4096, True) and not takes_x_ring(12, 4096, 14336, True)


def test_x_ring_copies_every_chunk_once_and_free_of_bank_conflicts():
    """The 16 lanes of a token copy the block's 16 chunks, each once; the eight lanes of each
    quarter-warp write chunks in distinct banks (a 16-byte cp.async is served eight lanes at a time)."""
    assert sorted(ring_chunk(lane) for lane in range(16)) == list(range(16))
    for m in (9, 16):
        for j in range((m + 1) // 2):  # the lanes' j-th copy: tokens 2j (lanes 0..15) and 2j + 1
            for quarter in range(4):
                lanes = [lane for lane in range(8 * quarter, 8 * quarter + 8) if 2 * j + (lane >> 4) < m]
                chunks = [ring_copy_index(lane, 2 * j + (lane >> 4), 1, m) for lane in lanes]
                banks = [(4 * c + i) % 32 for c in chunks for i in range(4)]
                assert len(banks) == len(set(banks)), (m, j, quarter, chunks)


@pytest.mark.parametrize("m", [9, 12, 16])
def test_x_ring_reads_are_free_of_bank_conflicts(m):
    """The tokens of a slot are 20 chunks (320 bytes) apart: the two tokens one quarter-warp reads
    fall in different halves of the banks, for both tiles and both slots."""
    lanes = np.arange(32)
    g, q = lanes // 4, lanes % 4
    for t in range(2):
        for u in range(DEPTH):
            for i in range(4):
                live = t * 8 + g < m  # lanes past M read nothing
                byte = ring_index(g, q, m, t, u, i) * 16
                for quarter in range(4):
                    sel = slice(8 * quarter, 8 * quarter + 8)
                    chunks = sorted(set(byte[sel][live[sel]].tolist()))
                    banks = [(c // 4 + j) % 32 for c in chunks for j in range(4)]
                    assert len(banks) == len(set(banks)), (m, t, u, i, quarter, chunks)


@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("k", [128, 1024, 4096, 14336])
def test_shared_x_reads_are_free_of_bank_conflicts(m, k):
    """A 16-byte shared load is served a quarter-warp (8 lanes) at a time. For every block and
    step, the distinct chunks one quarter reads must fall in distinct banks; lanes that read the
    same chunk (the lanes of a token past M read token 0's or 1's) are one broadcast. Before the
    lanes past M took their token's parity, they all read token 0, which at odd M shared its banks
    with token M - 1 in one quarter."""
    lanes = np.arange(32)
    g, q = lanes // 4, lanes % 4
    for blk in range(min(k // 128, 3)):
        for i in range(4):
            byte = shared_x_index(g, q, m, k, blk, i) * 16
            for quarter in range(4):
                chunks = sorted(set(byte[8 * quarter : 8 * quarter + 8].tolist()))
                banks = [(c // 4 + j) % 32 for c in chunks for j in range(4)]
                assert len(banks) == len(set(banks)), (m, k, blk, i, quarter, chunks)


def test_decode_a16_pairs_are_neighbours():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 3, size=(64, 16)).astype(np.uint8)
    value = (codes & 1).astype(np.int64) - (codes >> 1).astype(np.int64)
    words = layouts.repack(pack_codes(torch.from_numpy(codes)), "a16").numpy().view(U32)[:, 0]
    for dtype in ("fp16", "bf16"):
        for j in range(8):
            lo, hi = halves_to_float(pair(words, j, dtype, a16=True), dtype)
            assert np.array_equal(lo, value[:, 2 * j]) and np.array_equal(hi, value[:, 2 * j + 1]), (dtype, j)


# --- the W2A8 kernel (ternary_mma_a8.cu) ------------------------------------------------------


def prmt(a: np.ndarray, b: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """PTX prmt.b32 (default mode): result byte n is byte (sel >> 4n) & 7 of {b, a}; bit 3 of a
    selector nibble would replicate that byte's sign (never set here)."""
    both = a.astype(np.uint64) | (b.astype(np.uint64) << 32)
    out = np.zeros(np.broadcast(a, sel).shape, dtype=U32)
    for n in range(4):
        nib = (sel >> U32(4 * n)) & U32(0xF)
        assert not np.any(nib & 8)
        out |= ((both >> (np.uint64(8) * (nib & 7).astype(np.uint64))) & np.uint64(0xFF)).astype(U32) << U32(8 * n)
    return out


def quad(w: np.ndarray, r: int) -> np.ndarray:
    shift = (r // 2) * 16 + (r % 2) * 2  # the kernel's kShift
    return prmt(np.full_like(w, A8_TABLE), np.full_like(w, A8_TABLE), (w >> U32(shift)) & U32(0x3333))


def s8(r: np.ndarray) -> np.ndarray:
    """[lanes] uint32 -> [lanes, 4] int8 values, byte 0 first."""
    return r.astype("<u4").view(np.int8).reshape(-1, 4).astype(np.int64)


def mma_s8(c: np.ndarray, a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    """mma.sync.m16n8k32.row.col.s32.s8.s8.s32 (PTX ISA fragment layouts, lane = 4 * groupID + tq):
      A reg i holds row groupID + 8 * (i % 2), cols 4tq + 16 * (i // 2) + {0..3}.
      B reg i holds rows 4tq + 16 * i + {0..3}, col groupID.
      C element i is (row groupID + 8 * (i // 2), col 2tq + i % 2).
    """
    A = np.zeros((16, 32), np.int64)
    B = np.zeros((32, 8), np.int64)
    for lane in range(32):
        gid, tq = divmod(lane, 4)
        for i in range(4):
            A[gid + 8 * (i % 2), 4 * tq + 16 * (i // 2) : 4 * tq + 16 * (i // 2) + 4] = s8(a[i][lane : lane + 1])[0]
        for i in range(2):
            B[4 * tq + 16 * i : 4 * tq + 16 * i + 4, gid] = s8(b[i][lane : lane + 1])[0]
    D = A @ B
    out = c.copy()
    for lane in range(32):
        gid, tq = divmod(lane, 4)
        for i in range(4):
            out[lane, i] += D[gid + 8 * (i // 2), 2 * tq + i % 2]
    return out


def kernel_a8(q8: np.ndarray, qs: np.ndarray, wp: np.ndarray, ws: np.ndarray, bias: np.ndarray,
              row_groups: int = -1) -> np.ndarray:
    """Replays launch_ternary_mma_a8: q8 int8 [M, K], qs fp32 [M], wp uint8 [N, K/4] (a8), ws fp16
    [N, K/128], or [N, 1] (row scales: each block scaled by 1, the row's scale at the end)."""
    M, K = q8.shape
    N = wp.shape[0]
    row = ws.shape[1] == 1
    NT = 1 if M <= 8 else 2 if M <= 16 else 4 if M <= 32 else 8
    assert NT < 8 or row, "eight tiles take row scales only"
    blocks = K // 128
    sets, warps = a8_split(M, N, K, row_groups)
    per_warp = (blocks + warps - 1) // warps
    q_words = np.ascontiguousarray(q8).view(U32)  # [M, K/4]
    out = np.full((M, N), np.nan, np.float32)
    lanes = np.arange(32)
    g, qd = lanes // 4, lanes % 4
    for cta, s in np.ndindex(-(-N // (16 * sets)), sets):
        row0, row1 = (cta * sets + s) * 16 + g, (cta * sets + s) * 16 + g + 8
        r0, r1 = np.where(row0 < N, row0, 0), np.where(row1 < N, row1, 0)
        total = np.zeros((NT, 32, 4), np.float32)
        for warp in range(warps):  # the ring only prefetches: blocks run in order either way
            b_begin = min(warp * per_warp, blocks)
            count = min(per_warp, blocks - b_begin)
            acc = np.zeros((NT, 32, 4), np.float32)
            run = np.zeros((NT, 32, 4), np.int64)  # eight tiles: C runs on over the warp's blocks
            for blk in range(b_begin, b_begin + count):
                wa = np.stack([wp[r0[i], blk * 32 + 8 * qd[i] : blk * 32 + 8 * qd[i] + 8] for i in lanes]).view(U32)
                wb = np.stack([wp[r1[i], blk * 32 + 8 * qd[i] : blk * 32 + 8 * qd[i] + 8] for i in lanes]).view(U32)
                xw = []
                for t in range(NT):
                    tok = np.where(t * 8 + g < M, t * 8 + g, 0)
                    xw.append(np.stack([q_words[tok[i], (blk * 128 + 32 * qd[i]) // 4 :][:8] for i in lanes]))
                c = run if NT == 8 else np.zeros((NT, 32, 4), np.int64)
                for h in range(2):
                    gq = [quad(wa[:, h], r) for r in range(4)]
                    hq = [quad(wb[:, h], r) for r in range(4)]
                    for t in range(NT):
                        c[t] = mma_s8(c[t], [gq[0], hq[0], gq[1], hq[1]], [xw[t][:, 4 * h], xw[t][:, 4 * h + 1]])
                        c[t] = mma_s8(c[t], [gq[2], hq[2], gq[3], hq[3]], [xw[t][:, 4 * h + 2], xw[t][:, 4 * h + 3]])
                if NT == 8:
                    assert np.abs(run).max() < 2**24  # what the kernel's int32 -> float conversion needs
                    continue
                sa, sb = (np.ones(32, np.float32),) * 2 if row else (ws[r0, blk].astype(np.float32),
                                                                      ws[r1, blk].astype(np.float32))
                for t in range(NT):
                    acc[t][:, :2] += c[t][:, :2].astype(np.float32) * sa[:, None]
                    acc[t][:, 2:] += c[t][:, 2:].astype(np.float32) * sb[:, None]
            total += run.astype(np.float32) if NT == 8 else acc
        for t in range(NT):
            for r in range(4):
                n = np.where(r < 2, row0, row1)
                m = t * 8 + 2 * qd + (r & 1)
                for lane in lanes:
                    if n[lane] < N and m[lane] < M:
                        a = total[t][lane, r] * ws[n[lane], 0].astype(np.float32) if row else total[t][lane, r]
                        out[m[lane], n[lane]] = a * qs[m[lane]] + bias[n[lane]]
    return out


def test_decode_a8_quads_every_code():
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 4, size=(64, 16)).astype(np.uint8)
    codes[0] = 3  # reserved codes read as 0
    value = (codes & 1).astype(np.int64) - (codes >> 1).astype(np.int64)
    words = layouts.repack(pack_codes(torch.from_numpy(codes)), "a8").numpy().view(U32)[:, 0]
    for r in range(4):
        assert np.array_equal(s8(quad(words, r)), value[:, 4 * r : 4 * r + 4]), r


@pytest.mark.parametrize("m,k,n,row_groups", [(*shape, -1) for shape in SHAPES]
                         + [(12, 640, 33, 2), (5, 2176, 24, 8), (17, 384, 40, -1), (32, 256, 24, 2), (27, 640, 33, 1)])
def test_kernel_a8_mapping_equals_the_spec(m, k, n, row_groups):
    g = torch.Generator().manual_seed(m * 7 + k + n)
    codes = torch.randint(0, 4, (n, k), generator=g).to(torch.uint8)
    packed = pack_codes(codes)
    scale = (2.0 ** torch.randint(-3, 2, (n, k // 128), generator=g)).to(torch.float16)
    q8 = torch.randint(-127, 128, (m, k), generator=g).to(torch.int8)
    qs = (2.0 ** torch.randint(-4, 1, (m,), generator=g)).to(torch.float32)
    bias = torch.randint(-4, 5, (n,), generator=g).to(torch.float32)
    y = kernel_a8(q8.numpy(), qs.numpy(), layouts.repack(packed, "a8").numpy(), scale.numpy(), bias.numpy(),
                  row_groups)
    w = dequantize(packed, scale, torch.float64)
    ref = ((q8.double() @ w.T) * qs.double()[:, None] + bias.double()).numpy()
    assert np.array_equal(y.astype(np.float64), ref), np.argwhere(y != ref)[:5]


@pytest.mark.parametrize("m,k,n,row_groups", [(3, 256, 24, -1), (21, 384, 40, 2), (33, 384, 40, -1),
                                              (48, 256, 24, 1), (64, 640, 33, 2)])
def test_kernel_a8_mapping_with_row_scales_equals_the_spec(m, k, n, row_groups):
    """Row scales (ws [N, 1]): every kernel sums its int32 partials over all of K and scales once at
    the end; eight tiles (M = 33..64, row scales only) keep C in int32 over a warp's blocks."""
    g = torch.Generator().manual_seed(m * 5 + k + n)
    codes = torch.randint(0, 4, (n, k), generator=g).to(torch.uint8)
    packed = pack_codes(codes)
    scale = (2.0 ** torch.randint(-3, 2, (n, 1), generator=g)).to(torch.float16)
    q8 = torch.randint(-127, 128, (m, k), generator=g).to(torch.int8)
    qs = (2.0 ** torch.randint(-4, 1, (m,), generator=g)).to(torch.float32)
    bias = torch.randint(-4, 5, (n,), generator=g).to(torch.float32)
    y = kernel_a8(q8.numpy(), qs.numpy(), layouts.repack(packed, "a8").numpy(), scale.numpy(), bias.numpy(),
                  row_groups)
    w = dequantize(packed, torch.ones(n, k // 128, dtype=torch.float16), torch.float64) * scale.double()
    ref = ((q8.double() @ w.T) * qs.double()[:, None] + bias.double()).numpy()
    assert np.array_equal(y.astype(np.float64), ref), np.argwhere(y != ref)[:5]
