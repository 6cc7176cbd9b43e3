"""Static kernel configurations: per GPU architecture, M buckets -> kernel config.

There is no run-time autotuning (it would sync, and it is not capture-safe). The sm90
tables were picked offline on an H200 with ``benchmarks/sweep_fused.py``,
``benchmarks/sweep_tiles.py`` and ``benchmarks/bench_linear.py --below-floors``; other
architectures fall back to conservative configs that compile everywhere.

A backend serves an M only if one of its buckets covers it and M is at least its floor
(``MIN_M``); the registry asks backends in priority order, so these tables also decide
which backend runs for each M.

The tables rank GPU time under CUDA graphs. Above the largest batch the serving engine captures
(``graph_max_m``: vLLM's ``max_cudagraph_capture_size``, which the plugin hands over with
``set_graph_max_m``), calls also pay their host time, and two rules move small products to the
Hopper kernels' one C++ launch (``eager_a8_row_host_bound``, ``eager_a16_host_bound``).

Why it is long: besides the tables, the rules that let a backend decline part of its M range
(``wgmma_declines``, ``dequant_a8_declines``, ``wgmma_a8_row_declines``) and the two host-time
rules live here with the measurements that chose each, so that every dispatch number sits beside
the run it came from.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from ternop import backends


@dataclass(frozen=True)
class GemvConfig:
    """Triton CUDA-core GEMV: BLOCK_N rows per program, BLOCK_K (multiple of 128) per step."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class GemmConfig:
    """Triton tensor-core GEMM tile (format v1, any float x); BLOCK_K is one 128-wide scale block."""

    block_m: int
    block_n: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class FusedConfig:
    """Tile of the fused kernels (``triton_fused.py``): BLOCK_M tokens x BLOCK_N weight rows.

    ``swap`` (fp16/bf16 kernel only; the int8 kernel always swaps) computes out^T = W @ x^T
    (weight rows on the MMA's 64-row side). ``max_split_k``
    bounds split-K, which the launcher uses only when the tiles alone cannot fill the GPU.
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False
    max_split_k: int = 1
    group_m: int = 8


@dataclass(frozen=True)
class DequantConfig:
    """Triton dequantize-to-dense tile, then cuBLAS."""

    block_n: int = 32
    block_k: int = 512


@dataclass(frozen=True)
class DequantA8Config:
    """Tile of the dense int8 GEMM of ``dequant_a8`` (``triton_dequant_a8.py``): BLOCK_M tokens x
    BLOCK_N weight rows x BLOCK_K."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    group_m: int = 8


@dataclass(frozen=True)
class CudaGemvConfig:
    """The CUDA C++ kernel picks its own launch shape; the table only bounds M."""


@dataclass(frozen=True)
class CudaMmaConfig:
    """The tensor-core CUDA C++ kernel picks its own launch shape; the table only bounds M."""


# backend name -> ascending list of (largest M served, config). A backend also has a
# smallest M (MIN_M): below it a cheaper backend is always better, so it declines.
Table = dict[str, list[tuple[int, object]]]

_BIG = 1 << 62

# Picked from two runs of benchmarks/sweep_fused.py on the H200 (benchmarks/results/h200/
# sweep_fused.json and sweep_fused_v2.json: every tile below, on the eight Qwen3-0.6B and 8B
# shapes; the geometric mean of the speed-up over cuBLAS bf16 decides):
# - cuda_mma (fp16/bf16, v1 or a16) and cuda_mma_a8 (int8) take M <= 16: 2.4x and 2.0x at
#   M = 1, 1.4x and 1.5x at M = 16, against at most 1.1x and 1.2x for the Triton kernels. On
#   Hopper cuda_mma_a8 now takes M <= 32 (its four-tile kernel, measured at b5b99db), and with row
#   scales M <= 64 on K <= 1024 (eight tiles, b3151bc; the comment above SM90).
# - cuda_mma_a8_fused takes M <= 2 from cuda_mma_a8 (registry.py says why on every layer): the
#   same kernel quantizing x itself, one launch instead of two. bench_linear at c4e4123 on the
#   H200, M = 1: 0.4-0.9 us faster on the 0.6B shapes and 4096 x 4096 (against cuBLAS bf16,
#   1.21x -> 1.44x on 1024 -> 4096, 2.83x -> 3.52x on 2048 -> 1024).
# - cuda_gemv (CUDA cores) keeps M <= 2 for what cuda_mma declines (fp32 x).
# - cuda_mma_tiles (a16 layout) from M = 17 to 64 on the layers cuda_wgmma leaves (N * K < 2^24 or
#   K < 2048, and from M = 33 only the K = 1024 layers with N * K < 2^22): benchmarks/sweep_tiles.py at
#   9d4cebf (results/h200/sweep_tiles.json) gives 0.93-1.45x at M = 17..32 on the eight shapes and
#   0.76-1.17x at M = 64, against 0.7-1.16x and 0.72-1.07x for triton_a16 (bench_linear at
#   e72dcf5). At M = 96..512 no tile of it reached triton_a16 or cuda_dequant.
# - cuda_wgmma (Hopper wgmma, a16 layout) from M = 17 where the layer is large enough, from
#   M = 9 on the widest up-projections, and every layer at M = 65..2048 (wgmma_declines below,
#   which cites the measurements): benchmarks/sweep_tiles.py --kernel wgmma at b6c4a88
#   (results/h200/sweep_wgmma.json), best tile against cuBLAS bf16 on the eight shapes: M = 65..128:
#   0.77-1.26x where K >= 2048 (triton_a16: 0.55-0.89x); M = 256..2048: 0.81-1.0x where
#   N * K >= 2^25 (cuda_dequant: 0.57-0.91x). Since the producer-warpgroup tiles and their cost
#   model (sweep_wgmma_wg_e697c98.json) every layer: see WGMMA_MAX_M. Above M = 2048
#   cuda_dequant (0.9-1.0x) stays.
# - triton_a16 from M = 65 (17 for v1 weights) where cuda_wgmma cannot run (v1 weights, other GPUs),
#   with split-K: single programs walking all of K were latency-bound (v2 against v1 of the sweep).
# - dequant_cublas from M = 256 (MIN_M): 0.64x, 0.71x, 0.81x, 0.88x at M = 256..2048,
#   against 0.50x and below for the fused GEMM, which waits on every MMA. cuda_dequant does the
#   same work from one C++ op (a CUDA dequantization kernel, then cuBLAS) and goes first: the
#   Python Triton launch it replaces cost tens of microseconds of host time per eager call
#   (sweep_fused.json, host_us_per_call), which batches above vLLM's CUDA-graph sizes pay.
# - triton_a8 for every M above 16 (32 on Hopper): 1.11x at M = 32, 0.98x at 64, 0.76x at 128, 0.6-0.75x above.
# - dequant_a8 for row-scaled int8 calls from M = 2048 (MIN_M): decode the codes to a dense
#   int8 weight, then a dense int8 Triton GEMM (triton_dequant_a8.py). benchmarks/probe_a8_dense.py
#   at b6e054d (results/h200/probe_a8_dense_b6e054d.json), against cuBLAS bf16 with quantization
#   and decoding included: 0.73-1.05x on the 0.6B shapes and 1.14-1.41x on the 8B ones at
#   M = 2048..8192, where the fused row-scale kernels ran 0.71-0.94x and 0.95-1.18x; at M <= 512
#   the decoding pass costs more than it saves (0.42-1.09x). The 128 x 128 x 64 pointer tile
#   was the best of nine on most shapes (a TMA tile was faster where K >= 2N, see
#   triton_dequant_a8.py for why it is not used).
# - triton_gemm / triton_gemv: the first Triton kernels (format v1, fp32 x too); they rank
#   after the fused kernels and run for what those decline.
# cuda_mma_a8's four token tiles (M = 17..32) on Hopper, against what took those M before (triton_a8, or
# cuda_wgmma_a8 on the row-scaled wide up-projections): bench_linear.py --below-floors --ms 16 17 24 32
# --backends cuda_mma_a8,triton_a8,cuda_wgmma_a8 on one H100 at b5b99db
# (results/h100/bench_linear_mma_a8_four_tiles_b5b99db.json), with the quantization, forced. Row scales:
# 3-33% faster than the dispatcher's pick at every point of the seven layers with N * K < 2^26
# (1024->6144 at M = 17: 5.54 against 8.22 us; 4096->14336 at M = 32: 18.03 against 18.66), and on
# 4096->28672 7% faster at M = 17 but 2% and 8% slower at 24 and 32 (27.41 / 28.88 / 31.12 us against
# cuda_wgmma_a8's 29.42 / 28.42 / 28.62): mma_a8_declines. Block scales: faster than triton_a8 at every
# point (the Hopper kernel never takes them). Other GPUs keep M <= 16 (not measured).
# Its eight token tiles (M = 33..64, row scales only; one CTA an SM) against the dispatcher of then
# (triton_a8 started early, cuda_wgmma_a8 on the wide up-projections): bench_linear.py --below-floors
# --ms 33 40 48 64 --backends cuda_mma_a8,triton_a8,cuda_wgmma_a8 --rows ternop_a8_row,ternop_q8_row on
# one H100 at b3151bc (results/h100/bench_linear_mma_a8_eight_tiles_b3151bc.json). On the two K = 1024
# layers 8-31% faster at M = 33..48 (1024->6144 at M = 33: 7.19 against 9.99 us, 0.72x -> 1.00x of
# cuBLAS bf16) and level at 64 (7.63 / 7.74, 8.36 / 8.38); from K = 2048 level at M = 33 on 2048->1024
# and 11-45% slower everywhere else (4096->14336 at M = 64: 35.87 against 19.78), the decode of a
# long K with 8 warps an SM: mma_a8_declines keeps those to the others.
MMA_A8_MAX_M_SM90 = 32
MMA_A8_ROW_MAX_M_SM90 = 64
MMA_A8_EIGHT_TILES_MAX_K = 1024
MMA_A8_WIDE_ROW_MIN_NK = 1 << 26
MMA_A8_WIDE_ROW_MAX_M = 20  # between the M = 17 point it won and the M = 24 one it lost


