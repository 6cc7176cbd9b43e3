"""The CUDA backends of ternop::linear and their ``can_implement`` answers.

Order (lower priority first):

| backend | what | activations | layouts |
|---|---|---|---|
| ``cuda_mma_a8_fused`` | CUDA C++ ``mma.sync`` s8, quantizing x inside the kernel, M <= 2 | int8 (any float x) | a8 |
| ``cuda_mma`` | CUDA C++ ``mma.sync``, M <= 16 (M = 9..16 of the widest layers go to ``cuda_wgmma``); on Hopper, on the small layers, token slabs from M = 9 up to M = 64 (``configs.mma_slab``) | fp16/bf16 | v1, a16 (slabs: a16) |
| ``cuda_mma_a8`` | CUDA C++ ``mma.sync`` s8 (+ per-token quantization), M <= 16 (32 on Hopper, 64 there with row scales, less ``configs.mma_a8_declines``); on Hopper with row scales, on the small layers, token slabs from M = 9 up to M = 128 (``configs.mma_a8_slab``) | int8 (any float x) | a8 |
| ``cuda_wgmma`` | CUDA C++ Hopper ``wgmma`` (sm_90a), weights decoded in registers, M from its floor up (where ``configs.wgmma_declines`` finds it faster, and above ``configs.GRAPH_MAX_M`` up to ``configs.EAGER_A16_MAX_MNK``) | fp16/bf16 | a16 |
| ``cuda_mma_tiles`` | CUDA C++ ``mma.sync``, x and codes staged in shared memory, mid M | fp16/bf16 | a16 |
| ``cuda_dequant_a8`` | C++ decoding to a dense int8 weight (``ternop::decode_int8_cuda``), then ``dequant_a8``'s int8 Triton GEMM; wherever ``dequant_a8``'s rules let it run, one Python launch fewer | int8 (any float x) | all |
| ``dequant_a8`` | Triton decoding to a dense int8 weight, then a dense int8 Triton GEMM; row scales, M from its floor up where M * N * K exceeds ``configs.EAGER_A8_ROW_MAX_MNK``; where the C++ extension does not build | int8 (any float x) | all |
| ``cuda_wgmma_a8`` | CUDA C++ Hopper ``wgmma`` s8 (sm_90a) (+ per-token quantization); row scales where ``configs.wgmma_a8_row_declines`` finds it faster than ``triton_a8`` (K >= 4096 from M = 17 or 65, and at 129..2047 where its CTAs leave no last wave under 80% full or K >= 8192; smaller K at M = 129..256, and N <= 1024 at M = 129..2047; wherever its shared-memory tile runs, from M = 512, where ``dequant_a8`` declines too) and ``dequant_a8`` declines, every row-scaled call above ``configs.GRAPH_MAX_M`` up to ``configs.EAGER_A8_ROW_MAX_MNK``, or when forced | int8 (any float x) | a8 |
| ``cuda_gemv`` | CUDA C++ on CUDA cores, small M | fp16/bf16/fp32 | v1 |
| ``triton_a8`` | fused int8 Triton GEMM (+ per-token quantization), every M | int8 (any float x) | all |
| ``cuda_dequant`` | CUDA C++ dequantization, then cuBLAS, in one C++ op; M from its floor up | fp16/bf16/fp32 | all |
| ``dequant_cublas`` | Triton dequantization, then cuBLAS; M from its floor up | fp16/bf16/fp32 | all |
| ``triton_a16`` | fused Triton GEMM, every M above cuda_mma's | fp16/bf16 | all |
| ``triton_gemm`` / ``triton_gemv`` | the first Triton kernels | fp16/bf16/fp32 | v1 |
| ``dequant_any`` | dequantize-then-cuBLAS for what nothing else takes (fp32 x in a kernel layout) | any | all |

Which M each one takes comes from the static per-architecture table in
``ternop.cuda.configs``; the choice is made per call from the real M, so one compiled graph
serves every batch size. The table ranks GPU time under CUDA graphs; a call above the M that
vLLM captures (``configs.GRAPH_MAX_M``) also pays its host time, and where its product is small
(``configs.EAGER_A8_ROW_MAX_MNK`` for row-scaled int8, ``configs.EAGER_A16_MAX_MNK`` for 16-bit
activations) goes to the one C++ launch of ``cuda_wgmma_a8`` or ``cuda_wgmma``.

Activations of 8 bits only ever run on ``cuda_mma_a8_fused``, ``cuda_mma_a8``, ``dequant_a8``,
``cuda_dequant_a8``, ``cuda_wgmma_a8`` or ``triton_a8``, which compute the same thing: no backend
falls back to another numeric path.

Why it is long: one ``can_implement`` a backend, sixteen of them, each with the checks of its
own kernel (M range, layout, dtype, alignment, GPU, build); kept in one file so that the
priority order above and the answers that follow it are read together.
"""

