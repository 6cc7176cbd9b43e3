"""The CUDA C++ kernel sources compile for sm_90 with nvcc (no GPU needed).

It catches syntax and PTX errors in CI machines without a GPU. The torch binding
(linear_cuda.cpp) is linked by the JIT build on GPU machines; here it is compiled as host C++
against the installed torch's headers, so that an error in it shows before a GPU run.
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
     "ternary_wgmma_a8", "ternary_wgmma_a8_ss"],
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
@pytest.mark.parametrize("name, instances", [("ternary_mma", 18), ("ternary_mma_a8", 36), ("ternary_mma_tiles", 6)])
def test_mma_kernel_fits_its_register_budget(tmp_path, name, instances):
    """Full ptxas optimisation: every instance of a tensor-core kernel fits the registers its
    __launch_bounds__ allow without spilling (a spill would put local-memory traffic in the loop).
    ternary_mma: fp16/bf16 x one or two n8 tiles x v1/a16, both a16 kernels at depth 4, and the
    one-tile a16 kernel reading x from shared memory at depths 2 and 4, and the two-tile a16
    kernel reading x through its ring;
    ternary_mma_a8: three output dtypes x (one, two, four or eight tiles, one tile quantizing x
    itself) at depth 2 and 4; ternary_mma_tiles: fp16/bf16 x two tiles, and the split-K reduction."""
    source = CSRC / f"{name}.cu"
    cmd = [NVCC, "-c", "-std=c++17", "-O3", "-Xptxas", "-v", "-gencode=arch=compute_90,code=sm_90",
           str(source), "-o", str(tmp_path / "mma.o")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"nvcc failed:\n{proc.stdout}\n{proc.stderr}"
    spills = [line.strip() for line in proc.stderr.splitlines() if "spill" in line]
    assert len(spills) == instances, proc.stderr
    assert all(line.startswith("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads") for line in spills), spills


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("name, instances", [("ternary_wgmma", 18), ("ternary_wgmma_a8", 18), ("ternary_wgmma_a8_ss", 6)])
def test_wgmma_kernel_compiles_for_sm90a_unserialized_without_spills(tmp_path, name, instances):
    """The wgmma kernels for sm_90a (where their wgmma bodies exist): every instance (ternary_wgmma:
    fp16/bf16 x six tiles and the split-K reduction of the splits that do not add up in a cluster; ternary_wgmma_a8: three output dtypes x two
    tiles x block or row scales, and two more tiles with row scales; ternary_wgmma_a8_ss: three output
    dtypes x two tiles) fits its registers without spilling, and ptxas keeps the wgmmas asynchronous: its C7515
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


# What torch's CUDA context headers need of the CUDA libraries' own headers, which a CPU build of
# torch does not bring: the handle and status types they name. Used only where the real ones are
# not found (-idirafter).
_STAND_INS = {
    "cublas_v2.h": "typedef struct cublasContext* cublasHandle_t; typedef int cublasStatus_t;",
    "cublasLt.h": "typedef struct cublasLtContext* cublasLtHandle_t;",
    "cusparse.h": "typedef struct cusparseContext* cusparseHandle_t; typedef int cusparseStatus_t;",
    "cusolverDn.h": "typedef struct cusolverDnContext* cusolverDnHandle_t;",
    "cusolver_common.h": "typedef int cusolverStatus_t;",
    "c10/cuda/impl/cuda_cmake_macros.h": "#pragma once",
}


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_torch_binding_compiles_against_this_torch(tmp_path):
    """linear_cuda.cpp, the ops' CUDA registrations and argument checks, compiles as host C++ with
    this torch's headers. Errors inside torch's own headers (a torch whose headers need more of the
    CUDA libraries than the stand-ins give) skip the test; an error in ternop's source fails it."""
    from torch.utils import cpp_extension

    stand_ins = tmp_path / "stand_ins"
    for name, text in _STAND_INS.items():
        (stand_ins / name).parent.mkdir(parents=True, exist_ok=True)
        (stand_ins / name).write_text(text + "\n")
    cmd = [NVCC, "-x", "c++", "-std=c++17", "-c", "-Xcompiler", f"-idirafter,{stand_ins}",
           *(f"-I{path}" for path in cpp_extension.include_paths()), str(CSRC / "linear_cuda.cpp"),
           "-o", str(tmp_path / "linear_cuda.o")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    if proc.returncode != 0 and errors and not any("linear_cuda.cpp" in line for line in errors):
        pytest.skip("torch's headers need more than the stand-ins: " + errors[0])
    assert proc.returncode == 0, f"linear_cuda.cpp did not compile:\n{proc.stderr}"