def mma_a8_declines(m: int, n: int, k: int, row_scales: bool) -> str:
    """Why cuda_mma_a8 leaves an (M, N, K) inside its bucket to another backend, or "" (see above)."""
    if row_scales and m > MMA_A8_WIDE_ROW_MAX_M and n * k >= MMA_A8_WIDE_ROW_MIN_NK:
        return (f"row scales at M={m} on N * K = {n * k} >= 2^26: cuda_wgmma_a8 is faster above "
                f"M = {MMA_A8_WIDE_ROW_MAX_M} (configs.mma_a8_declines)")
    if m > MMA_A8_MAX_M_SM90 and k > MMA_A8_EIGHT_TILES_MAX_K:
        return (f"M={m} on K={k} > {MMA_A8_EIGHT_TILES_MAX_K}: the eight-tile kernel is faster only on "
                f"K <= {MMA_A8_EIGHT_TILES_MAX_K} (configs.mma_a8_declines)")
    return ""


# Token slabs (Hopper; cuda_mma with a16 weights, cuda_mma_a8 with row scales): the small-M kernels run
# M as ceil(M / slab) slabs of `slab` tokens along the grid's y, each CTA the kernel of one slab, so a
# small layer's few CTA columns become several times as many CTAs and each keeps the registers of one
# or two token tiles (the weights are decoded once a slab, from L2 after the first). Picked from forced
# runs on one H100 (bench_linear.py --below-floors --backends cuda_mma or cuda_mma_a8, each slab size
# switched on in a process of its own, the dispatcher of then timed beside it in each; results/h100/
# exp_slabs_*_ea6f08d.json), on 1024->4096, 1024->6144, 2048->1024, 3072->1024 and 4096->4096 at
# M = 24, 32, 33, 48, 64 (and 96, 128 with int8), against cuBLAS bf16:
# - 16-bit, slabs of 16 at M = 17..32 where N * K <= 2^22: 1024->4096 1.03x / 0.97x at M = 24 / 32
#   (dispatcher 0.91x / 0.90x), 2048->1024 1.38x / 1.38x (1.07x / 1.07x), 3072->1024 1.67x / 1.67x
#   (1.37x / 1.38x); on 1024->6144 (0.85x against 1.01x) and 4096->4096 (0.99x against 1.28x) slower.
# - 16-bit, slabs of 8 at M = 33..48 on the narrow layers (N < K, N * K <= 2^22): 2048->1024 1.20x / 1.11x
#   at M = 33 / 48 (dispatcher 0.89x / 0.95x; slabs of 16 1.26x / 1.03x), 3072->1024 1.39x / 1.26x
#   (1.08x / 1.17x; slabs of 16 1.37x / 1.14x). At M = 64 only 2048->1024 gained, with slabs of 16
#   (1.00x against 0.93x); on 3072->1024 both sizes lost (1.14x and 0.87x against 1.19x), and on the
#   wider layers every size lost from M = 33.
# - int8 row scales, slabs of 16 at M = 17..32 where N * K <= 2^23: 1.04-1.44x against the four-tile
#   kernel's 0.92-1.24x (1024->6144 at M = 32: 1.20x against 1.10x); 4096->4096 1.23x against 1.69x.
#   At M = 33..48 where N * K <= 2^22: 1024->4096 1.00x / 0.94x (0.79x / 0.73x); on 1024->6144
#   the eight-tile kernel stays ahead (0.93x against 0.88x at M = 33). On the narrow layers up to
#   M = 96: 2048->1024 1.10x / 1.03x / 0.93x at M = 33 / 64 / 96 (0.80x / 0.79x / 0.70x), 3072->1024
#   1.38x / 1.26x / 1.04x (1.07x / 1.10x / 0.82x); at M = 128 slabs of 32 (0.81x, 0.91x against 0.74x,
#   0.85x). On 1024->4096 at M = 64 slabs of 32 (0.83x against 0.66x; slabs of 16 0.65x); at M = 96
#   slabs of 16 (0.61x against 0.56x), at 128 every size lost.
# Then benchmarks/probe_slabs.py at 86dc310 (results/h100/probe_slabs_86dc310.json: both ops called
# directly with every slab size, the int8 rows quantized beforehand) timed the M the runs above left out:
# - M = 9..16, slabs of 8 against one column: 16-bit on the narrow layers 1.61-1.65x against
#   1.44-1.50x (2048->1024) and 1.83-1.87x against 1.62-1.72x (3072->1024), slower on the others (1024->4096
#   1.26-1.36x against 1.30-1.42x); int8 on the layers with N * K <= 2^22 5-11% faster (1024->4096 1.56-1.62x
#   against 1.49-1.52x), on 1024->6144 2-4% slower, on 4096->4096 15-18% slower.
# - int8 at M = 65..96 on 1024->4096: slabs of 16 0.69-0.77x against 0.60-0.70x for slabs of 32
#   (the forced run above: 0.61x at M = 96 against the dispatcher's 0.56x, with the quantization).
# - 16-bit at M = 65..128: no slab size reached the dispatcher's kernels on any layer (on 2048->1024 at
#   most 0.81x, where the dispatcher ran 0.79-0.85x at M = 80..128 in bench_linear_slabs_7046454.json).
# - int8 at M = 65..128 on the layers with N >= K (1024->4096, 1024->6144), every slab also with 1, 2
#   and 4 sets of 16 rows a CTA forced (probe_slabs.py at a368b8d, results/h100/probe_slabs_mid_a368b8d.json,
#   the dispatcher of then in bench_linear_a8row_mid_a368b8d.json): the kernel's own sets count one
#   slab's CTAs only and give these layers one set a CTA, each CTA reading its slab's x for 16 rows.
#   More sets share it: 1024->4096 slabs of 32 with two sets 1.14x / 1.12x / 1.08x / 0.98x / 0.96x at
#   M = 65 / 80 / 96 / 112 / 128 (the dispatcher 0.84x / 0.81x / 0.78x / 0.77x / 0.76x); 1024->6144
#   four sets, slabs of 16 1.12x / 1.09x at M = 65 / 80, of 32 0.99x / 0.95x / 0.91x at 96 / 112 / 128
#   (the dispatcher, another backend there, 0.59x / 0.64x / 0.77x / 0.81x / 0.79x). At M = 33..64 the
#   kernel's own sets were the fastest or within 0.03 (probe_slabs_f6f4718.json), and on the N < K
#   layers one set stays the fastest at every M measured.
# Other GPUs, block scales and the larger layers keep one CTA column over all of M.
SLAB_A16_MAX_M = 64
SLAB_A8_MAX_M = 128
SLAB_MAX_NK = 1 << 22
SLAB_NARROW_A16_64_MAX_NK = 1 << 21  # 2048->1024 gained at M = 64, 3072->1024 lost
SLAB_A8_SHORT_MAX_NK = 1 << 23  # int8 M = 17..32: 1024->6144 gained too
SLAB_A8_SETS_MIN_M = 65  # int8 slabs with several sets a CTA (_a8_shared_x_slab)