from __future__ import annotations

import os

import torch

from ternop import backends
from ternop.cuda import configs
from ternop.layouts import LAYOUT_CODES

_modules: dict[str, tuple[object, str]] = {}

# The CUDA C++ kernels are instantiated for 1 <= M <= 8 (ternary_gemv.cu), 1 <= M <= 16
# (ternary_mma.cu, fp16/bf16 x only) and 1 <= M <= 32, or 64 with row scales (ternary_mma_a8.cu);
# mma.sync m16n8k16 and m16n8k32 s8 need sm_80.
CUDA_GEMV_MAX_M = 8
CUDA_MMA_MAX_M = 16
CUDA_MMA_A8_MAX_M = 32
CUDA_MMA_A8_ROW_MAX_M = 64
# The fused quantization of ternary_mma_a8.cu keeps x's int8 rows in shared memory.
CUDA_MMA_A8_FUSED_MAX_M = 2
CUDA_MMA_A8_FUSED_MAX_BYTES = 40 * 1024
# It takes every layer at M <= 2. Up to e371303 it stopped at M * N * K = 2^25: each CTA re-reads
# x, and with the rule's many CTAs that cost more than the quantization launch it saves on the
# wide layers (bench_linear on the H200 at c4e4123: 0.6-3 us slower from 4096 -> 14336). Since
# 921b5bc its CTAs take four sets of 16 rows (ternary_mma_a8.cu, kFusedMaxSets), and in
# sweep_mma_a8_fused_cap_921b5bc.json it ran 2.87x and 3.95x of cuBLAS bf16 at M = 1 on
# 4096 -> 14336 and 28672, where the separate launch and the kernel given quantized rows took
# about 2 us more a layer (the Triton quantization launch: 2.06 us a call in vLLM's batch-1
# decode profile, bench_vllm_decode_a8row_e371303.json).
TENSOR_CORE_MIN_CAPABILITY = (8, 0)
# wgmma runs on sm_90a cubins, which only compute capability 9.0 loads.
WGMMA_CAPABILITY = (9, 0)
FLOAT16 = (torch.float16, torch.bfloat16)


def _forced(name: str) -> bool:
    return os.environ.get(backends.ENV_BACKEND) == name


def _module(name: str):
    """(module or None, reason): the Triton modules are imported on first use."""
    if name not in _modules:
        try:
            if name == "launch_triton":
                from ternop.cuda import launch_triton as mod
            elif name == "launch_dequant_a8":
                from ternop.cuda import launch_dequant_a8 as mod
            else:
                from ternop.cuda import launch_fused as mod
            _modules[name] = (mod, "")
        except Exception as exc:  # triton missing or too old
            _modules[name] = (None, f"triton unavailable: {type(exc).__name__}: {exc}")
    return _modules[name]


def _common(call: backends.LinearCall) -> str:
    if call.quantized:  # ternop::linear_q8: int8 rows; the output dtype was checked by the op
        if call.x.dtype != torch.int8:
            return f"quantized x must be int8, got {call.x.dtype}"
    elif call.x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"x dtype {call.x.dtype} is not float16/bfloat16/float32"
    # The Triton kernels read weight_packed as int32 words.
    if call.weight_packed.data_ptr() % 4:
        return "weight_packed must be 4-byte aligned"
    if call.k >= 1 << 31 or call.n >= 1 << 31:
        return "N and K must fit in int32"
    return ""


def _tensor_cores(call: backends.LinearCall, what: str) -> str:
    capability = configs.device_capability(call.x.device)
    if capability < TENSOR_CORE_MIN_CAPABILITY:
        return f"{what} needs sm_80 or newer, this GPU is sm_{capability[0]}{capability[1]}"
    return ""


def _a16_only(call: backends.LinearCall) -> str:
    if call.activation_bits != 16:
        return f"activation_bits={call.activation_bits}: this backend runs 16-bit activations only"
    return ""


def _a8_only(call: backends.LinearCall) -> str:
    if call.activation_bits != 8:
        return f"activation_bits={call.activation_bits}: this backend runs 8-bit activations"
    return ""


def _v1_only(call: backends.LinearCall) -> str:
    if call.layout != "v1":
        return f"layout {call.layout!r}: this backend reads format v1 only"
    return ""


# --- the fused Triton kernels -----------------------------------------------------------------


def _can_fused(name: str, bits: int):
    def can_implement(call: backends.LinearCall) -> tuple[bool, str]:
        if call.activation_bits != bits:
            return False, f"activation_bits={call.activation_bits}: this backend runs {bits}-bit activations"
        if bits == 16 and call.x.dtype not in FLOAT16:
            return False, f"x dtype {call.x.dtype} is not float16/bfloat16"
        why = _common(call) or _tensor_cores(call, "int8 tensor cores" if bits == 8 else "the fused GEMM")
        if why:
            return False, why
        mod, why = _module("launch_fused")
        if mod is None:
            return False, why
        config, why = configs.lookup(name, call.m, call.x.device, _forced(name))
        return config is not None, why

    return can_implement


