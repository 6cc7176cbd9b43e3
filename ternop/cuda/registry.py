"""The CUDA backends of ternop::linear and their ``can_implement`` answers.

Order (lower priority first): ``cuda_mma`` (CUDA C++ on tensor cores, M <= 16, fp16/bf16
x), ``cuda_gemv`` (CUDA C++ on CUDA cores, small M), ``dequant_cublas``
(large M: Triton dequantization, then cuBLAS), ``triton_gemm`` (tensor cores, every M),
``triton_gemv`` (CUDA cores, small M; last because the GEMM beat it at every measured M,
so it runs only when forced). Which M each one takes comes from the static
per-architecture table in ``ternop.cuda.configs``; the choice is made per call from the
real M, so one compiled graph serves every batch size.
"""

from __future__ import annotations

import os

import torch

from ternop import backends
from ternop.cuda import configs

_triton: dict[str, object] = {}

# The CUDA C++ kernels are instantiated for 1 <= M <= 8 (ternary_gemv.cu) and 1 <= M <= 16
# (ternary_mma.cu, fp16/bf16 x only, mma.sync m16n8k16 needs sm_80).
CUDA_GEMV_MAX_M = 8
CUDA_MMA_MAX_M = 16
CUDA_MMA_MIN_CAPABILITY = (8, 0)



def _forced(name: str) -> bool:
    return os.environ.get(backends.ENV_BACKEND) == name


def _triton_ops():
    """The triton_op module, imported on first use; (module or None, reason)."""
    if "mod" not in _triton:
        try:
            from ternop.cuda import triton_ops

            _triton["mod"], _triton["why"] = triton_ops, ""
        except Exception as exc:  # triton missing or too old
            _triton["mod"], _triton["why"] = None, f"triton unavailable: {type(exc).__name__}: {exc}"
    return _triton["mod"], _triton["why"]


def _common(x2: torch.Tensor, weight_packed: torch.Tensor) -> str:
    if x2.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"x dtype {x2.dtype} is not float16/bfloat16/float32"
    # The Triton kernels read weight_packed as int32 words.
    if weight_packed.data_ptr() % 4:
        return "weight_packed must be 4-byte aligned"
    if x2.shape[1] >= 1 << 31 or weight_packed.shape[0] >= 1 << 31:
        return "N and K must fit in int32"
    return ""


def _can_triton(name: str):
    def can_implement(x2, weight_packed, weight_scale, bias) -> tuple[bool, str]:
        mod, why = _triton_ops()
        if mod is None:
            return False, why
        why = _common(x2, weight_packed)
        if why:
            return False, why
        config, why = configs.lookup(name, x2.shape[0], x2.device, _forced(name))
        return config is not None, why

    return can_implement


def _can_dequant_cublas(x2, weight_packed, weight_scale, bias) -> tuple[bool, str]:
    ok, why = _can_triton("dequant_cublas")(x2, weight_packed, weight_scale, bias)
    if not ok:
        return ok, why
    if _forced("dequant_cublas"):
        return True, ""
    m, n = x2.shape[0], weight_packed.shape[0]
    floor = configs.min_m("dequant_cublas", x2.device)
    if m < floor:
        return False, f"M={m} is below M={floor}, where dequantizing first starts to pay"
    if configs.fused_beats_dequant(m, n, x2.device):
        return False, f"M={m}, N={n}: the fused GEMM is faster for a layer this wide at this M"
    return True, ""


def _run_dequant_cublas(x2, weight_packed, weight_scale, bias):
    config, _ = configs.lookup("dequant_cublas", x2.shape[0], x2.device, True)
    mod, _ = _triton_ops()
    return mod.linear_dequant_cublas(x2, weight_packed, weight_scale, bias, config.block_n, config.block_k)


def _run_triton_gemv(x2, weight_packed, weight_scale, bias):
    config, _ = configs.lookup("triton_gemv", x2.shape[0], x2.device, True)
    return torch.ops.ternop._linear_triton_gemv(
        x2, weight_packed, weight_scale, bias, config.block_n, config.block_k, config.num_warps, config.num_stages
    )


def _run_triton_gemm(x2, weight_packed, weight_scale, bias):
    config, _ = configs.lookup("triton_gemm", x2.shape[0], x2.device, True)
    return torch.ops.ternop._linear_triton_gemm(
        x2, weight_packed, weight_scale, bias,
        config.block_m, config.block_n, config.group_m, config.num_warps, config.num_stages,
    )


def _can_cuda_gemv(x2, weight_packed, weight_scale, bias) -> tuple[bool, str]:
    if x2.shape[0] > CUDA_GEMV_MAX_M:
        return False, f"M={x2.shape[0]} is above the kernel's M <= {CUDA_GEMV_MAX_M}"
    config, why = configs.lookup("cuda_gemv", x2.shape[0], x2.device, _forced("cuda_gemv"))
    if config is None:
        return False, why
    return _cuda_ext_ready(x2, weight_packed)


def _cuda_ext_ready(x2, weight_packed) -> tuple[bool, str]:
    """Checks shared by the C++ kernels: common layout, 16-byte alignment, extension built."""
    why = _common(x2, weight_packed)
    if why:
        return False, why
    # 16-byte vector loads; x can be a view at an odd offset (e.g. a slice of a fused output).
    if weight_packed.data_ptr() % 16 or x2.data_ptr() % 16:
        return False, "x and weight_packed must be 16-byte aligned"
    from ternop.cuda import cuda_ext

    ok, why = cuda_ext.load()
    return ok, why if ok else f"extension not built: {why}"


def _run_cuda_gemv(x2, weight_packed, weight_scale, bias):
    return torch.ops.ternop.linear_cuda(x2, weight_packed, weight_scale, bias)


def _can_cuda_mma(x2, weight_packed, weight_scale, bias) -> tuple[bool, str]:
    if x2.dtype not in (torch.float16, torch.bfloat16):
        return False, f"x dtype {x2.dtype} is not float16/bfloat16 (the tensor-core kernel has no fp32 path)"
    if x2.shape[0] > CUDA_MMA_MAX_M:
        return False, f"M={x2.shape[0]} is above the kernel's M <= {CUDA_MMA_MAX_M}"
    config, why = configs.lookup("cuda_mma", x2.shape[0], x2.device, _forced("cuda_mma"))
    if config is None:
        return False, why
    capability = configs.device_capability(x2.device)
    if capability < CUDA_MMA_MIN_CAPABILITY:
        return False, f"mma.sync m16n8k16 needs sm_80 or newer, this GPU is sm_{capability[0]}{capability[1]}"
    return _cuda_ext_ready(x2, weight_packed)


def _run_cuda_mma(x2, weight_packed, weight_scale, bias):
    return torch.ops.ternop.linear_cuda_mma(x2, weight_packed, weight_scale, bias)


BACKENDS = (
    backends.Backend("cuda_mma", "cuda", 5, _can_cuda_mma, _run_cuda_mma),
    backends.Backend("cuda_gemv", "cuda", 10, _can_cuda_gemv, _run_cuda_gemv),
    backends.Backend("triton_gemv", "cuda", 40, _can_triton("triton_gemv"), _run_triton_gemv),
    backends.Backend("dequant_cublas", "cuda", 25, _can_dequant_cublas, _run_dequant_cublas),
    backends.Backend("triton_gemm", "cuda", 30, _can_triton("triton_gemm"), _run_triton_gemm),
)


def register_all() -> None:
    for backend in BACKENDS:
        backends.register(backend)