def mma_slab(m: int, n: int, k: int, device: torch.device) -> int:
    """Tokens a CTA of cuda_mma over a16 weights (0: one CTA column takes all of M, M <= 16), where
    the slabbed kernel was the fastest in its run (see above); 0 also where it does not take M."""
    if m <= 8 or arch_key(device) != "sm90":
        return 0
    nk = n * k
    if m <= 16:
        return 8 if n < k and nk <= SLAB_MAX_NK else 0
    if m <= 32:
        return 16 if nk <= SLAB_MAX_NK else 0
    if n >= k or nk > SLAB_MAX_NK:
        return 0
    if m <= 48:
        return 8
    return 16 if m <= 64 and nk <= SLAB_NARROW_A16_64_MAX_NK else 0


def _a8_shared_x_slab(m: int, n: int, k: int) -> tuple[int, int] | None:
    """(slab, sets of 16 rows a CTA) where slabs with several sets sharing x were the fastest: int8 row
    scales at M = 65..128 on the layers with N >= K and N * K <= 2^23 (see above); else None."""
    nk = n * k
    if not SLAB_A8_SETS_MIN_M <= m <= SLAB_A8_MAX_M or n < k or nk > SLAB_A8_SHORT_MAX_NK:
        return None
    if nk <= SLAB_MAX_NK:
        return 32, 2
    return (16 if m <= 80 else 32), 4


def mma_a8_launch(m: int, n: int, k: int, row_scales: bool, device: torch.device) -> tuple[int, int]:
    """(slab, sets) of a cuda_mma_a8 launch where the slabbed kernel was the fastest in its run (see
    above): the tokens a CTA takes (0: one CTA column over all of M, the kernels of M <= 64) and the
    sets of 16 weight rows a CTA owns (-1: the kernel's own choice, small_m_split). One call gives
    both, so a launch reads the device's architecture and the layer's rule once."""
    if m <= 8 or not row_scales or arch_key(device) != "sm90":
        return 0, -1
    nk = n * k
    if m <= 16:
        return (8 if nk <= SLAB_MAX_NK else 0), -1
    if m <= 32:
        return (16 if nk <= SLAB_A8_SHORT_MAX_NK else 0), -1
    shared = _a8_shared_x_slab(m, n, k)
    if shared:
        return shared
    if nk > SLAB_MAX_NK:
        return 0, -1
    if m <= 48:
        return 16, -1
    if n < k:
        return (16 if m <= 96 else 32 if m <= 128 else 0), -1
    return (32 if m <= 64 else 0), -1


def mma_a8_slab(m: int, n: int, k: int, row_scales: bool, device: torch.device) -> int:
    """Tokens a CTA of cuda_mma_a8 (0: one CTA column over all of M), as mma_a8_launch gives them."""
    return mma_a8_launch(m, n, k, row_scales, device)[0]


def mma_a8_row_groups(m: int, n: int, k: int, row_scales: bool, device: torch.device) -> int:
    """Sets of 16 weight rows a CTA of cuda_mma_a8 owns (-1: the kernel's own choice, small_m_split),
    where more sets sharing a slab's x were the fastest, as mma_a8_launch gives them."""
    return mma_a8_launch(m, n, k, row_scales, device)[1]


SM90: Table = {
    "cuda_mma": [(SLAB_A16_MAX_M, CudaMmaConfig())],  # M > 16 in token slabs only (mma_slab)
    "cuda_mma_a8_fused": [(2, CudaMmaConfig())],
    # block scales: M <= 32 (registry); M > 64 in token slabs only (mma_a8_slab)
    "cuda_mma_a8": [(SLAB_A8_MAX_M, CudaMmaConfig())],
    "cuda_gemv": [(2, CudaGemvConfig())],
    "cuda_mma_tiles": [(64, CudaMmaConfig())],
    "cuda_wgmma": [(_BIG, CudaMmaConfig())],
    "cuda_wgmma_a8": [(_BIG, CudaMmaConfig())],
    "dequant_a8": [(_BIG, DequantA8Config(128, 128, 64, num_warps=4, num_stages=5))],
    "triton_a16": [
        (16, FusedConfig(16, 64, num_warps=4, num_stages=4, max_split_k=8)),
        (32, FusedConfig(32, 128, num_warps=4, num_stages=4, swap=True, max_split_k=8)),
        (128, FusedConfig(64, 64, num_warps=4, num_stages=3, max_split_k=8)),
        (_BIG, FusedConfig(128, 128, num_warps=8, num_stages=3)),
    ],
    "triton_a8": [
        (16, FusedConfig(16, 64, num_warps=4, num_stages=4, max_split_k=8)),
        (32, FusedConfig(32, 64, num_warps=4, num_stages=4, max_split_k=8)),
        (64, FusedConfig(64, 64, num_warps=4, num_stages=4, max_split_k=8)),
        (128, FusedConfig(64, 64, num_warps=4, num_stages=3, max_split_k=8)),
        (256, FusedConfig(128, 64, num_warps=4, num_stages=3, max_split_k=2)),
        (_BIG, FusedConfig(128, 64, num_warps=4, num_stages=3)),
    ],
    "triton_gemv": [(4, GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=2))],
    "triton_gemm": [
        (16, GemmConfig(block_m=16, block_n=128, num_warps=4, num_stages=3)),
        (32, GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=4)),
        (256, GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=4)),
        (_BIG, GemmConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)),
    ],
    "dequant_cublas": [(_BIG, DequantConfig(block_n=32, block_k=512))],
}

DEFAULT: Table = {
    "cuda_mma": [(16, CudaMmaConfig())],
    "cuda_mma_a8_fused": [(2, CudaMmaConfig())],
    "cuda_mma_a8": [(16, CudaMmaConfig())],
    "cuda_gemv": [(8, CudaGemvConfig())],
    "cuda_mma_tiles": [(64, CudaMmaConfig())],
    "triton_a16": [
        (16, FusedConfig(16, 64, num_warps=4, num_stages=2)),
        (64, FusedConfig(64, 64, num_warps=4, num_stages=2)),
        (_BIG, FusedConfig(128, 64, num_warps=4, num_stages=2)),
    ],
    "triton_a8": [
        (16, FusedConfig(16, 64, num_warps=4, num_stages=2)),
        (64, FusedConfig(64, 64, num_warps=4, num_stages=2)),
        (_BIG, FusedConfig(64, 128, num_warps=4, num_stages=2)),
    ],
    "triton_gemv": [(4, GemvConfig(block_n=16, block_k=256, num_warps=4, num_stages=2))],
    "triton_gemm": [
        (16, GemmConfig(block_m=16, block_n=64, num_warps=4, num_stages=2)),
        (64, GemmConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)),
        (_BIG, GemmConfig(block_m=128, block_n=64, num_warps=4, num_stages=2)),
    ],
    "dequant_cublas": [(_BIG, DequantConfig(block_n=32, block_k=512))],
}