def _run_triton_a16(call: backends.LinearCall) -> torch.Tensor:
    config, _ = configs.lookup("triton_a16", call.m, call.x.device, True)
    mod, _ = _module("launch_fused")
    return mod.linear_a16(call.x, call.weight_packed, call.weight_scale, call.bias, call.layout, config)


def _run_triton_a8(call: backends.LinearCall) -> torch.Tensor:
    config, _ = configs.lookup("triton_a8", call.m, call.x.device, True)
    mod, _ = _module("launch_fused")
    q, qs = _rows(call)
    return mod.linear_a8_quantized(q, qs, call.weight_packed, call.weight_scale, call.bias, call.layout, config,
                                   call.dtype, after_quantize_rows=not call.quantized)  # fmt: skip


# --- dequantize, then cuBLAS --------------------------------------------------------------------


def _can_dequant_any(call: backends.LinearCall) -> tuple[bool, str]:
    why = _a16_only(call) or _common(call)
    if why:
        return False, why
    mod, why = _module("launch_triton")
    return (mod is not None), why


def _below_floor(name: str, call: backends.LinearCall, where: str = "where dequantizing first starts to pay") -> str:
    """Why a backend declines an M under its floor (configs.MIN_M; unless forced), else ""."""
    floor = configs.min_m(name, call.x.device)
    if call.m < floor and not _forced(name):
        return f"M={call.m} is below M={floor}, {where}"
    return ""


def _can_dequant_cublas(call: backends.LinearCall) -> tuple[bool, str]:
    ok, why = _can_dequant_any(call)
    if not ok:
        return ok, why
    why = _below_floor("dequant_cublas", call)
    return not why, why


def _can_cuda_dequant(call: backends.LinearCall) -> tuple[bool, str]:
    why = _a16_only(call) or _common(call) or _below_floor("cuda_dequant", call)
    if why:
        return False, why
    # 16-byte code loads; the C++ op takes the weights as stored by a layer (contiguous).
    if call.weight_packed.data_ptr() % 16 or not call.weight_packed.is_contiguous():
        return False, "weight_packed must be contiguous and 16-byte aligned"
    if not call.weight_scale.is_contiguous():
        return False, "weight_scale must be contiguous"
    from ternop.cuda import cuda_ext

    ok, why = cuda_ext.load()
    return ok, why if ok else f"extension not built: {why}"


def _run_cuda_dequant(call: backends.LinearCall) -> torch.Tensor:
    return torch.ops.ternop.linear_cuda_dequant(
        call.x, call.weight_packed, call.weight_scale, call.bias, LAYOUT_CODES[call.layout]
    )


def _run_dequant(call: backends.LinearCall) -> torch.Tensor:
    config, _ = configs.lookup("dequant_cublas", call.m, call.x.device, True)
    mod, _ = _module("launch_triton")
    return mod.linear_dequant_cublas(
        call.x, call.weight_packed, call.weight_scale, call.bias, call.layout, config.block_n, config.block_k
    )


def _a8_row_only(call: backends.LinearCall) -> str:
    """Why a dense int8 GEMM (one scale per row) cannot take the call, else ""."""
    if call.activation_bits != 8:
        return _a8_only(call)
    if not call.row_scales:
        return "block scales: the dense int8 GEMM runs one scale per row (weight_scale [N, 1]) only"
    return ""


def _dequant_a8_rules(call: backends.LinearCall) -> str:
    """Why dequant_a8's dense int8 GEMM should not take this call, else "": its M floor, its
    buckets of the static table, its tile-count rule, and where cuda_wgmma_a8 takes the call instead
    (its shared-memory tile; above the graphs' M, the eager rule of configs.EAGER_A8_ROW_MAX_MNK); all
    but what the kernel cannot run are lifted when dequant_a8 is forced. cuda_dequant_a8 runs the same
    GEMM, so it obeys the same rules."""
    why = (_common(call) or _below_floor("dequant_a8", call)
           or _mma_bucket("dequant_a8", call, "int8 tensor cores"))  # fmt: skip
    if why or _forced("dequant_a8"):
        return why
    why = configs.dequant_a8_declines(call.m, call.n, call.x.device)
    if why:
        return why
    # Where cuda_wgmma_a8 is the better choice, it takes the call if it can run here: with its
    # shared-memory tile (configs.wgmma_a8_smem_takes), and above the graphs' M, where its one C++
    # launch costs less host time (configs.EAGER_A8_ROW_MAX_MNK).
    if configs.wgmma_a8_smem_takes(call.m, call.n, call.k, call.x.device):
        why = (f"M={call.m}, N={call.n}, K={call.k}: cuda_wgmma_a8's tile that decodes the weights into "
               f"shared memory is faster than the dense int8 GEMM (configs.wgmma_a8_smem_takes)")
    elif configs.eager_a8_row_host_bound(call.m, call.n, call.k):
        why = (f"M={call.m}, N={call.n}, K={call.k} runs outside CUDA graphs: cuda_wgmma_a8's one "
               f"launch from C++ costs less host time than the dense int8 path's Triton launches "
               f"(configs.EAGER_A8_ROW_MAX_MNK)")
    if why and "cuda_wgmma_a8" not in backends.skipped() and _can_cuda_wgmma_a8(call)[0]:
        return why
    return ""


