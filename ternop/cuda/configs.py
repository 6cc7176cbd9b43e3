"""Static kernel configurations: per GPU architecture, M buckets -> kernel config.

There is no run-time autotuning (it would sync, and it is not capture-safe). The tables
were picked offline with ``benchmarks/bench_linear.py --sweep`` on an H200 (sm90); other
architectures fall back to conservative configs that compile everywhere.

A backend serves an M only if one of its buckets covers it; the registry asks backends in
priority order, so these tables also decide which backend runs for each M.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GemvConfig:
    """Triton CUDA-core GEMV: BLOCK_N rows per program, BLOCK_K (multiple of 128) per step."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class GemmConfig:
    """Triton tensor-core GEMM tile; BLOCK_K is fixed at one 128-wide scale block."""

    block_m: int
    block_n: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class DequantConfig:
    """Triton dequantize-to-dense tile, then cuBLAS."""

    block_n: int = 32
    block_k: int = 512


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

# Picked from benchmarks/results/h200/bench_linear.json (every backend at every M) and
# kernels_sweep.log (Triton tile candidates), both measured on the H200:
# - cuda_mma (tensor cores) is first for M <= 16: at M = 1 it beat cuda_gemv on six of the
#   eight shapes (13.2 us against 16.7 us on 4096x14336) and lost on two small ones by 5-10%;
#   at M = 2..16 it beat every other backend on every shape.
# - cuda_gemv (CUDA cores) keeps M <= 2 for what cuda_mma declines (fp32 x); its FMAs grow
#   with M (an earlier run: 125 us at M = 8 on 4096x14336, against the GEMM's 43 us).
# - triton_gemv lost to the GEMM at every M (78 us at M = 1 on 4096x14336), so it ranks
#   last and only runs when forced or when the GEMM cannot.
# - dequant_cublas (one dequantization pass, then cuBLAS) beats the in-GEMM decode from
#   M = 64 on most shapes; see MIN_M and FUSED_OVER_DEQUANT.
SM90: Table = {
    "cuda_mma": [(16, CudaMmaConfig())],
    "cuda_gemv": [(2, CudaGemvConfig())],
    "triton_gemv": [(4, GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=2))],
    "triton_gemm": [
        (16, GemmConfig(block_m=16, block_n=128, num_warps=4, num_stages=3)),
        (32, GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=4)),
        (64, GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=4)),
        (256, GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=4)),
        (_BIG, GemmConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)),
    ],
    "dequant_cublas": [(_BIG, DequantConfig(block_n=32, block_k=512))],
}

DEFAULT: Table = {
    "cuda_mma": [(16, CudaMmaConfig())],
    "cuda_gemv": [(8, CudaGemvConfig())],
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
MIN_M: dict[str, dict[str, int]] = {"dequant_cublas": {"sm90": 64, "default": 256}}

# arch -> (largest M, smallest N): layers at least that wide, at up to that M, run the fused
# GEMM instead of dequantize-then-cuBLAS (which writes a dense copy of the whole weight first).
# From two bench_linear runs on the H200 (speed-up over cuBLAS, fused vs dequant):
# 4096->14336 at M = 64: 0.73x / 0.76x vs 0.46x / 0.47x, at M = 128: 0.52x / 0.53x vs 0.47x / 0.48x;
# 4096->28672 at M = 64: 0.90x / 0.91x vs 0.44x / 0.44x, at M = 128: 0.49x / 0.51x vs 0.45x / 0.46x.
# Every narrower shape measured favours dequantizing there (4096->4096 at M = 64: 0.25x vs
# 0.63x), and at M = 512 every shape does.
FUSED_OVER_DEQUANT: dict[str, tuple[int, int]] = {"sm90": (128, 14336)}

_CAPABILITY_CACHE: dict[int, tuple[int, int]] = {}


def device_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of the device. Cached per device index (no per-call driver query)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY_CACHE:
        _CAPABILITY_CACHE[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY_CACHE[index]


def arch_key(device: torch.device) -> str:
    """'sm90' for Hopper, else 'default'."""
    major, minor = device_capability(device)
    return f"sm{major}{minor}" if f"sm{major}{minor}" in TABLES else "default"


def min_m(backend: str, device: torch.device) -> int:
    """Smallest M the dispatcher gives ``backend`` on this device (1 when it has no floor)."""
    return MIN_M.get(backend, {}).get(arch_key(device), 1)


def fused_beats_dequant(m: int, n: int, device: torch.device) -> bool:
    """Whether an [M, K] x [N, K] layer should skip dequantize-then-cuBLAS for the fused GEMM."""
    rule = FUSED_OVER_DEQUANT.get(arch_key(device))
    return rule is not None and m <= rule[0] and n >= rule[1]


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