TABLES: dict[str, Table] = {"sm90": SM90, "default": DEFAULT}

# backend -> arch -> smallest M it takes when not forced (the registry walks by priority).
MIN_M: dict[str, dict[str, int]] = {
    "cuda_mma_tiles": {"sm90": 17, "default": 17},  # cuda_mma is faster up to M = 16
    "cuda_wgmma": {"sm90": 9, "default": 9},  # cuda_mma up to M = 8, and to 16 but on wide layers (wgmma_declines)
    "cuda_wgmma_a8": {"sm90": 17, "default": 17},  # cuda_mma_a8 up to M = 16 (32 on sm_90, less mma_a8_declines)
    "cuda_dequant": {"sm90": 256, "default": 256},
    "dequant_a8": {"sm90": 2048, "default": 2048},
    "dequant_cublas": {"sm90": 256, "default": 256},
}

# Where cuda_wgmma serves an M of its bucket (see the sweep above): up to WGMMA_MID_M (one 64-token
# tile) the layers with N * K >= WGMMA_MID_MIN_NK and K >= WGMMA_SMALL_M_MIN_K, and from
# WGMMA_SHORT_K_MID_MIN_M the K = 1024 layers with N * K >= WGMMA_SHORT_K_MID_MIN_NK; up to
# WGMMA_MAX_M every layer, less the small ones above WGMMA_SMALL_LAYER_MAX_M.
# M = 17..64: benchmarks/sweep_tiles.py --kernel wgmma --ms 8 16 24 32 48 64 at 8997d70
# (results/h200/sweep_wgmma_small_m_8997d70.json), its 64-token tiles against cuBLAS bf16: 1.24-1.63x
# on the four 8B shapes, where cuda_mma_tiles ran 1.17-1.50x at M = 32 and 0.72-1.03x at M = 64
# (bench_linear.py --below-floors at the same commit, bench_linear_mid_m_below_floors_8997d70.json);
# on the N = 1024 layers 0.86-1.14x, behind cuda_mma_tiles (0.95-1.35x at bc99b65), which keeps them.
# M = 24..512 on the four 0.6B shapes, every backend forced (bench_linear.py --below-floors at
# af5f740, results/h200/bench_linear_06b_mid_m_below_floors_af5f740.json, and the tiles in
# sweep_wgmma_06b_af5f740.json): the dispatcher of that commit ran triton_a16 at M = 65..255 on the
# K = 1024 layers (0.37-0.54x) and at M = 129..255 on the N = 1024 layers (0.20-0.23x, a hole:
# cuda_wgmma declined them and cuda_dequant starts at 256), and cuda_dequant at 256..512
# (0.60-0.73x). cuda_wgmma with the tile rule of ternary_wgmma.cu ran 0.59-0.90x on the K = 1024
# layers at M = 96..512 and 0.76-1.04x on the N = 1024 layers at M = 96..256; at M = 48 and 64 on
# 1024 -> 4096 and 1024 -> 6144 0.69-0.75x against cuda_mma_tiles' 0.58-0.70x (at M = 24
# cuda_mma_tiles led, 0.86-0.89x against 0.77-0.78x). On the N = 1024 layers at M = 384 and 512
# cuda_dequant stays ahead (0.69-0.71x against 0.57-0.69x).
WGMMA_MID_M = 64
WGMMA_MID_MIN_NK = 1 << 24
# M = 9..16 (WGMMA_WIDE_MIN_M..WGMMA_WIDE_MAX_M, cuda_mma's largest M): one 64-token wgmma tile
# costs the same at any M up to 64, while cuda_mma slows as M grows. bench_linear.py --below-floors
# --ms 8 9 12 16 on nine shapes at 0474fb7 (results/h200/bench_linear_wide_small_m_0474fb7.json),
# against cuBLAS bf16, cuda_mma / cuda_wgmma: on 4096 -> 28672 1.37 / 1.39x at M = 9, 1.29 / 1.39x at
# 12, 1.27 / 1.50x at 16; on 5120 -> 27648 1.37 / 1.37x, 1.29 / 1.36x, 1.28 / 1.51x. Everywhere else
# cuda_mma was as fast or faster: 4096 -> 14336 (N * K = 2^25.8) 1.38 / 1.23x at M = 9, and
# 3584 -> 37888, whose 148 CTAs of 256 rows need a second wave on 132 SMs, 1.27 / 1.03x at M = 9 and
# 1.11 / 1.04x at 16. Since its 16-token tile (two CTAs an SM, the auto tile up to M = 16), on
# 4096 -> 14336 too: sweep_tiles.py --kernel wgmma and --kernel mma --ms 1 4 8 16 at 3c8c22a
# (results/h200/sweep_wgmma_small_3c8c22a.json, sweep_mma_small_3c8c22a.json), at M = 16 1.62x
# against cuda_mma's 1.19x (4096 -> 28672: 1.78x against 1.22x); on 4096 -> 4096 and 14336 -> 4096
# cuda_mma stayed ahead (1.56 / 1.28x, 1.50 / 1.38x), and at M = 8 everywhere but 4096 -> 28672
# (1.86 / 1.91x). The bound that kept layers of more than 256 rows a SM out (the 64-token tiles'
# second wave) went with that tile: bench_linear.py --below-floors --backends cuda_mma,cuda_wgmma
# --ms 1 8 9 12 16 at bc42e8a (results/h200/bench_linear_small_m_bc42e8a.json) ran 3584 -> 37888
# at 1.74x on cuda_wgmma against cuda_mma's 1.07-1.22x at M = 9..16. So from M = 9 cuda_wgmma takes
# the wide up-projections: N >= WGMMA_WIDE_N_OVER_K * K, N * K >= WGMMA_WIDE_MIN_NK and
# K >= WGMMA_SMALL_M_MIN_K; cuda_mma leaves those to it (registry._can_cuda_mma).
WGMMA_WIDE_MIN_M = 9
WGMMA_WIDE_MAX_M = 16
WGMMA_WIDE_N_OVER_K = 3
WGMMA_WIDE_MIN_NK = 1 << 25
WGMMA_SHORT_K_MID_MIN_M = 33
WGMMA_SHORT_K_MID_MIN_NK = 1 << 22
WGMMA_SMALL_M_MIN_K = 2048
# M = 65..2048, every layer. Before e697c98 only M = 65..256 was every layer's; above that the
# K = 1024 layers ran cuda_wgmma to M = 512 and those with N * K >= 2^25 to M = 2048, the rest
# cuda_dequant. The producer-warpgroup tiles and the tile cost model of ternary_wgmma.cu, in the
# sweep at e697c98 (sweep_wgmma_wg_e697c98.json), against cuBLAS bf16, with cuda_dequant of the
# c8f9e4e bench_linear run beside them: 4096 -> 4096 0.93x against 0.68x at M = 512 and 0.95x
# against 0.88x at 2048; the N = 1024 layers 0.70-0.72x against 0.70x at M = 512, 0.88x against
# 0.82-0.84x at 2048; 1024 -> 4096 and 1024 -> 6144 at 2048 0.89-0.91x against 0.86-0.88x.
# The bench_linear run at 4dba057 timed both backends in one run (bench_linear_4dba057.json):
# 4096 -> 4096 0.89x against 0.68x at M = 512, the N = 1024 layers 0.86-0.87x against 0.82-0.84x
# at 2048, but 0.67x against 0.70x at 512 on those two layers, the one place cuda_dequant still led.
WGMMA_MAX_M = 2048
# Except on the small layers (N * K < WGMMA_SMALL_LAYER_NK: the 0.6B class's N = 1024 ones) above
# M = WGMMA_SMALL_LAYER_MAX_M. Both backends forced, against cuBLAS bf16 (bench_linear.py
# --below-floors, results/h200/bench_linear_mid_781e930.json and bench_linear_06b_0edf064.json,
# 2048 -> 1024 and 3072 -> 1024): cuda_wgmma / cuda_dequant 0.75 / 0.73x and 0.69 / 0.70x at
# M = 320, 0.68-0.69 / 0.71-0.72x at 384, 0.67-0.69 / 0.70-0.72x at 512, 0.60 / 0.71x and
# 0.87 / 0.77x at 768, 0.73-0.75 / 0.78-0.79x at 1024, 0.71-0.72 / 0.79-0.82x at 1536. The 128-row
# CTAs of a 1024-row layer leave SMs idle until M is a multiple of 2048 (0.86-0.87 / 0.82-0.84x
# at M = 2048 in bench_linear_4dba057.json), where cuBLAS balances its tiles at any M.
WGMMA_SMALL_LAYER_NK = 1 << 22
WGMMA_SMALL_LAYER_MAX_M = 256