def _can_dequant_a8(call: backends.LinearCall) -> tuple[bool, str]:
    why = _a8_row_only(call) or _dequant_a8_rules(call)
    if why:
        return False, why
    mod, why = _module("launch_dequant_a8")
    return (mod is not None), why


def _dense_int8(decode):
    """The run of a backend that decodes the codes to a dense int8 weight with ``decode(mod, call)``
    and then runs dequant_a8's int8 GEMM (``launch_dequant_a8.int8_gemm``)."""

    def run(call: backends.LinearCall) -> torch.Tensor:
        config, _ = configs.lookup("dequant_a8", call.m, call.x.device, True)
        mod, _ = _module("launch_dequant_a8")
        q, qs = _rows(call)
        return mod.int8_gemm(q, qs, decode(mod, call), call.weight_scale, call.bias, config, call.dtype)

    return run


_run_dequant_a8 = _dense_int8(lambda mod, call: mod.decode_int8(call.weight_packed, call.layout))


# dequant_a8's decode costs a Triton launch, 32-38 us of host time a call on the H200 at M = 16384
# (results/h200/probe_host_call_a8_24815a1.json), where its calls run outside CUDA graphs and the
# int8 embedder's step waits on the host. cuda_dequant_a8 launches the same decode from C++
# (ternop::decode_int8_cuda) and then the same GEMM: the same result, one Python launch fewer.
# Timed side by side on the H200 (results/h200/probe_host_call_a8_3070b64.json, the 0.6B layers at
# M = 8192 and 16384, where the GPU time exceeds the host time): 13-16 us less host time a call,
# and GPU time from 5% less to 2% more. So it goes first wherever dequant_a8 would run, and
# dequant_a8 remains for a machine whose C++ extension does not build.


def _can_cuda_dequant_a8(call: backends.LinearCall) -> tuple[bool, str]:
    why = _a8_row_only(call) or _common(call) or _tensor_cores(call, "int8 tensor cores")
    if why:
        return False, why
    if call.weight_packed.data_ptr() % 16:
        return False, "weight_packed must be 16-byte aligned"
    if not _forced("cuda_dequant_a8"):  # before the build: a backend that will not run builds nothing
        why = _dequant_a8_rules(call)
        if why:
            return False, f"{why} (dequant_a8's rules: the same GEMM)"
    from ternop.cuda import cuda_ext

    ok, why = cuda_ext.load()
    if not ok:
        return False, f"extension not built: {why}"
    mod, why = _module("launch_dequant_a8")
    return (mod is not None), why


_run_cuda_dequant_a8 = _dense_int8(
    lambda mod, call: torch.ops.ternop.decode_int8_cuda(call.weight_packed, LAYOUT_CODES[call.layout])
)


# --- the first Triton kernels (format v1) -------------------------------------------------------


def _can_triton_v1(name: str):
    def can_implement(call: backends.LinearCall) -> tuple[bool, str]:
        why = _a16_only(call) or _v1_only(call) or _common(call)
        if why:
            return False, why
        mod, why = _module("launch_triton")
        if mod is None:
            return False, why
        config, why = configs.lookup(name, call.m, call.x.device, _forced(name))
        return config is not None, why

    return can_implement


def _run_triton_gemv(call: backends.LinearCall) -> torch.Tensor:
    config, _ = configs.lookup("triton_gemv", call.m, call.x.device, True)
    mod, _ = _module("launch_triton")
    return mod.launch_gemv(
        mod.ternary_gemv_kernel, call.x, call.weight_packed, call.weight_scale, call.bias,
        config.block_n, config.block_k, config.num_warps, config.num_stages,
    )


def _run_triton_gemm(call: backends.LinearCall) -> torch.Tensor:
    config, _ = configs.lookup("triton_gemm", call.m, call.x.device, True)
    mod, _ = _module("launch_triton")
    return mod.launch_gemm(
        mod.ternary_gemm_kernel, call.x, call.weight_packed, call.weight_scale, call.bias,
        config.block_m, config.block_n, config.group_m, config.num_warps, config.num_stages,
    )


