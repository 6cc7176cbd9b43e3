"""A NumPy replay of the mid-M tensor-core kernel's index mapping (ternop/cuda/csrc/ternary_mma_tiles.cu).

No GPU is needed. The replay stages x and the codes into a byte array exactly as the kernel's
cp.async does (x swizzled chunk c ^ (token % 8), code rows 48 bytes apart), reads B through
the ldmatrix.x4 addressing the kernel computes, decodes A from the staged code words with the
kernel's shifts and constants and scales it in x's dtype, multiplies with the PTX m16n8k16
fragment layouts of test_mma_mapping.py, and adds split-K slices in order. With integer x and
power-of-two scales everything is exact in fp32, so a wrong token, k, row, swizzle or split
shows up as an exact mismatch against x @ W.T + bias. Tiles, the auto choice and the split
policy are read from (or checked against) the source.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from ternop import layouts
from ternop.cuda.cuda_ext import CSRC
from ternop.format import dequantize
from tests.cuda.test_mma_mapping import U32, _const, _inputs, float_to_bits, halves_to_float, mma

# The tiles kernel and the a16 helpers it includes (the decode constants live there).
_SRC = (CSRC / "ternary_mma_tiles.cu").read_text() + (CSRC / "ternary_a16.cuh").read_text()
ROW_BYTES = _const(_SRC, "kRowBytes")
X_ROW_BYTES = _const(_SRC, "kXRowBytes")
TILES = [tuple(int(v) for v in m.groups())
         for m in re.finditer(r"using Tile\d = Tile<(\d+), (\d+), (\d+), (\d+), (\d+)>;", _SRC)]  # fmt: skip
SMEM_PER_SM = 227 * 1024


def _pair_const(dtype: str, name: str) -> int:
    cpp = {"fp16": "__half", "bf16": "__nv_bfloat16"}[dtype]
    body = re.search(rf"struct Pair16<{cpp}> \{{(.*?)\}};", _SRC, re.S).group(1)
    return _const(body, name)


MAGIC = {d: _pair_const(d, "kMagic") for d in ("fp16", "bf16")}
BIAS = {d: _pair_const(d, "kBias") for d in ("fp16", "bf16")}


def tile_shape(tile: int) -> dict:
    bm, wn, wm, mt, stages = TILES[tile]
    bn = 16 * mt * wn
    return dict(bm=bm, wn=wn, wm=wm, mt=mt, bn=bn, tm=bm // wm, nt=bm // wm // 8,
                smem=stages * (bm * X_ROW_BYTES + bn * ROW_BYTES))  # fmt: skip


def auto_tile(m: int, n: int, k: int) -> int:
    return 1 if m > 32 and n * k > (1 << 25) else 0


def splits_for(m: int, n: int, k: int, sms: int, tile: int) -> int:
    t = tile_shape(tile)
    per_sm = max(1, SMEM_PER_SM // t["smem"])
    tiles = -(-n // t["bn"]) * -(-m // t["bm"])
    blocks, splits = k // 128, 1
    while splits < 16 and tiles * splits < per_sm * sms and blocks // (2 * splits) >= 2:
        splits *= 2
    return splits


def _packed(lo: np.ndarray, hi: np.ndarray, dtype: str) -> np.ndarray:
    return float_to_bits(lo, dtype).astype(U32) | (float_to_bits(hi, dtype).astype(U32) << 16)


def decode_scaled(shifted: np.ndarray, scale: np.ndarray, dtype: str) -> np.ndarray:
    """decode_pair then mul2 by the scale pair: v * scale in x's dtype (exact here)."""
    r = (shifted & U32(0x00030003)) | U32(MAGIC[dtype])
    lo, hi = halves_to_float(r, dtype)
    blo, bhi = halves_to_float(np.full_like(r, BIAS[dtype]), dtype)
    return _packed((lo - blo) * scale, (hi - bhi) * scale, dtype)