# dequant_a8 wants at least this many output tiles per SM: at M = 2048 on the N = 1024 layers
# (128 tiles of 128 x 128 on 132 SMs) it ran 0.63-0.64x of cuBLAS bf16, behind triton_a8's
# 0.72-0.76x, and ahead from M = 8192 (0.80-0.83x against 0.71-0.73x; results/h200/
# bench_a8_row_dequant_fa26c74.json, bench_a8_row_dequant_1ae0ffb.json and bench_linear_cd61348.json).
DEQUANT_A8_MIN_TILES_PER_SM = 2


def dequant_a8_declines(m: int, n: int, device: torch.device) -> str:
    """Why dequant_a8 leaves an (M, N) to the fused kernels (too few tiles to fill the GPU), or ""."""
    tile = TABLES[arch_key(device)]["dequant_a8"][-1][1]
    tiles = -(-m // tile.block_m) * -(-n // tile.block_n)
    sms = sm_count(device)
    if tiles < DEQUANT_A8_MIN_TILES_PER_SM * sms:
        return (f"M={m}, N={n}: {tiles} tiles of {tile.block_m} x {tile.block_n} for {sms} SMs, below "
                f"{DEQUANT_A8_MIN_TILES_PER_SM} a SM; the fused kernels are faster there")
    return ""


# cuda_wgmma_a8 with a scale per row (its int32 sums run over all of K, no per-block scaling; K split
# over a cluster where a launch leaves SMs idle) against triton_a8, both forced side by side:
# bench_linear.py --below-floors --backends triton_a8,cuda_wgmma_a8 at e084e64
# (results/h200/bench_linear_a8_mid_below_floors_e084e64.json, eleven layers, M = 17..1024; the same at
# 04a635e, before the split, for the 8B-class layers), against cuBLAS bf16 in the same run:
# - K >= 4096, M <= 64: ahead where its 64-token tiles of 128 weight rows keep 70% of the SMs busy,
#   the wide up-projections (N >= 14336: 1.71-2.15x against triton_a8's 1.36-1.92x); behind with 32
#   to 48 CTAs even split (0.79-1.26x against 0.92-1.74x on the N = 4096 and 6144 layers).
# - K >= 4096, M = 65..128: ahead or level on each (the down-projections, split in two: 1.20-1.22x
#   against 1.12x).
# - K >= 4096, M = 129..2047: ahead or level (0.82-1.19x against 0.78-1.08x) but where the CTAs fill
#   the last of two or more waves on 132 SMs to under 80% (4096->6144 at M = 256 and 512, 192 CTAs in
#   two waves: 0.80x against 0.93x and 1.04x). In one wave it is ahead even short of 80% full: the
#   96 CTAs of 4096->4096 at M = 160 and 192 ran 16.33 and 16.44 us against triton_a8's 38.17 and
#   32.18 (an H100, bench_linear.py --below-floors --backends cuda_wgmma_a8,triton_a8 at 6b4e389,
#   results/h100/bench_linear_a8row_4096_mid_6b4e389.json), whose partial tiles then all read one row
#   for their spare rows (triton_fused.load_rows). The e084e64 run above had no M between 128 and 256.
#   From K = 8192 (the down-projections) the rule does not hold: cuda_wgmma_a8 was ahead at every
#   point of M = 257..2047 that timed both, those where the last wave is short included: 14336->4096 at
#   M = 320 and 384 (160 and 192 CTAs) 0.94-0.95 of triton_a8's time in two H100 runs at b3b2dec
#   (results/h100/sweep_a8_b3b2dec.json, ab_load_rows_new_r{1,2}_b3b2dec.json), and 0.62-0.80 at
#   M = 448, 512 and 1024 there, in e084e64 and the H100 full runs (12288->4096 too).
#   WGMMA_A8_ROW_LAST_WAVE_MAX_K bounds the last-wave rule.
# - K < 4096 (the 0.6B layers): behind at M <= 128 (0.44-1.05x against 0.56-1.14x); on the N = 1024
#   layers ahead at M = 256..1024 (0.47-0.64x against 0.44-0.58x, split where M <= 512), on the
#   K = 1024 ones behind from M = 512.
# - K < 4096 between M = 128 and 256, the points the e084e64 run did not have (an H100 at b3b2dec,
#   after triton_a8's spare rows stopped reading one row: results/h100/sweep_a8_b3b2dec.json at
#   M = 160, 192, 224 and results/h100/ab_load_rows_new_r{1,2}_b3b2dec.json at 256, us a call with
#   the quantization): ahead on the wide layers to M = 256 (1024->4096 8.98-9.64 against
#   10.85-12.09, 1024->6144 11.94-12.92 against 12.35-14.06), behind from 320 (12.40 against 10.04,
#   16.26 against 12.02); on the N = 1024 layers ahead to M = 192 (3072->1024 11.19 and 11.26
#   against 13.19 and 13.33, 2048->1024 10.28 and 10.40 against 10.54 and 10.70), behind or level
#   at 224 (11.87 against 10.69, 13.50 against 13.44), before d190e12. WGMMA_A8_ROW_SHORT_K_MAX_M
#   holds the wide layers' bound. Since d190e12 the N = 1024 layers run cuda_wgmma_a8 from M = 129 on:
#   at M = 192 9.0 and 9.9 us against triton_a8's 10.6 and 13.3 (2048->1024, 3072->1024; an H100,
#   results/h100/bench_linear_split_sums_d190e12.json), and the item below from 256; M = 193..255 has
#   not run since the change.
# - K >= 4096 with N * K <= 2^24 (4096->4096 of the eight layers) at M = 96..128: triton_a8 was ahead
#   in every run that timed both before d190e12 (at M = 128 0.86-0.95 of cuda_wgmma_a8's time in
#   sixteen H100 runs, f6f4718 and earlier), while this kernel's split-K launches there waited on their
#   cluster sums in series (ternary_wgmma_a8.cu, split_reduce_store). Since d190e12 it is ahead:
#   14.1, 14.0 and 14.0 us at M = 96, 112 and 128 against triton_a8's 14.8, 14.9 and 15.3, started
#   early after the quantization (an H100, results/h100/bench_linear_a8row_4096_01fdd22.json).
#   The rule that gave triton_a8 these M is gone.
# - The N = 1024 layers at M = 256..1024 since d190e12 (an H100,
#   results/h100/bench_linear_a8row_n1024_01fdd22.json, both forced, with the quantization): ahead of
#   triton_a8 started early, which had overtaken the split launches at M = 256 and 512 on 2048->1024
#   (results/h100/bench_linear_early_on_4d94a8d.json): level at 256 (10.6 against 10.8 us), 0.82-0.88
#   of its time at M = 320..1024 (10.5-11.3 against 12.8-12.9 at 320..512); on 3072->1024 0.68-0.92
#   at M = 256..1024.
# From M = 2048 dequant_a8 goes first; at M >= 2048 with K < 4096 triton_a8 was faster (0.6B layers,
# sweep_wgmma_a8_row_0da2207.json against bench_linear_3c8c22a.json) than the register-operand tiles.
# Wherever the kernel takes its shared-memory tile (5) it is ahead of both (wgmma_a8_smem_takes).
WGMMA_A8_ROW_MIN_K = 4096
WGMMA_A8_ROW_LAST_WAVE_MAX_K = 8192  # the last-wave rule: K below this only
WGMMA_A8_ROW_SHORT_K_MAX_M = 256  # from M = 129; on N <= 1024 up to M = 2047

# Calls outside CUDA graphs. Everything above is GPU time under CUDA graphs (bench_linear), where a
# call's host work is gone at replay. vLLM captures batches up to 512 tokens (its default
# max_cudagraph_capture_size) and runs larger ones eagerly, and there each call also pays that work.
# The two int8 paths that lead at large M launch Triton kernels from Python: dequant_a8 two (decode,
# GEMM), triton_a8 one. benchmarks/probe_host_call.py --a8 --all-backends at 24815a1
# (results/h200/probe_host_call_a8_24815a1.json: 50 eager calls in a row on each of the embedder's four
# layers, the host's issue time and the wall time to the last kernel's end, per call): at M = 2048
# dequant_a8 issued in 101-105 us and triton_a8 in 70-73, and their wall time was the same (the GPU
# waited on the host), where cuda_wgmma_a8, one launch from C++, issued in 17-19 us and finished in
# 18-53. At M = 16384 the kernels set the pace: cuda_wgmma_a8 took 113-418 us a call against
# dequant_a8's 103-240. Its kernel time grows with M * N * K (the four layers at 16384: 2.9 to 4.4 ns
# per million multiply-adds), dequant_a8's host time does not; it reaches dequant_a8's 102 us between
# M * N * K = 2.3e10 (1024 -> 4096) and 3.6e10 (3072 -> 1024); the bound was 2^34 (1.7e10).
# cuda_dequant_a8 then took dequant_a8's calls with one Python launch fewer, and the signature cache
# cut every call's entry: probe_host_call.py --a8 --all-backends at 3070b64
# (results/h200/probe_host_call_a8_3070b64.json, the same method, M = 2048, 8192 and 16384) measured it
# at 40-46 us of host time a call on these layers (dequant_a8 53-60 us). The crossing moved down with
# it, and 2^34 put two points on the slower side: 1024 -> 6144 at M = 2048 (1.3e10), 53 us a call on
# cuda_wgmma_a8 against 40 on cuda_dequant_a8, and 2048 -> 1024 at M = 8192 (1.7e10), 55 against 45.
# So a row-scaled int8 call above GRAPH_MAX_M tokens and up to EAGER_A8_ROW_MAX_MNK = 2^33 (8.6e9, at
# most about 38 us of its kernel on these layers, the bound of the 16-bit rule below) goes to
# cuda_wgmma_a8 (registry._can_dequant_a8 and _can_cuda_wgmma_a8); in that probe every point above
# GRAPH_MAX_M then falls on its faster side (tests/cuda/test_configs.py holds the rule to it).
# - By M, not by whether a graph is being captured: vLLM runs each size once eagerly before capturing
#   it, and a Triton kernel first loaded while a stream captures fails (the driver refuses to load a
#   module then), so the captured call must take what its warm-up took. A batch above GRAPH_MAX_M
#   that is captured anyway (a larger max_cudagraph_capture_size, or torch.cuda.graph by hand) runs
#   cuda_wgmma_a8 there too: correct, and at most the kernel-time difference slower. The vLLM plugin
#   sets the bound to the engine's own max_cudagraph_capture_size (0 when it captures none: with
#   enforce_eager every call is eager) while vLLM builds the model (set_graph_max_m);
#   TERNOP_GRAPH_MAX_M overrides both, read when a call key is first seen.
# - Only row scales: with them every W2A8 backend gives the same bits (ternop/activations.py), so the
#   rule changes no result; with block scales the kernels may round differently.
GRAPH_MAX_M = 512
ENV_GRAPH_MAX_M = "TERNOP_GRAPH_MAX_M"
EAGER_A8_ROW_MAX_MNK = 1 << 33


_engine_graph_max_m: int | None = None


def set_graph_max_m(value: int | None) -> None:
    """The largest batch the serving engine captures in a CUDA graph (vLLM's max_cudagraph_capture_size,
    0 when it captures none), or None for GRAPH_MAX_M. Choices already made are forgotten when it changes."""
    global _engine_graph_max_m
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"the largest captured batch must be a whole number of tokens, 0 or more, got {value!r}")
    if value != _engine_graph_max_m:
        _engine_graph_max_m = value
        backends.clear_cache()