# --- the CUDA C++ kernels ---------------------------------------------------------------------


def _cuda_ext_ready(call: backends.LinearCall, layouts: tuple[str, ...] = ("v1",)) -> tuple[bool, str]:
    """Checks shared by the C++ kernels: the layout, 16-byte alignment, extension built."""
    if call.layout not in layouts:
        return False, f"layout {call.layout!r}: this backend reads {' and '.join(layouts)} only"
    why = _common(call)
    if why:
        return False, why
    # 16-byte vector loads; x can be a view at an odd offset (e.g. a slice of a fused output).
    if call.weight_packed.data_ptr() % 16 or call.x.data_ptr() % 16 or call.x.stride(0) % 8:
        return False, "x (rows included) and weight_packed must be 16-byte aligned"
    from ternop.cuda import cuda_ext

    ok, why = cuda_ext.load()
    return ok, why if ok else f"extension not built: {why}"


def _can_cuda_gemv(call: backends.LinearCall) -> tuple[bool, str]:
    why = _a16_only(call)
    if why:
        return False, why
    if call.m > CUDA_GEMV_MAX_M:
        return False, f"M={call.m} is above the kernel's M <= {CUDA_GEMV_MAX_M}"
    config, why = configs.lookup("cuda_gemv", call.m, call.x.device, _forced("cuda_gemv"))
    if config is None:
        return False, why
    return _cuda_ext_ready(call)


def _mma_bucket(name: str, call: backends.LinearCall, instruction: str) -> str:
    """The checks every tensor-core C++ backend shares after its own: a bucket of the static
    table for this M, and a GPU with ``instruction``. "" when both hold."""
    config, why = configs.lookup(name, call.m, call.x.device, _forced(name))
    if config is None:
        return why
    return _tensor_cores(call, instruction)


def _half_x(call: backends.LinearCall) -> str:
    """Why a 16-bit tensor-core kernel declines the call's activations, else ""."""
    why = _a16_only(call)
    if not why and call.x.dtype not in FLOAT16:
        why = f"x dtype {call.x.dtype} is not float16/bfloat16 (the tensor-core kernels have no fp32 path)"
    return why


def _cuda_mma_slab(call: backends.LinearCall) -> int:
    """The tokens a CTA of cuda_mma takes for this call: the slab of configs.mma_slab (a16 weights), else
    0 (one CTA column over all of M, M <= CUDA_MMA_MAX_M); forced past that M on a16 weights, 16."""
    if call.layout != "a16":
        return 0
    slab = configs.mma_slab(call.m, call.n, call.k, call.x.device)
    return slab or (16 if call.m > CUDA_MMA_MAX_M and _forced("cuda_mma") else 0)


def _can_cuda_mma(call: backends.LinearCall) -> tuple[bool, str]:
    why = _half_x(call)
    if why:
        return False, why
    if call.m > CUDA_MMA_MAX_M and not _cuda_mma_slab(call):
        return False, (f"M={call.m} is above the kernel's M <= {CUDA_MMA_MAX_M}, and no token slabs were "
                       f"measured faster on this layer (N={call.n}, K={call.k}, layout {call.layout}; "
                       f"configs.mma_slab)")
    why = _mma_bucket("cuda_mma", call, "mma.sync m16n8k16")
    if why:
        return False, why
    if _wgmma_takes_wide(call):
        return False, (f"M={call.m}: cuda_wgmma is faster on this wide layer (N={call.n}, K={call.k}; "
                       f"configs.wgmma_wide_layer)")
    return _cuda_ext_ready(call, ("v1", "a16"))


def _wgmma_takes_wide(call: backends.LinearCall) -> bool:
    """Whether cuda_wgmma, after cuda_mma in priority, takes this M = 9..16 call on a wide layer."""
    if _forced("cuda_mma") or not configs.WGMMA_WIDE_MIN_M <= call.m <= configs.WGMMA_WIDE_MAX_M:
        return False
    if not configs.wgmma_wide_layer(call.n, call.k):
        return False
    if "cuda_wgmma" in backends.skipped():
        return False
    return _can_cuda_wgmma(call)[0]


def _mma_a8_column_max_m(row_scales: bool) -> int:
    """The largest M one CTA column of cuda_mma_a8 takes: four token tiles, eight with row scales."""
    return CUDA_MMA_A8_ROW_MAX_M if row_scales else CUDA_MMA_A8_MAX_M


def _cuda_mma_a8_launch(call: backends.LinearCall) -> tuple[int, int]:
    """(slab, sets of 16 rows a CTA) of cuda_mma_a8 for this call: configs.mma_a8_launch's, else a slab
    of 0 (one CTA column over all of M); forced past the one-column kernels' M, a slab of 16."""
    row_scales = call.row_scales
    slab, sets = configs.mma_a8_launch(call.m, call.n, call.k, row_scales, call.x.device)
    if not slab and call.m > _mma_a8_column_max_m(row_scales) and _forced("cuda_mma_a8"):
        slab = 16  # M is tested first: the environment is read only past the one-column kernels' M
    return slab, sets


