"""The CUDA C++ kernel sources compile for sm_90 with nvcc (no GPU needed).

It catches syntax and PTX errors in CI machines without a GPU. The torch binding
(linear_cuda.cpp) is compiled by the JIT build on GPU machines.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from ternop.cuda.cuda_ext import CSRC

NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize(
    "name",
    ["ternary_gemv", "ternary_mma", "ternary_mma_a8", "ternary_dequant", "ternary_mma_tiles", "ternary_wgmma",
     "ternary_wgmma_a8"],
)
def test_nvcc_compiles_kernel_for_sm90(tmp_path, name):
    source = CSRC / f"{name}.cu"
    obj = tmp_path / f"{name}.o"
    cmd = [
        # -Xptxas -O1: ptxas still checks the inline PTX, in less time than full optimisation.
        NVCC, "-c", "-std=c++17", "-O3", "-Xptxas", "-O1", "-gencode=arch=compute_90,code=sm_90",
        "-Werror", "all-warnings", str(source), "-o", str(obj),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"nvcc failed:\n{proc.stdout}\n{proc.stderr}"
    assert obj.stat().st_size > 0


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("name, instances", [("ternary_mma", 12), ("ternary_mma_a8", 18), ("ternary_mma_tiles", 6)])
def test_mma_kernel_fits_its_register_budget(tmp_path, name, instances):
    """Full ptxas optimisation: every instance of a tensor-core kernel fits the registers its
    __launch_bounds__ allow without spilling (a spill would put local-memory traffic in the loop).
    ternary_mma: fp16/bf16 x one or two n8 tiles x v1/a16, and both a16 kernels at depth 4;
    ternary_mma_a8: three output dtypes x (one tile, two tiles, one tile quantizing x itself) at
    depth 2 and 4; ternary_mma_tiles: fp16/bf16 x two tiles, and the split-K reduction."""
    source = CSRC / f"{name}.cu"
    cmd = [NVCC, "-c", "-std=c++17", "-O3", "-Xptxas", "-v", "-gencode=arch=compute_90,code=sm_90",
           str(source), "-o", str(tmp_path / "mma.o")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"nvcc failed:\n{proc.stdout}\n{proc.stderr}"
    spills = [line.strip() for line in proc.stderr.splitlines() if "spill" in line]
    assert len(spills) == instances, proc.stderr
    assert all(line.startswith("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads") for line in spills), spills


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("name, instances", [("ternary_wgmma", 18), ("ternary_wgmma_a8", 18)])
def test_wgmma_kernel_compiles_for_sm90a_unserialized_without_spills(tmp_path, name, instances):
    """The wgmma kernels for sm_90a (where their wgmma bodies exist): every instance (ternary_wgmma:
    fp16/bf16 x six tiles and the split-K reduction of the splits that do not add up in a cluster; ternary_wgmma_a8: three output dtypes x two
    tiles x block or row scales, and two more tiles with row scales) fits its registers without spilling, and ptxas keeps the wgmmas asynchronous: its C7515
    warning means it serialized them, which costs most of the speed."""
    source = CSRC / f"{name}.cu"
    cmd = [NVCC, "-c", "-std=c++17", "-O3", "-Xptxas", "-v", "-gencode=arch=compute_90a,code=sm_90a",
           str(source), "-o", str(tmp_path / "wgmma.o")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"nvcc failed:\n{proc.stdout}\n{proc.stderr}"
    assert "C7515" not in proc.stderr and "serialized" not in proc.stderr, proc.stderr
    spills = [line.strip() for line in proc.stderr.splitlines() if "spill" in line]
    assert len(spills) == instances, proc.stderr
    assert all(line.startswith("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads") for line in spills), spills