def graph_max_m() -> int:
    """The largest M taken to run inside a CUDA graph: TERNOP_GRAPH_MAX_M, else what the engine set
    (set_graph_max_m), else GRAPH_MAX_M."""
    text = os.environ.get(ENV_GRAPH_MAX_M, "").strip()
    if not text:
        return GRAPH_MAX_M if _engine_graph_max_m is None else _engine_graph_max_m
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{ENV_GRAPH_MAX_M}={text!r}: expected a whole number of tokens, 0 or more")
    return value


def eager_a8_row_host_bound(m: int, n: int, k: int) -> bool:
    """Whether a row-scaled int8 (M, N, K) runs outside vLLM's CUDA graphs (M > graph_max_m()) on a
    product small enough that the Triton paths' host time exceeds cuda_wgmma_a8's kernel time."""
    return m > graph_max_m() and m * n * k <= EAGER_A8_ROW_MAX_MNK


# The same for 16-bit activations, where cuda_wgmma declines in favour of the dequantizing path (the
# small layers above M = WGMMA_SMALL_LAYER_MAX_M, every layer above WGMMA_MAX_M): cuda_dequant is one
# C++ op but two launches and an allocation, the others Triton. benchmarks/probe_host_call.py
# --all-backends at 24815a1 (results/h200/probe_host_call_24815a1.json, the method above): at M = 2048
# on 2048 -> 1024 and 3072 -> 1024, where the table picks cuda_dequant, it issued in 40-41 us a call
# and finished in 41-43, cuda_wgmma issued in 17 and finished in 17-21. At M = 16384 the kernels set
# the pace (cuda_wgmma 107-362 us a call on the four layers against cuda_dequant's 95-315): 3.0 to 3.5
# ns per million multiply-adds, which reach cuda_dequant's host time (37-50 us there) between
# M * N * K = 1.2e10 and 1.4e10. Up to EAGER_A16_MAX_MNK = 2^33 (8.6e9, at most about 30 us of its
# kernel) a 16-bit call above graph_max_m() goes to cuda_wgmma from M = WGMMA_MID_M + 1 (below that
# the other candidates are C++ launches too). On the 0.6B layers that is 2048 -> 1024 up to M = 4096
# and 3072 -> 1024 up to 2730; the others already run cuda_wgmma there. Each M still has one backend,
# captured or not.
EAGER_A16_MAX_MNK = 1 << 33