def _cuda_mma_a8_slab(call: backends.LinearCall) -> int:
    """The tokens a CTA of cuda_mma_a8 takes for this call (_cuda_mma_a8_launch)."""
    return _cuda_mma_a8_launch(call)[0]


def _can_cuda_mma_a8(call: backends.LinearCall) -> tuple[bool, str]:
    why = _a8_only(call)
    if why:
        return False, why
    row_scales = call.row_scales
    max_m = _mma_a8_column_max_m(row_scales)
    slab = _cuda_mma_a8_slab(call)
    if call.m > max_m and not slab:
        scales = "row" if row_scales else "block"
        return False, (f"M={call.m} is above the kernel's M <= {max_m} with {scales} scales, and no token "
                       f"slabs were measured faster on this layer (N={call.n}, K={call.k}; configs.mma_a8_slab)")
    why = _mma_bucket("cuda_mma_a8", call, "mma.sync m16n8k32 s8")
    if why:
        return False, why
    if not _forced("cuda_mma_a8") and not slab:
        why = configs.mma_a8_declines(call.m, call.n, call.k, row_scales)
        if why:
            return False, why
    mod, why = _module("launch_fused")  # the per-token quantization runs in Triton
    if mod is None:
        return False, why
    return _cuda_ext_ready(call, ("a8",))


def _can_cuda_mma_a8_fused(call: backends.LinearCall) -> tuple[bool, str]:
    why = _a8_only(call)
    if why:
        return False, why
    if call.m > CUDA_MMA_A8_FUSED_MAX_M or call.m * call.k > CUDA_MMA_A8_FUSED_MAX_BYTES:
        return False, (f"M={call.m}, K={call.k}: the fused quantization takes M <= {CUDA_MMA_A8_FUSED_MAX_M} "
                       f"and M * K <= {CUDA_MMA_A8_FUSED_MAX_BYTES}")  # fmt: skip
    if call.quantized:
        return False, "x arrives quantized (ternop::linear_q8); this kernel quantizes x itself"
    why = "" if _forced("cuda_mma_a8_fused") else configs.a8_fused_declines(call.n, call.k, call.x.device)
    if why:
        return False, why
    why = _mma_bucket("cuda_mma_a8_fused", call, "mma.sync m16n8k32 s8")
    if why:
        return False, why
    return _cuda_ext_ready(call, ("a8",))


def _can_cuda_mma_tiles(call: backends.LinearCall) -> tuple[bool, str]:
    why = (_half_x(call) or _below_floor("cuda_mma_tiles", call, "where cuda_mma is faster")
           or _mma_bucket("cuda_mma_tiles", call, "mma.sync m16n8k16 and cp.async"))  # fmt: skip
    if why:
        return False, why
    return _cuda_ext_ready(call, ("a16",))


def _can_cuda_wgmma(call: backends.LinearCall) -> tuple[bool, str]:
    why = (_half_x(call) or _below_floor("cuda_wgmma", call, "where the mma.sync kernels are faster")
           or _mma_bucket("cuda_wgmma", call, "wgmma"))  # fmt: skip
    if why:
        return False, why
    # Under vLLM's CUDA graphs the measured table decides (configs.wgmma_declines); above them, where the
    # dequantizing paths' host time costs more than its kernel, it takes the call (configs.EAGER_A16_MAX_MNK).
    eager = configs.eager_a16_host_bound(call.m, call.n, call.k)
    why = "" if _forced("cuda_wgmma") or eager else configs.wgmma_declines(call.m, call.n, call.k)
    if why:
        return False, why
    ok, why = _cuda_ext_ready(call, ("a16",))
    if not ok:
        return ok, why
    why = _hopper_wgmma(call)
    return not why, why


WGMMA_A8_OFF = "cuda_wgmma_a8 is not faster than triton_a8 on most shapes (results/h200/sweep_wgmma_a8.json)"


def _hopper_wgmma(call: backends.LinearCall) -> str:
    """Why a wgmma backend cannot run here (GPU, build), else ""."""
    capability = configs.device_capability(call.x.device)
    if capability != WGMMA_CAPABILITY:
        return f"wgmma needs sm_90a (compute capability 9.0), this GPU is sm_{capability[0]}{capability[1]}"
    from ternop.cuda import cuda_ext

    if not cuda_ext.wgmma_built():
        return "the extension was built without sm_90a (TORCH_CUDA_ARCH_LIST lacks 9.0a)"
    return ""