def ldmatrix_x4(smem: np.ndarray, addr: np.ndarray) -> list[np.ndarray]:
    """Lanes 8j..8j+7 give the row addresses of matrix j; register j of lane L holds the 4 bytes
    at 4 * (L % 4) of row L // 4 of matrix j."""
    lanes = np.arange(32)
    out = []
    for j in range(4):
        rows = addr[8 * j + lanes // 4] + 4 * (lanes % 4)
        out.append(np.stack([smem[a : a + 4] for a in rows]).view(U32)[:, 0])
    return out


def kernel(x_bits, wp, ws, bias, dtype, tile, splits):
    """Replays launch_ternary_mma_tiles: x_bits uint16 [M, K], wp uint8 [N, K/4] (a16), ws fp16 [N, K/128]."""
    t = tile_shape(tile)
    M, K = x_bits.shape
    N = wp.shape[0]
    blocks = K // 128
    per_split = -(-blocks // splits)
    x_bytes = np.ascontiguousarray(x_bits).view(np.uint8)  # [M, 2K]
    partial = np.zeros((splits, M, N), np.float32)
    lanes = np.arange(32)
    g, q = lanes // 4, lanes % 4
    for z in range(splits):
        kb_begin = z * per_split
        count = max(0, min(per_split, blocks - kb_begin))
        for cta_n in range(-(-N // t["bn"])):
            for cta_m in range(-(-M // t["bm"])):
                n0, m0 = cta_n * t["bn"], cta_m * t["bm"]
                acc = np.zeros((t["wn"] * t["wm"], t["mt"], t["nt"], 32, 4), np.float32)
                for i in range(count):
                    kb = kb_begin + i
                    # load_stage: x [BM x 128] swizzled, then the codes [BN x 32 bytes].
                    stage = np.zeros(t["bm"] * X_ROW_BYTES + t["bn"] * ROW_BYTES, np.uint8)
                    for r in range(t["bm"]):
                        m = min(m0 + r, M - 1)
                        for c in range(16):
                            dst = r * X_ROW_BYTES + (c ^ (r & 7)) * 16
                            stage[dst : dst + 16] = x_bytes[m, kb * 256 + 16 * c : kb * 256 + 16 * c + 16]
                    wbase = t["bm"] * X_ROW_BYTES
                    for r in range(t["bn"]):
                        n = min(n0 + r, N - 1)
                        stage[wbase + r * ROW_BYTES : wbase + r * ROW_BYTES + 32] = wp[n, kb * 32 : kb * 32 + 32]
                    for warp in range(t["wn"] * t["wm"]):
                        wn, wm = warp % t["wn"], warp // t["wn"]
                        lm_tok = wm * t["tm"] + 8 * (lanes // 16) + lanes % 8
                        lm_chunk = (lanes // 8) % 2
                        rows = [[np.minimum(n0 + 16 * (t["mt"] * wn + mt) + g + 8 * h, N - 1) for h in range(2)]
                                for mt in range(t["mt"])]  # fmt: skip
                        scale = [[ws[rows[mt][h], kb].astype(np.float32) for h in range(2)] for mt in range(t["mt"])]
                        if dtype == "bf16":  # the fp16 scale rounded to bf16 (exact for powers of two)
                            scale = [[halves_to_float(_packed(s, s, dtype), dtype)[0] for s in pair_] for pair_ in scale]
                        wrow = wbase + (16 * t["mt"] * wn + g) * ROW_BYTES
                        for s in range(8):
                            a = []
                            for mt in range(t["mt"]):
                                def word(off):
                                    return np.stack([stage[o : o + 4] for o in off]).view(U32)[:, 0]
                                w0 = word(wrow + 16 * mt * ROW_BYTES + 4 * s) >> (2 * q).astype(U32)
                                w1 = word(wrow + (16 * mt + 8) * ROW_BYTES + 4 * s) >> (2 * q).astype(U32)
                                a.append([decode_scaled(w0, scale[mt][0], dtype), decode_scaled(w1, scale[mt][1], dtype),
                                          decode_scaled(w0 >> U32(8), scale[mt][0], dtype),
                                          decode_scaled(w1 >> U32(8), scale[mt][1], dtype)])  # fmt: skip
                            for t2 in range(t["nt"] // 2):
                                tok = lm_tok + 16 * t2
                                chunk = 2 * s + lm_chunk
                                b = ldmatrix_x4(stage, tok * X_ROW_BYTES + (chunk ^ (tok & 7)) * 16)
                                for mt in range(t["mt"]):
                                    acc[warp, mt, 2 * t2] = mma(acc[warp, mt, 2 * t2], a[mt], b[0:2], dtype)
                                    acc[warp, mt, 2 * t2 + 1] = mma(acc[warp, mt, 2 * t2 + 1], a[mt], b[2:4], dtype)
                for warp in range(t["wn"] * t["wm"]):
                    wn, wm = warp % t["wn"], warp // t["wn"]
                    for mt in range(t["mt"]):
                        for nt in range(t["nt"]):
                            for r in range(4):
                                n = n0 + 16 * (t["mt"] * wn + mt) + g + 8 * (r // 2)
                                m = m0 + wm * t["tm"] + 8 * nt + 2 * q + (r & 1)
                                ok = (n < N) & (m < M)
                                partial[z, m[ok], n[ok]] = acc[warp, mt, nt][ok, r]
    out = partial[0].copy()
    for z in range(1, splits):  # split_k_reduce_kernel: the slices in order
        out += partial[z]
    return out + (0.0 if bias is None else bias[None, :])


def test_tiles_in_the_source_are_the_documented_two():
    assert [tile_shape(i)["bn"] for i in range(len(TILES))] == [64, 128]
    assert [tile_shape(i)["bm"] for i in range(len(TILES))] == [32, 64]
    assert all(tile_shape(i)["smem"] <= SMEM_PER_SM for i in range(len(TILES)))
    assert "M > 32 && static_cast<int64_t>(N) * K > (int64_t{1} << 25) ? 1 : 0" in _SRC  # auto_tile above


def test_split_policy_fills_the_gpu_only_when_tiles_are_few():
    assert splits_for(32, 14336, 4096, 132, 0) == 4  # 224 tiles of 64 rows; five CTAs an SM fit
    assert splits_for(32, 1024, 1024, 132, 0) == 4  # 16 tiles, 8 blocks: two blocks a split at least
    assert splits_for(64, 1024, 3072, 132, 1) == 8
    assert splits_for(17, 136, 128, 132, 0) == 1  # one block: nothing to split


# (M, K, N, tile, splits): both tiles, tokens past M in a tile (17, 40, 70), a second M tile,
# N not a multiple of the tile's rows, split-K with uneven slices (5 blocks in 2 and 3).
SHAPES = [(17, 256, 72, 0, 1), (40, 384, 136, 0, 2), (70, 256, 136, 1, 1), (33, 640, 130, 1, 3), (5, 128, 64, 0, 1)]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("m,k,n,tile,splits", SHAPES)
def test_tiles_mapping_equals_x_wt(dtype, m, k, n, tile, splits):
    x, packed, scale, bias = _inputs(m, k, n, dtype, seed=m * 7 + k + n)
    y = kernel(float_to_bits(x.numpy(), dtype), layouts.repack(packed, "a16").numpy(), scale.numpy(),
               bias.numpy(), dtype, tile, splits)  # fmt: skip
    ref = (x.double() @ dequantize(packed, scale, torch.float64).T + bias.double()).numpy()
    assert np.array_equal(y.astype(np.float64), ref), np.argwhere(y != ref)[:5]