def eager_a16_host_bound(m: int, n: int, k: int) -> bool:
    """Whether a 16-bit (M, N, K) above vLLM's CUDA graphs and WGMMA_MID_M is small enough that
    cuda_wgmma's kernel costs less than the dequantizing paths' host time (see above)."""
    return m > max(graph_max_m(), WGMMA_MID_M) and m * n * k <= EAGER_A16_MAX_MNK


def host_rule_edges(n: int, k: int) -> list[int]:
    """The M at which the rules above change their answer for an N x K layer, and the M after
    each: the CUDA-graph bound and the two eager products' bounds. The tables' buckets and tiles
    change only at multiples of 16; these need not (``ternop.warmup`` samples both)."""
    edges = [graph_max_m(), EAGER_A8_ROW_MAX_MNK // (n * k), EAGER_A16_MAX_MNK // (n * k)]
    return sorted({e + d for e in edges for d in (0, 1) if e + d >= 1})


WGMMA_A8_SMEM_MIN_M = 512
WGMMA_A8_SMEM_SHORT_K = 4096


def wgmma_a8_row_tile(m: int, n: int, k: int, sms: int) -> tuple[int, int]:
    """(tile, CTAs) of a row-scaled cuda_wgmma_a8 launch before any split of K, as
    ``ternary_wgmma_a8_tile`` in ternary_wgmma_a8.cu picks the tile (tests/cuda/test_wgmma_tile_rule.py
    holds the two to each other): 0 (128 rows x 64 tokens) up to M = 64; from M = WGMMA_A8_SMEM_MIN_M,
    5 (128 x 256, the weights decoded into shared memory) where its CTAs fill the GPU and their last
    wave to 80% or more, else, below K = WGMMA_A8_SMEM_SHORT_K, 4 (the same kernel on 128 x 128) where
    its CTAs make one wave that fills 90% of the GPU or more; from M = 2048, 2 (192 x 128) where its
    CTAs fill the GPU; else 1 (128 x 128) where its CTAs fill three quarters of it, or 0."""
    def ctas(rows: int, tokens: int) -> int:
        return -(-n // rows) * -(-m // tokens)

    if m <= 64:
        return 0, ctas(128, 64)
    if m >= WGMMA_A8_SMEM_MIN_M:
        count = ctas(128, 256)
        if count >= sms and 5 * count >= 4 * -(-count // sms) * sms:
            return 5, count
        count = ctas(128, 128)
        if k < WGMMA_A8_SMEM_SHORT_K and 9 * sms <= 10 * count <= 10 * sms:
            return 4, count
    if m >= 2048 and ctas(192, 128) >= sms:
        return 2, ctas(192, 128)
    if 4 * ctas(128, 128) >= 3 * sms:
        return 1, ctas(128, 128)
    return 0, ctas(128, 64)


# cuda_wgmma_a8's tile 5 against the dense int8 path (dequant_a8, cuda_dequant_a8) with row scales. The
# tile decodes the codes into shared memory and runs the loop of a dense int8 GEMM
# (ternary_wgmma_a8_ss.cu). Since its decoders stopped holding up its tensor cores (four decoder warps,
# each loading a block's words before storing any), the same-run comparison with the dense path forced
# (bench_linear.py --below-floors --backends cuda_dequant_a8,cuda_wgmma_a8,triton_a8 at 72e4256,
# results/h100/bench_linear_a8row_72e4256.json, an H100; the tile there had the loads-first decoders,
# three warps of them) has the tile ahead or level wherever the kernel's rule takes it: on the 8B
# layers 1.29-1.45x of cuBLAS bf16 at M = 2048 and 1.30-1.45x at 8192 against the dense path's
# 0.99-1.09x and 1.04-1.22x; on the 0.6B layers 0.99-1.08x at 2048 (where it runs) against 0.86-0.94x,
# and 0.84-1.05x at 8192 against 0.73-1.05x. So wherever the kernel takes tile 5, the dense path leaves
# the call to it. (Before, at 5966225, the tile was ahead on the K >= 4096 layers only.)
def wgmma_a8_smem_takes(m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether a row-scaled (M, N, K) goes to cuda_wgmma_a8's shared-memory tile of 256 tokens before
    the dense int8 path."""
    return wgmma_a8_row_tile(m, n, k, sm_count(device))[0] == 5


def wgmma_a8_row_declines(m: int, n: int, k: int, device: torch.device) -> str:
    """Why cuda_wgmma_a8 leaves a row-scaled (M, N, K) to triton_a8, or "" where it is the faster one."""
    sms = sm_count(device)
    tile, ctas = wgmma_a8_row_tile(m, n, k, sms)
    if tile == 5:  # the shared-memory tile: ahead of triton_a8 at every point it ran in 72e4256's run (above)
        return ""
    if k < WGMMA_A8_ROW_MIN_K:
        if 128 < m <= WGMMA_A8_ROW_SHORT_K_MAX_M or (n <= 1024 and 128 < m < 2048):
            return ""
        return (f"row scales at M={m}, N={n}, K={k}: triton_a8 is faster below K={WGMMA_A8_ROW_MIN_K} "
                f"but at M = 129..{WGMMA_A8_ROW_SHORT_K_MAX_M}, on N <= 1024 at M = 129..2047, "
                f"and where the shared-memory tile runs")  # fmt: skip
    if m <= 64:
        if 10 * ctas < 7 * sms:
            return (f"row scales at M={m}, N={n}: {ctas} CTAs of 128 rows x 64 tokens for {sms} SMs, under 70% "
                    f"of them; triton_a8 is faster there")  # fmt: skip
        return ""
    if m <= 128 or m >= 2048:
        return ""
    waves = -(-ctas // sms)
    if waves > 1 and k < WGMMA_A8_ROW_LAST_WAVE_MAX_K and 5 * ctas < 4 * waves * sms:
        return (f"row scales at M={m}, N={n}: {ctas} CTAs on {sms} SMs fill their last wave to under 80%; "
                f"triton_a8 is faster there")  # fmt: skip
    return ""


def wgmma_wide_layer(n: int, k: int) -> bool:
    """Whether cuda_wgmma beats cuda_mma on this layer at M = WGMMA_WIDE_MIN_M..WGMMA_WIDE_MAX_M (see above)."""
    return n >= WGMMA_WIDE_N_OVER_K * k and n * k >= WGMMA_WIDE_MIN_NK and k >= WGMMA_SMALL_M_MIN_K


def wgmma_declines(m: int, n: int, k: int) -> str:
    """Why cuda_wgmma leaves this (M, N, K) to another backend, or "" where it is the faster one."""
    if m <= WGMMA_WIDE_MAX_M:
        if m >= WGMMA_WIDE_MIN_M and wgmma_wide_layer(n, k):
            return ""
        return (f"M={m}, N={n}, K={k}: up to M = {WGMMA_WIDE_MAX_M} cuda_wgmma runs only wide layers, from "
                f"M = {WGMMA_WIDE_MIN_M} (N >= {WGMMA_WIDE_N_OVER_K} * K, N * K >= {WGMMA_WIDE_MIN_NK}, "
                f"K >= {WGMMA_SMALL_M_MIN_K}); cuda_mma is faster "
                f"on the others")
    if m <= WGMMA_MID_M:
        if n * k >= WGMMA_MID_MIN_NK and k >= WGMMA_SMALL_M_MIN_K:
            return ""
        if m >= WGMMA_SHORT_K_MID_MIN_M and k < WGMMA_SMALL_M_MIN_K and n * k >= WGMMA_SHORT_K_MID_MIN_NK:
            return ""
        return (f"M={m}, N * K = {n * k}, K={k}: up to M = {WGMMA_MID_M} cuda_wgmma runs layers with "
                f"N * K >= {WGMMA_MID_MIN_NK} and K >= {WGMMA_SMALL_M_MIN_K}, and from M = "
                f"{WGMMA_SHORT_K_MID_MIN_M} those with K < {WGMMA_SMALL_M_MIN_K} and N * K >= "
                f"{WGMMA_SHORT_K_MID_MIN_NK}; cuda_mma_tiles is faster on the others")
    if n * k < WGMMA_SMALL_LAYER_NK and m > WGMMA_SMALL_LAYER_MAX_M:
        return (f"M={m}, N * K = {n * k}: on layers with N * K < {WGMMA_SMALL_LAYER_NK} cuda_wgmma runs up to "
                f"M = {WGMMA_SMALL_LAYER_MAX_M}; the dequantizing path is faster above")
    if m <= WGMMA_MAX_M:
        return ""
    return f"M={m}: cuda_wgmma runs up to M = {WGMMA_MAX_M}; the dequantizing path is faster above"


_CAPABILITY_CACHE: dict[int, tuple[int, int]] = {}
_SM_COUNT_CACHE: dict[int, int] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of the device. Cached per device index (no per-call driver query)."""
    index = _index(device)
    if index not in _CAPABILITY_CACHE:
        _CAPABILITY_CACHE[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY_CACHE[index]


def signals_dependents(device: torch.device) -> bool:
    """Whether the kernels that quantize x per token (``quant_rows_kernel``, ``rms_norm_quant_kernel``)
    let the next kernel start before they end: sm_90 and later, where the small-M int8 kernel is
    launched for that (programmatic dependent launch, ``csrc/ternary_common.cuh``), and with a Triton
    that has the signal (3.4 and later)."""
    return device.type == "cuda" and device_capability(device)[0] >= 9 and _triton_has_gdc()


# At M <= 2, the fused kernel (cuda_mma_a8_fused: one launch whose CTAs each quantize
# x) against the quantization launch + cuda_mma_a8 started early (sm_90+, csrc/ternary_common.cuh).
# In bench_linear_pdl_on_cf1403c.json (an H100, M = 1, row scales, one run) the pair was 0.1-0.6 us ahead
# on the 8B-class layers, N * K >= 2^24 (4096->4096 5.70 against 6.00 us, 4096->14336 10.60 against
# 11.11, 14336->4096 12.05 against 12.66, 4096->28672 17.38 against 17.47), and 0.0-0.4 us behind on
# the 0.6B-class ones, N * K <= 3 * 2^21 (2048->1024 4.23 against 3.84). Through the dispatcher, in
# results/h100/bench_linear_early_{off,on}_4d94a8d.json (the fused kernel against the pair), the four
# 8B-class layers went 6.07 -> 5.71, 11.22 -> 10.62, 17.38 -> 17.44, 12.97 -> 12.24 us at M = 1 and
# 7.21 -> 5.80, 12.38 -> 10.86, 18.78 -> 17.46, 16.26 -> 12.34 us at M = 2.
A8_EARLY_PAIR_MIN_NK = 1 << 24


def early_launch_enabled() -> bool:
    """Whether launches may start early: ``TERNOP_PDL`` is not ``0``. Read here on each ask (the
    Triton launch, the M <= 2 rule); ``early_launch_allowed`` in csrc/ternary_common.cuh reads the
    same variable once a process for the C++ launches."""
    return os.environ.get("TERNOP_PDL") != "0"


def starts_early(device: torch.device) -> bool:
    """Whether the int8 kernels are launched early, with programmatic dependent launch, after the
    kernel that quantized their rows: where that kernel signals (``signals_dependents``) and
    ``early_launch_enabled``. They wait before they read the rows."""
    return early_launch_enabled() and signals_dependents(device)


# The Triton int8 kernel started early, against the same launched plainly: bench_linear.py --ms 1 2 4
# 32 64 128 256 512 --backends cuda_mma_a8_fused,cuda_wgmma_a8,triton_a8 with TERNOP_PDL=0, then 1, on
# one H100 (results/h100/bench_linear_early_{off,on}_4d94a8d.json). Forced, row scales: 2-7% faster
# on the seven layers with K <= 4096 at every M up to 128, and 4-6% faster on the three with K <= 2048
# at M = 256 and 512; but 18% slower on 14336->4096 at M = 32 and 6-26% slower in five cells with
# K >= 3072 at M = 256 and 512 (with block scales four of those five were level or faster: not
# understood). No run has looked at M > 512. Where the dispatcher takes this kernel and the rule
# starts it early, ternop_a8_row gained 3-8% (M = 32..512 on 1024->4096 and 1024->6144, M = 32..128
# on the other 0.6B layers, M = 32 and 64 on 4096->4096). But ternop_q8_row (rows quantized
# beforehand, so the launch before is the previous layer's, which does not signal) lost 2-8% at
# M = 32..128: the kernel starts early only right after quantize_rows
# (launch_fused.linear_a8_quantized's after_quantize_rows), never for linear_q8.
TRITON_A8_EARLY_LIMITS = ((128, 4096), (512, 2048))  # (largest M, largest K) pairs


def triton_a8_starts_early(m: int, k: int, device: torch.device) -> bool:
    """Whether ``fused_a8_kernel`` for q [M, K] is launched early (``starts_early``): where the run
    above measured it faster, within one of ``TRITON_A8_EARLY_LIMITS``."""
    return any(m <= max_m and k <= max_k for max_m, max_k in TRITON_A8_EARLY_LIMITS) and starts_early(device)


def a8_fused_declines(n: int, k: int, device: torch.device) -> str:
    """Why cuda_mma_a8_fused leaves a call of N x K weights to the quantization launch and
    cuda_mma_a8 started early (empty: it takes the call)."""
    if n * k >= A8_EARLY_PAIR_MIN_NK and starts_early(device):
        return (f"N * K = {n * k} >= 2^24 on sm_90+: the quantization launch and cuda_mma_a8 started "
                "early are faster there (configs.A8_EARLY_PAIR_MIN_NK)")
    return ""


@functools.cache
def _triton_has_gdc() -> bool:
    import triton.language as tl

    return hasattr(tl.extra.cuda, "gdc_launch_dependents")


def sm_count(device: torch.device) -> int:
    """Multiprocessors of the device, cached per device index."""
    index = _index(device)
    if index not in _SM_COUNT_CACHE:
        _SM_COUNT_CACHE[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT_CACHE[index]


def arch_key(device: torch.device) -> str:
    """'sm90' for Hopper, else 'default'."""
    major, minor = device_capability(device)
    return f"sm{major}{minor}" if f"sm{major}{minor}" in TABLES else "default"


def min_m(backend: str, device: torch.device) -> int:
    """Smallest M the dispatcher gives ``backend`` on this device (1 when it has no floor)."""
    return MIN_M.get(backend, {}).get(arch_key(device), 1)


def split_k(tiles: int, k_blocks: int, sms: int, max_split: int) -> int:
    """How many K slices a launch of ``tiles`` output tiles uses.

    A fused kernel's program walks its K blocks one after another, so a launch needs several
    programs per multiprocessor to hide load and MMA latency. Slices are added until there
    are about four programs per multiprocessor, each slice keeping at least four scale
    blocks, and never more than ``max_split``.
    """
    if max_split <= 1:
        return 1
    want = -(-4 * sms // tiles)
    return max(1, min(max_split, want, k_blocks // 4))


def lookup(backend: str, m: int, device: torch.device, forced: bool = False) -> tuple[object | None, str]:
    """(config, "") for the first bucket of ``backend`` that covers M, else (None, reason).

    A forced backend (TERNOP_BACKEND) runs any M its kernel can take, with its last config.
    """
    arch = arch_key(device)
    buckets = TABLES[arch].get(backend, [])
    for max_m, config in buckets:
        if m <= max_m:
            return config, ""
    if not buckets:
        return None, f"no {backend} configs for {arch}"
    if forced:
        return buckets[-1][1], ""
    return None, f"M={m} is above {backend}'s largest bucket (M <= {buckets[-1][0]}) on {arch}"