def _can_cuda_wgmma_a8(call: backends.LinearCall) -> tuple[bool, str]:
    why = _a8_only(call)
    if why:
        return False, why
    why = (_below_floor("cuda_wgmma_a8", call, "where the mma.sync kernels are faster")
           or _mma_bucket("cuda_wgmma_a8", call, "wgmma"))  # fmt: skip
    if why:
        return False, why
    mod, why = _module("launch_fused")  # the per-token quantization runs in Triton
    if mod is None:
        return False, why
    ok, why = _cuda_ext_ready(call, ("a8",))
    if not ok:
        return ok, why
    why = _hopper_wgmma(call)
    if not why and not _forced("cuda_wgmma_a8") and call.row_scales:
        # Row scales: where it ran faster than triton_a8 under CUDA graphs (configs.wgmma_a8_row_declines
        # cites the runs; dequant_a8 goes first from M = 2048 and takes most of the calls there); above
        # the graphs' M, every call whose kernel costs less than those paths' host time
        # (configs.EAGER_A8_ROW_MAX_MNK).
        if not configs.eager_a8_row_host_bound(call.m, call.n, call.k):
            why = configs.wgmma_a8_row_declines(call.m, call.n, call.k, call.x.device)
    elif not why and not _forced("cuda_wgmma_a8"):
        # results/h200/sweep_wgmma_a8.json (8bbb40a): 0.55-0.62x of cuBLAS bf16 at M >= 2048 on
        # the 0.6B layers and 0.76-0.90x on the 8B ones, where bench_linear.json's triton_a8 (576215d) runs
        # 0.62-0.77x and 0.74-0.87x; ahead only on the widest 8B layers at M = 64..128, by margins
        # no same-run comparison has confirmed. Kept for the int8 Hopper work (docs/KERNELS.md).
        why = f"{WGMMA_A8_OFF}; it runs only when forced ({backends.ENV_BACKEND}=cuda_wgmma_a8)"
    return not why, why


def _bias(call: backends.LinearCall) -> torch.Tensor | None:
    """The bias as the C++ ops take it (contiguous), or None."""
    return call.bias.contiguous() if call.bias is not None else None


def _contiguous(call: backends.LinearCall):
    return call.x.contiguous(), call.weight_packed, call.weight_scale, _bias(call)


def _rows(call: backends.LinearCall) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [M, K], s_x fp32 [M]): as the call brings them (ternop::linear_q8), or x
    quantized per token by the Triton kernel."""
    if call.quantized:
        return call.x.contiguous(), call.x_scale
    mod, _ = _module("launch_fused")
    return mod.quantize_rows(call.x)


def _quantized(call: backends.LinearCall):
    """The arguments of the C++ W2A8 ops but the output dtype."""
    return *_rows(call), call.weight_packed, call.weight_scale, _bias(call)


def _run_cuda_wgmma_a8(call: backends.LinearCall) -> torch.Tensor:
    return torch.ops.ternop.linear_cuda_wgmma_a8(*_quantized(call), call.dtype)


def _run_cuda_wgmma(call: backends.LinearCall) -> torch.Tensor:
    return torch.ops.ternop.linear_cuda_wgmma(call.x, call.weight_packed, call.weight_scale, _bias(call))


def _run_cuda_mma_tiles(call: backends.LinearCall) -> torch.Tensor:
    # Takes x's row stride as it is (_cuda_ext_ready checked its alignment).
    return torch.ops.ternop.linear_cuda_mma_tiles(call.x, call.weight_packed, call.weight_scale, _bias(call))


def _run_cuda_gemv(call: backends.LinearCall) -> torch.Tensor:
    return torch.ops.ternop.linear_cuda(*_contiguous(call))


def _run_cuda_mma(call: backends.LinearCall) -> torch.Tensor:
    return torch.ops.ternop.linear_cuda_mma(*_contiguous(call), call.layout == "a16", slab=_cuda_mma_slab(call))


def _run_cuda_mma_a8(call: backends.LinearCall) -> torch.Tensor:
    slab, row_groups = _cuda_mma_a8_launch(call)  # the rules set the sets of rows a CTA only in slabs
    return torch.ops.ternop.linear_cuda_mma_a8(*_quantized(call), call.dtype, row_groups=row_groups, slab=slab)


def _run_cuda_mma_a8_fused(call: backends.LinearCall) -> torch.Tensor:
    return torch.ops.ternop.linear_cuda_mma_a8_fused(*_contiguous(call))


# --- variants: which compiled kernels a call runs (backends.Backend.variant) ---------------------
#
# The C++ kernels are built once for every M. A Triton kernel is compiled for each set of its
# compile-time constants, some of which follow M (the tile of M's bucket, the slices of K), and for
# each class of an integer argument's value: Triton specialises M = 1 and multiples of 16.


def _m_class(m: int) -> str:
    """The class of M that Triton compiles a kernel taking M as an argument for."""
    return "1" if m == 1 else "16n" if m % 16 == 0 else "any"


def _quant_variant(call: backends.LinearCall) -> tuple:
    """The per-token quantization kernel a call of the int8 backends runs first, if any."""
    if call.quantized:
        return ()
    mod, _ = _module("launch_fused")
    return ("quant_rows", mod.quant_block_k(call.m, call.k))


# The variant tag of the Triton int8 kernel started early; ternop.warmup also runs linear_q8, which
# launches the same kernel plainly, wherever a step carries it.
EARLY = "early"


def _triton_a8_early(call: backends.LinearCall) -> bool:
    """Whether triton_a8 would be launched early for this call: right after the quantization of its
    rows (never for rows quantized beforehand), where configs.triton_a8_starts_early says so. The
    launcher asks the same (launch_fused.linear_a8_quantized's after_quantize_rows)."""
    return not call.quantized and configs.triton_a8_starts_early(call.m, call.k, call.x.device)


def _triton_a8_start(call: backends.LinearCall) -> tuple:
    """The quantization before the Triton int8 kernel, and "early" where that kernel is launched
    early after it (a kernel of its own to Triton: ``WAIT_PRIOR``, ``launch_pdl``)."""
    quant = _quant_variant(call)
    return (*quant, EARLY) if _triton_a8_early(call) else quant


def _fused_variant(name: str):
    def variant(call: backends.LinearCall) -> tuple:
        config, _ = configs.lookup(name, call.m, call.x.device, True)
        mod, _ = _module("launch_fused")
        _, splits = mod.tiles_and_splits(call.m, call.n, call.k, config, call.x.device)
        return (config, splits, _m_class(call.m), *(_triton_a8_start(call) if name == "triton_a8" else ()))

    return variant


def _table_variant(name: str, takes_m: bool = True):
    """A Triton kernel launched with the config of M's bucket (and M itself where ``takes_m``)."""

    def variant(call: backends.LinearCall) -> tuple:
        config, _ = configs.lookup(name, call.m, call.x.device, True)
        return (config, _m_class(call.m)) if takes_m else (config,)

    return variant


def _dense_int8_variant(call: backends.LinearCall) -> tuple:
    return (_m_class(call.m), *_quant_variant(call))


BACKENDS = (
    backends.Backend("cuda_mma_a8_fused", "cuda", 4, _can_cuda_mma_a8_fused, _run_cuda_mma_a8_fused),
    backends.Backend("cuda_mma", "cuda", 5, _can_cuda_mma, _run_cuda_mma),
    backends.Backend("cuda_mma_a8", "cuda", 6, _can_cuda_mma_a8, _run_cuda_mma_a8, _quant_variant),
    backends.Backend("cuda_wgmma", "cuda", 7, _can_cuda_wgmma, _run_cuda_wgmma),
    backends.Backend("cuda_mma_tiles", "cuda", 8, _can_cuda_mma_tiles, _run_cuda_mma_tiles),
    backends.Backend("dequant_a8", "cuda", 8, _can_dequant_a8, _run_dequant_a8, _dense_int8_variant),
    backends.Backend("cuda_dequant_a8", "cuda", 8, _can_cuda_dequant_a8, _run_cuda_dequant_a8, _dense_int8_variant),
    backends.Backend("cuda_wgmma_a8", "cuda", 9, _can_cuda_wgmma_a8, _run_cuda_wgmma_a8, _quant_variant),
    backends.Backend("cuda_gemv", "cuda", 10, _can_cuda_gemv, _run_cuda_gemv),
    backends.Backend("triton_a8", "cuda", 15, _can_fused("triton_a8", 8), _run_triton_a8, _fused_variant("triton_a8")),
    backends.Backend("triton_a16", "cuda", 20, _can_fused("triton_a16", 16), _run_triton_a16,
                     _fused_variant("triton_a16")),  # fmt: skip
    backends.Backend("cuda_dequant", "cuda", 17, _can_cuda_dequant, _run_cuda_dequant),
    backends.Backend("dequant_cublas", "cuda", 18, _can_dequant_cublas, _run_dequant,
                     _table_variant("dequant_cublas", takes_m=False)),  # fmt: skip
    backends.Backend("triton_gemm", "cuda", 30, _can_triton_v1("triton_gemm"), _run_triton_gemm,
                     _table_variant("triton_gemm")),  # fmt: skip
    backends.Backend("triton_gemv", "cuda", 40, _can_triton_v1("triton_gemv"), _run_triton_gemv,
                     _table_variant("triton_gemv", takes_m=False)),  # fmt: skip
    backends.Backend("dequant_any", "cuda", 90, _can_dequant_any, _run_dequant,
                     _table_variant("dequant_cublas", takes_m=False)),  # fmt: skip
)


def register_all() -> None:
    for backend in BACKENDS:
        backends.register(backend)
