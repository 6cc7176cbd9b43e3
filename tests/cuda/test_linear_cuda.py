"""ternop.linear on CUDA: every backend against an fp64 oracle, opcheck, compile and CUDA graphs.

Skipped without a CUDA device. The oracle dequantizes on the GPU in fp64 (the numpy oracle
of tests/reference.py is too slow for 14336-wide layers); tests/test_ops.py already pins
``ternop.format.dequantize`` against that independent reading.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ternop
from ternop import backends, layouts
from tests.reference import linear_a8_fp64, random_packed, unpack_layout_values

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BACKENDS = ["cuda_mma", "cuda_mma_tiles", "cuda_wgmma", "cuda_gemv", "triton_a16", "cuda_dequant", "dequant_cublas", "triton_gemm",
            "triton_gemv", "dequant_any"]  # fmt: skip
SMALL_M = {"cuda_mma": 16, "cuda_gemv": 8, "triton_gemv": 4}
CPP_BACKENDS = ("cuda_mma", "cuda_gemv")
# Every backend that needs the C++ extension: where nvcc exists, a failed build is a failure.
EXT_BACKENDS = (*CPP_BACKENDS, "cuda_mma_tiles", "cuda_wgmma", "cuda_dequant", "cuda_mma_a8", "cuda_mma_a8_fused",
                "cuda_wgmma_a8", "cuda_dequant_a8")
# Which layouts each 16-bit backend reads (the others decline with a reason).
LAYOUTS_OF = {"cuda_mma": ("v1", "a16"), "cuda_mma_tiles": ("a16",), "cuda_wgmma": ("a16",), "cuda_gemv": ("v1",), "triton_gemm": ("v1",),
              "triton_gemv": ("v1",)}  # fmt: skip


def _layout_for(name):
    """The layout a forced backend is tested in: v1 where it reads v1, else its first layout."""
    readable = LAYOUTS_OF.get(name, layouts.LAYOUTS)
    return "v1" if "v1" in readable else readable[0]

# (M, K, N): every M, K and N of the issue appears, in a sample that runs in seconds.
SHAPES = [
    (1, 128, 128),
    (1, 4096, 1152),
    (1, 14336, 4096),
    (2, 384, 136),
    (2, 3072, 4096),
    (3, 1024, 1152),
    (3, 14336, 136),
    (4, 4096, 128),
    (8, 1024, 1152),
    (16, 3072, 4096),
    (17, 4096, 136),
    (127, 14336, 128),
    (128, 1024, 4096),
    (257, 384, 1152),
    (4097, 4096, 4096),
]


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.double().cpu(), ref.double().cpu()
    return float((y - ref).norm() / ref.norm())


def _weights(n: int, k: int, reserved: bool = False):
    g = torch.Generator().manual_seed(n * 100003 + k)
    packed, scale = random_packed(n, k, generator=g, reserved=reserved)
    return packed.cuda(), scale.cuda()


def _check(y, x, packed, scale, bias=None):
    """The 2x rule: error vs fp64 at most 2x that of F.linear on dequantized weights in x's dtype."""
    w64 = ternop.dequantize(packed, scale, torch.float64)
    ref = F.linear(x.double(), w64, None if bias is None else bias.double())
    baseline = F.linear(x, ternop.dequantize(packed, scale, x.dtype), bias)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], packed.shape[0])
    err, base = _rel_err(y, ref), _rel_err(baseline, ref)
    assert err <= 2 * base + 1e-6, f"rel err {err:.3g} > 2 x F.linear's {base:.3g}"


def _force(monkeypatch, name):
    if name is not None:
        monkeypatch.setenv(backends.ENV_BACKEND, name)


def _call(x, packed, scale, bias=None, bits=16, layout="v1"):
    return backends.LinearCall(x.reshape(-1, x.shape[-1]), packed, scale, bias, bits, layout)


def _skip_unless_wgmma(name="cuda_wgmma"):
    """Skips where the Hopper kernels cannot run: compute capability 9.0 and an sm_90a build."""
    from ternop.cuda import cuda_ext

    if torch.cuda.get_device_capability() != (9, 0) or not cuda_ext.wgmma_built():
        pytest.skip(f"{name} runs on compute capability 9.0 with an sm_90a build")


def _dense_a8() -> str:
    """The backend that runs dequant_a8's GEMM where its rules take a call: cuda_dequant_a8 (the
    decode from C++) when the extension builds, else dequant_a8 (the decode from Triton)."""
    from ternop.cuda import cuda_ext

    return "cuda_dequant_a8" if cuda_ext.load()[0] else "dequant_a8"


def _skip_unavailable(name, x, packed, scale, bits=16, layout="v1"):
    if name is None:
        return
    ternop.linear(x[:1], packed, scale, layout=layout)  # loads the CUDA backends
    backend = backends.get(name)
    ok, why = backend.can_implement(_call(x, packed, scale, None, bits, layout))
    if ok:
        return
    if "needs sm_80" in why or "wgmma needs sm_90a" in why or " configs for " in why:
        pytest.skip(why)  # an older GPU, or an architecture whose table lacks the backend
    if name not in EXT_BACKENDS:
        return
    if "extension not built" in why:
        _no_extension(why)


def _no_extension(why):
    """Skips where no nvcc could build the C++ extension; where one could, its failure fails the test."""
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        pytest.skip(why)
    pytest.fail(f"nvcc is present but the CUDA extension did not build: {why}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", [None, *BACKENDS])
@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_linear_cuda_numerics(monkeypatch, name, dtype, layout):
    if layout not in LAYOUTS_OF.get(name, layouts.LAYOUTS):
        pytest.skip(f"{name} reads v1 only")
    for m, k, n in SHAPES:
        if m > SMALL_M.get(name, 1 << 30):
            continue
        v1, scale = _weights(n, k)
        packed = layouts.repack(v1, layout)
        x = torch.randn(m, k, device="cuda").to(dtype)
        _skip_unavailable(name, x, packed, scale, layout=layout)
        _force(monkeypatch, name)
        _check(ternop.linear(x, packed, scale, layout=layout), x, v1, scale)
        monkeypatch.delenv(backends.ENV_BACKEND, raising=False)


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_linear_cuda_dequant_equals_dequantize_then_f_linear(monkeypatch, layout, dtype):
    """cuda_dequant writes exactly ternop.dequantize's weights (any layout, every dtype), so its
    result is bit for bit F.linear on them; strided rows of x and a strided bias included."""
    for m, k, n in [(1, 128, 64), (300, 1024, 520), (257, 14336, 136), (1000, 384, 1152)]:
        v1, scale = _weights(n, k, reserved=True)
        packed = layouts.repack(v1, layout)
        x = torch.randn(m, 2 * k, device="cuda").to(dtype)[:, :k]
        bias = torch.randn(2 * n, device="cuda").to(dtype)[::2]
        _skip_unavailable("cuda_dequant", x, packed, scale, layout=layout)
        _force(monkeypatch, "cuda_dequant")
        y = ternop.linear(x, packed, scale, bias, layout=layout)
        monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
        want = F.linear(x, ternop.dequantize(v1, scale, dtype), bias)
        assert torch.equal(y, want), (m, k, n, (y.float() - want.float()).abs().max())


def test_linear_cuda_dequant_floor_and_dispatch(monkeypatch):
    """Unforced, cuda_dequant takes M from its floor up and goes before the Triton dequantizer."""
    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    v1, scale = _weights(520, 1024)
    for m, want in ((16, False), (4096, True)):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        ternop.linear(x[:1], v1, scale)  # loads the CUDA backends
        _skip_unavailable("cuda_dequant", x, v1, scale)
        ok, why = backends.get("cuda_dequant").can_implement(_call(x, v1, scale))
        assert ok == want, why
        if want:
            assert backends.select(_call(x, v1, scale)).name == "cuda_dequant"


@pytest.mark.parametrize("name", ["cuda_mma", "cuda_gemv", "triton_gemm", "triton_gemv"])
def test_linear_cuda_v1_backends_decline_other_layouts(name):
    v1, scale = _weights(136, 512)
    x = torch.randn(2, 512, device="cuda", dtype=torch.float16)
    ternop.linear(x, v1, scale)  # loads the CUDA backends
    layout = "a8" if name == "cuda_mma" else "a16"
    ok, why = backends.get(name).can_implement(_call(x, layouts.repack(v1, layout), scale, layout=layout))
    assert not ok and f"layout {layout!r}" in why


# The tensor-core kernel: every M of both n8 tiles' edges, K giving 1, 2, 4 and 8 warps per
# CTA (and warps with no block: K = 2176 has 17 blocks over 8 warps), N not a multiple of 16.
MMA_SHAPES = [
    (1, 128, 128),
    (2, 384, 136),
    (3, 640, 1152),
    (5, 1024, 136),
    (8, 1152, 4096),
    (9, 2176, 136),
    (15, 4096, 1152),
    (16, 14336, 136),
    (16, 4096, 4096),
    (1, 14336, 4096),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_cuda_mma_shapes_with_bias(monkeypatch, dtype):
    for m, k, n in MMA_SHAPES:
        packed, scale = _weights(n, k)
        x = torch.randn(m, k, device="cuda").to(dtype)
        bias = torch.randn(n, device="cuda").to(dtype)
        _skip_unavailable("cuda_mma", x, packed, scale)
        _force(monkeypatch, "cuda_mma")
        y = ternop.linear(x, packed, scale, bias)
        _check(y, x, packed, scale, bias)
        assert torch.equal(y, torch.ops.ternop.linear_cuda_mma(x, packed, scale, bias))  # deterministic
        monkeypatch.delenv(backends.ENV_BACKEND, raising=False)


# The mid-M kernel: M at the edges of its three tiles (32, 64, 128 tokens) and past one tile,
# N not a multiple of its 64 rows, K from one scale block to 112 (split-K when the tiles are few:
# 1 -> 8 blocks, 1024 x 1024 at M = 40 splits K four ways).
TILES_SHAPES = [
    (17, 128, 136),
    (31, 384, 1152),
    (32, 1024, 1024),
    (33, 3072, 1024),
    (40, 1024, 1024),
    (64, 2176, 200),
    (65, 4096, 4096),
    (127, 14336, 136),
    (128, 1024, 3072),
    (129, 1024, 1152),
    (300, 4096, 1024),
    (1000, 1024, 4096),
]


# The split-K a16 kernels: backend -> (its op, how many tiles it has, extra shapes).
SPLIT_K_KERNELS = {
    "cuda_mma_tiles": ("linear_cuda_mma_tiles", 2, []),
    # Hopper: 128 or 256 rows x 8, 16, 32, 64, 128 or 256 tokens (the 64-, 16- and 8-token tiles with a
    # producer warp, tiles 1, 2 and 4 with a producer warpgroup that leaves before the epilogue);
    # ragged M and N past the TMA box. At M <= 64 the auto tile takes 256 rows where 128-row CTAs would
    # overflow one wave (N > 128 * SMs): 17000 rows. M <= 16 on a wide layer splits K for the small tiles'
    # two CTAs an SM.
    "cuda_wgmma": ("linear_cuda_wgmma", 8, [(65, 384, 136), (300, 14336, 1024), (700, 1024, 4096),
                                            (9, 256, 1032), (40, 1024, 17000), (1, 4096, 14336),
                                            (13, 2048, 4104)]),
}


@pytest.mark.parametrize("name", sorted(SPLIT_K_KERNELS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_cuda_split_k_kernels_shapes_with_bias_and_row_stride(monkeypatch, name, dtype):
    """Every tile of the kernel, whatever its auto choice picks; split-K, strided rows, a bias;
    deterministic, and the same for a strided and a contiguous x."""
    op_name, tiles, extra = SPLIT_K_KERNELS[name]
    for m, k, n in [*TILES_SHAPES, *extra]:
        v1, scale = _weights(n, k)
        packed = layouts.repack(v1, "a16")
        x = torch.randn(m, k + 64, device="cuda").to(dtype)[:, 32 : 32 + k]  # rows k + 64 apart
        bias = torch.randn(n, device="cuda").to(dtype)
        _skip_unavailable(name, x, packed, scale, layout="a16")  # also defines the C++ ops' schemas
        op = getattr(torch.ops.ternop, op_name)
        _force(monkeypatch, name)
        y = ternop.linear(x, packed, scale, bias, layout="a16")
        _check(y, x, v1, scale, bias)
        assert torch.equal(y, op(x, packed, scale, bias)), (m, k, n)  # deterministic, split-K included
        assert torch.equal(y, op(x.contiguous(), packed, scale, bias))
        for tile in range(tiles):
            _check(op(x, packed, scale, bias, tile), x, v1, scale, bias)
        monkeypatch.delenv(backends.ENV_BACKEND, raising=False)


def test_linear_cuda_wgmma_equals_f_linear_on_dequantized_weights_in_fp32_sums():
    """With integer x and power-of-two scales every product and partial sum is exact in fp32, so the
    kernel must equal F.linear on the dequantized weights in fp64, bit for bit once rounded: a wrong
    token, k, row, swizzle or descriptor step shows up as a mismatch, not as a tolerance."""
    for m, k, n, tile in [(65, 1024, 1152, 0), (128, 4096, 256, 1), (300, 512, 136, 2), (200, 1024, 520, 3),
                          (260, 2048, 640, 4), (100, 1024, 392, 5), (513, 2048, 520, -1), (16, 2048, 1032, 6),
                          (37, 1024, 392, 6), (1, 4096, 264, 7), (11, 1024, 136, 7)]:
        v1, _ = _weights(n, k)
        scale = (2.0 ** torch.randint(-3, 3, (n, k // 128))).to(torch.float16).cuda()
        packed = layouts.repack(v1, "a16")
        x = torch.randint(-8, 9, (m, k), device="cuda").to(torch.bfloat16)
        _skip_unavailable("cuda_wgmma", x, packed, scale, layout="a16")
        y = torch.ops.ternop.linear_cuda_wgmma(x, packed, scale, None, tile)
        want = F.linear(x.double(), ternop.dequantize(v1, scale, torch.float64)).to(torch.bfloat16)
        assert torch.equal(y, want), (m, k, n, tile, (y.float() - want.float()).abs().max())


def test_linear_cuda_wgmma_takes_large_layers_on_hopper():
    """The dispatcher's choice around cuda_wgmma's bucket, on a layer its shape rule takes from M = 17
    and on one it takes from M = 9."""
    from ternop.cuda import configs

    v1, scale = _weights(14336, 4096)
    packed = layouts.repack(v1, "a16")
    x = torch.randn(65, 4096, device="cuda", dtype=torch.bfloat16)
    _skip_unavailable("cuda_wgmma", x, packed, scale, layout="a16")
    _skip_unless_wgmma()
    chosen = {m: backends.select(_call(x.new_zeros(m, 4096), packed, scale, layout="a16")).name
              for m in (9, 16, 17, 64, 65, 2048, 2049)}  # fmt: skip
    want = "cuda_wgmma" if configs.wgmma_wide_layer(14336, 4096) else "cuda_mma"
    assert chosen == {9: want, 16: want, 17: "cuda_wgmma", 64: "cuda_wgmma", 65: "cuda_wgmma",
                      2048: "cuda_wgmma", 2049: "cuda_dequant"}, chosen
    # From M = 9 the wide up-projections leave cuda_mma (configs.wgmma_wide_layer).
    wide, wide_scale = _weights(28672, 4096)
    wide = layouts.repack(wide, "a16")
    chosen = {m: backends.select(_call(x.new_zeros(m, 4096), wide, wide_scale, layout="a16")).name
              for m in (8, 9, 16)}  # fmt: skip
    want = "cuda_wgmma" if configs.wgmma_wide_layer(28672, 4096) else "cuda_mma"
    assert chosen == {8: "cuda_mma", 9: want, 16: want}, chosen


def test_linear_cuda_mma_tiles_meets_cuda_mma_at_m16():
    """Where the two kernels meet (cuda_mma scales each block's fp32 partial, cuda_mma_tiles the
    decoded weights in x's dtype, as ternop.dequantize does), both meet the 2x rule."""
    v1, scale = _weights(1152, 4096)
    packed = layouts.repack(v1, "a16")
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(16, 4096, device="cuda", dtype=dtype)
        _skip_unavailable("cuda_mma_tiles", x, packed, scale, layout="a16")
        _check(torch.ops.ternop.linear_cuda_mma(x, packed, scale, None, True), x, v1, scale)
        for tile in range(2):
            _check(torch.ops.ternop.linear_cuda_mma_tiles(x, packed, scale, None, tile), x, v1, scale)


@pytest.mark.parametrize("row_groups", [1, 2, 4, 8])
def test_linear_cuda_small_m_kernels_every_row_set_count(row_groups):
    """The small-M kernels with 1, 2, 4 or 8 sets of 16 rows per CTA (what their own choice may
    pick): N ragged against 16 * sets, K from 3 to 112 blocks (sets with several warps, one
    warp, more sets than K gives warps). 16-bit: the 2x rule. W2A8 with one power-of-two scale:
    exact after the int32 partials, so equal to the CPU reference bit for bit, fused or not."""
    from ternop.activations import quantize_rows

    for m, k, n in [(1, 4096, 1160), (2, 2048, 520), (5, 384, 200), (12, 2176, 264), (16, 14336, 520),
                    (21, 2176, 264), (32, 4096, 520)]:
        v1, scale = _weights(n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        _skip_unavailable("cuda_mma", x, v1, scale)
        for layout in ("v1", "a16") if m <= 16 else ():  # the 16-bit kernel takes M <= 16
            y = torch.ops.ternop.linear_cuda_mma(x, layouts.repack(v1, layout), scale, bias, layout == "a16", row_groups)
            _check(y, x, v1, scale, bias)
        a8, pow2 = layouts.repack(v1, "a8"), torch.full_like(scale, 2.0**-6)
        want = ternop.linear(x.cpu(), a8.cpu(), pow2.cpu(), bias.cpu(), activation_bits=8, layout="a8")
        q, qs = quantize_rows(x)
        y = torch.ops.ternop.linear_cuda_mma_a8(q, qs, a8, pow2, bias, x.dtype, row_groups)
        assert torch.equal(y.cpu(), want), (m, k, n)
        if m <= 2 and m * k <= 40960:  # what the fused quantization takes
            y = torch.ops.ternop.linear_cuda_mma_a8_fused(x, a8, pow2, bias, row_groups)
            assert torch.equal(y.cpu(), want), (m, k, n, "fused")


@pytest.mark.parametrize("row_groups", [-1, 1, 8])
def test_small_m_kernels_deeper_prefetch_gives_the_same_bits(row_groups):
    """depth=4 (four scale blocks of weight loads in flight a warp instead of two) moves when the
    loads are issued, not what is summed or in which order: one and two token tiles give depth 2's
    bits, with block counts a warp gets that are and are not multiples of 4 (K from 3 to 112
    blocks). W2A8 with one power-of-two scale stays equal to the CPU reference, fused or not, with
    one, two and four token tiles (the 16-bit kernel stops at two, M = 16)."""
    from ternop.activations import quantize_rows

    for m, k, n in [(1, 4096, 1160), (2, 2176, 520), (5, 384, 200), (8, 14336, 264), (12, 2176, 264), (16, 4096, 520),
                    (30, 2176, 264)]:
        v1, scale = _weights(n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        _skip_unavailable("cuda_mma", x, v1, scale)
        if m <= 16:  # the 16-bit kernel takes M <= 16
            a16 = layouts.repack(v1, "a16")
            shallow = torch.ops.ternop.linear_cuda_mma(x, a16, scale, bias, True, row_groups, 2)
            deep = torch.ops.ternop.linear_cuda_mma(x, a16, scale, bias, True, row_groups, 4)
            assert torch.equal(deep, shallow), (m, k, n)
            _check(deep, x, v1, scale, bias)
        a8, pow2 = layouts.repack(v1, "a8"), torch.full_like(scale, 2.0**-6)
        want = ternop.linear(x.cpu(), a8.cpu(), pow2.cpu(), bias.cpu(), activation_bits=8, layout="a8")
        q, qs = quantize_rows(x)
        y = torch.ops.ternop.linear_cuda_mma_a8(q, qs, a8, pow2, bias, x.dtype, row_groups, 4)
        assert torch.equal(y.cpu(), want), (m, k, n)
        if m <= 2 and m * k <= 40960:  # what the fused quantization takes
            y = torch.ops.ternop.linear_cuda_mma_a8_fused(x, a8, pow2, bias, row_groups, 4)
            assert torch.equal(y.cpu(), want), (m, k, n, "fused")


def test_small_m_kernel_reads_x_from_shared_memory_to_the_same_bits():
    """With two or more sets of 16 rows a CTA and M <= 8, the a16 kernel reads x from shared memory
    (ternary_mma.cu, kSmemX); with one set it reads x from global memory. Below 4 scale blocks
    every set has one warp whatever the set count, so both forms sum the same products in the same
    order: the same bits at M = 1..8, ragged N, both depths, fp16 and bf16. And at K = 4096 (eight
    warps a set, x in 32 KB of shared memory at M = 4) the 2x rule against the reference."""
    for dtype in (torch.float16, torch.bfloat16):
        for m, k, n in [(1, 384, 200), (3, 256, 72), (8, 384, 520), (5, 128, 40)]:
            v1, scale = _weights(n, k)
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            bias = torch.randn(n, device="cuda", dtype=dtype)
            _skip_unavailable("cuda_mma", x, v1, scale)
            a16 = layouts.repack(v1, "a16")
            for depth in (2, 4):
                from_global = torch.ops.ternop.linear_cuda_mma(x, a16, scale, bias, True, 1, depth)
                _check(from_global, x, v1, scale, bias)
                for row_groups in (2, 4, 8):
                    y = torch.ops.ternop.linear_cuda_mma(x, a16, scale, bias, True, row_groups, depth)
                    assert torch.equal(y, from_global), (dtype, m, k, n, row_groups, depth)
        v1, scale = _weights(1000, 4096)
        x = torch.randn(4, 4096, device="cuda", dtype=dtype)
        for row_groups in (2, 8):
            _check(torch.ops.ternop.linear_cuda_mma(x, layouts.repack(v1, "a16"), scale, None, True, row_groups), x, v1, scale)


def test_two_tile_kernel_reads_x_through_its_ring_to_the_same_bits():
    """At M = 9..16 the a16 kernel at the default depth reads x through its per-warp ring
    (ternary_mma.cu, takes_x_ring) on these layers; at depth 4 it reads x from global memory. The
    depth moves only when loads are issued, so both give the same bits: M = 9..16, ragged N, odd
    block counts a warp, every set count, fp16 and bf16; and the 2x rule against the reference."""
    for dtype in (torch.float16, torch.bfloat16):
        for m, k, n in [(9, 384, 200), (12, 2176, 72), (16, 4096, 1160), (13, 14336, 520), (16, 1024, 40)]:
            v1, scale = _weights(n, k)
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            bias = torch.randn(n, device="cuda", dtype=dtype)
            _skip_unavailable("cuda_mma", x, v1, scale)
            a16 = layouts.repack(v1, "a16")
            for row_groups in (-1, 1, 2, 8):
                ring = torch.ops.ternop.linear_cuda_mma(x, a16, scale, bias, True, row_groups, 2)
                from_global = torch.ops.ternop.linear_cuda_mma(x, a16, scale, bias, True, row_groups, 4)
                assert torch.equal(ring, from_global), (dtype, m, k, n, row_groups)
            _check(ring, x, v1, scale, bias)


def test_small_m_kernels_refuse_a_depth_they_do_not_take():
    v1, scale = _weights(256, 1024)
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    _skip_unavailable("cuda_mma", x, v1, scale)
    a16 = layouts.repack(v1, "a16")
    mma = torch.ops.ternop.linear_cuda_mma
    with pytest.raises(RuntimeError, match="depth must be -1"):
        mma(x, v1, scale, None, False, -1, 4)  # format v1 has no deep form
    for depth in (0, 3, 8):
        with pytest.raises(RuntimeError, match="depth must be -1"):
            mma(x, a16, scale, None, True, -1, depth)
    from ternop.activations import quantize_rows

    q, qs = quantize_rows(x)
    with pytest.raises(RuntimeError, match="depth must be -1"):
        torch.ops.ternop.linear_cuda_mma_a8(q, qs, layouts.repack(v1, "a8"), scale, None, x.dtype, -1, 3)


def test_linear_cuda_mma_tiles_takes_m_17_to_64():
    v1, scale = _weights(1152, 1024)
    packed = layouts.repack(v1, "a16")
    chosen = {}
    for m in (16, 17, 64, 65):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        _skip_unavailable("cuda_mma_tiles", x, packed, scale, layout="a16")
        chosen[m] = backends.select(_call(x, packed, scale, layout="a16")).name
    from ternop.cuda import configs, cuda_ext

    # 1152 x 1024 is below cuda_wgmma's shape rule up to M = 64 (K = 1024 and N * K < 2^22); from M = 65
    # cuda_wgmma takes every layer on Hopper.
    # On Hopper M = 17 runs cuda_mma in token slabs (configs.mma_slab), which go before it.
    hopper = torch.cuda.get_device_capability() == (9, 0) and cuda_ext.wgmma_built()
    declines = configs.wgmma_declines(65, 1152, 1024)
    above = "cuda_wgmma" if hopper and not declines else "triton_a16"
    at17 = "cuda_mma" if configs.mma_slab(17, 1152, 1024, x.device) else "cuda_mma_tiles"
    assert configs.mma_slab(64, 1152, 1024, x.device) == 0
    assert chosen == {16: "cuda_mma", 17: at17, 64: "cuda_mma_tiles", 65: above}, chosen


def test_linear_cuda_mma_declines_with_reasons():
    packed, scale = _weights(136, 512)
    x = torch.randn(3, 512, device="cuda", dtype=torch.float16)
    ternop.linear(x, packed, scale)  # loads the CUDA backends
    can = backends.get("cuda_mma").can_implement
    ok, why = can(_call(x.float(), packed, scale))
    assert not ok and "float32" in why
    ok, why = can(_call(torch.randn(17, 512, device="cuda", dtype=torch.float16), packed, scale))
    assert not ok and "M=17" in why
    ok, why = can(_call(torch.randn(3 * 512 + 1, device="cuda", dtype=torch.float16)[1:].view(3, 512), packed, scale))
    assert not ok and ("aligned" in why or "needs sm_80" in why or "extension not built" in why)
    ok, why = can(_call(x, packed, scale, bits=8))
    assert not ok and "16-bit activations only" in why


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", [None, *BACKENDS])
def test_linear_cuda_3d_noncontiguous_bias(monkeypatch, name, dtype):
    k, n = 1024, 136
    packed, scale = _weights(n, k)
    bias = torch.randn(2 * n, device="cuda").to(dtype)[::2]  # strided: every kernel must index it by its stride
    layout = _layout_for(name)
    stored = layouts.repack(packed, layout)
    m_total = {"cuda_gemv": 4, "triton_gemv": 4, "cuda_mma": 16}.get(name, 80)
    x3 = torch.randn(2, m_total // 2, k, device="cuda").to(dtype)
    if name in ("cuda_mma", "cuda_mma_tiles", "cuda_wgmma", "triton_a16") and dtype == torch.float32:
        ternop.linear(x3[0, :1], stored, scale, layout=layout)  # registers the CUDA backends
        ok, why = backends.get(name).can_implement(_call(x3, stored, scale, bias, layout=layout))
        assert not ok and "float32" in why
        name = None  # the dispatcher must still serve fp32 with another backend
    _skip_unavailable(name, x3, stored, scale, layout=layout)
    _force(monkeypatch, name)
    _check(ternop.linear(x3, stored, scale, bias, layout=layout), x3, packed, scale, bias)
    x_nc = torch.randn(2 * k, m_total, device="cuda").to(dtype).t()[:, ::2]  # [M, K], strides (1, 2M)
    assert not x_nc.is_contiguous()
    y = ternop.linear(x_nc, stored, scale, bias, layout=layout)
    _check(y, x_nc, packed, scale, bias)
    assert torch.equal(y, ternop.linear(x_nc.contiguous(), stored, scale, bias, layout=layout))


@pytest.mark.parametrize("name", BACKENDS)
def test_linear_cuda_reserved_code_reads_as_zero(monkeypatch, name):
    packed, scale = _weights(264, 512, reserved=True)
    assert bool((((packed & (packed >> 1)) & 0x55) != 0).any())
    layout = _layout_for(name)
    stored = layouts.repack(packed, layout)
    x = torch.randn({"cuda_mma_tiles": 40, "cuda_wgmma": 80}.get(name, 3), 512, device="cuda", dtype=torch.float16)
    _skip_unavailable(name, x, stored, scale, layout=layout)
    _force(monkeypatch, name)
    _check(ternop.linear(x, stored, scale, layout=layout), x, packed, scale)


def test_linear_cuda_dispatch_by_m():
    packed, scale = _weights(256, 512)
    chosen = {}
    for m in (1, 16, 4096):
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        ternop.linear(x, packed, scale)
        chosen[m] = backends.select(_call(x, packed, scale)).name
    assert chosen[1] in ("cuda_mma", "cuda_gemv", "triton_a16")
    assert chosen[16] in ("cuda_mma", "triton_a16")
    assert chosen[4096] in ("cuda_dequant", "dequant_cublas", "triton_a16")
    reasons = dict((name, why) for name, ok, why in backends.explain(_call(x, packed, scale)) if not ok)
    assert "M=4096" in reasons["triton_gemv"]
    # int8 activations only ever run on the W2A8 backends (triton_a8 at this M; with a scale per
    # row, dequant_a8's GEMM on Hopper where its 128 x 128 tiles fill the GPU twice over, else triton_a8)
    from ternop.cuda import configs

    assert backends.select(_call(x, packed, scale, bits=8)).name == "triton_a8"
    row = scale[:, :1].contiguous()
    hopper = torch.cuda.get_device_capability() == (9, 0)
    wide, wide_scale = _weights(16384, 512)
    for w, s in ((packed, row), (wide, wide_scale[:, :1].contiguous())):  # 32 x 2 and 32 x 128 tiles
        takes = hopper and not configs.dequant_a8_declines(4096, w.shape[0], x.device)
        assert backends.select(_call(x, w, s, bits=8)).name == (_dense_a8() if takes else "triton_a8"), w.shape
    assert not hopper or not configs.dequant_a8_declines(4096, 16384, x.device)  # the wide layer takes it there


@pytest.mark.parametrize("m", [1, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_cuda_opcheck(m, with_bias):
    packed, scale = _weights(136, 384)
    x = torch.randn(m, 384, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(136, device="cuda", dtype=torch.bfloat16) if with_bias else None
    torch.library.opcheck(torch.ops.ternop.linear.default, (x, packed, scale, bias))
    for bits, layout in ((16, "a16"), (8, "a8"), (8, "v1")):
        repacked = layouts.repack(packed, layout)
        torch.library.opcheck(torch.ops.ternop.linear.default, (x, repacked, scale, bias, bits, layout))


def _skip_guards(entries):
    return [False] * len(entries)


@pytest.mark.parametrize("layout", ["v1", "a16"])
def test_linear_cuda_compile_dynamic_m_one_graph(layout):
    """vLLM traces once with a symbolic M and drops the guards: M=1, 64 and 4096 must all be
    right in that one graph (a kernel chosen at trace time would be wrong for some of them)."""
    v1, scale = _weights(1152, 1024)
    packed = layouts.repack(v1, layout)
    bias = torch.randn(1152, device="cuda", dtype=torch.bfloat16)

    def f(x):
        return ternop.linear(x, packed, scale, bias, layout=layout) * 2.0

    # With every guard dropped, Dynamo would reuse the graph another parametrization of this
    # test compiled for the same code object (the layout string is a constant in it).
    torch._dynamo.reset()

    skip = getattr(torch.compiler, "skip_all_guards_unsafe", _skip_guards)
    compiled = torch.compile(f, fullgraph=True, dynamic=True, options={"guard_filter_fn": skip})
    # Traced with symbolic M. M=5 on purpose: dynamic=True duck-sizes every input dim, and an
    # M equal to another size (K/128 = 8 here) would tie M to it in the graph.
    compiled(torch.randn(5, 1024, device="cuda", dtype=torch.bfloat16))
    for m in (1, 64, 4096):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        with torch._dynamo.config.patch(error_on_recompile=True):
            y = compiled(x)
        _check(y / 2, x, v1, scale, bias)
        torch.testing.assert_close(y, f(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "m,name,dtype",
    [(1, None, torch.float16), (3, None, torch.float16), (64, None, torch.float16), (1000, None, torch.float16),
     (1, "cuda_mma", torch.bfloat16), (16, "cuda_mma", torch.float16), (64, "cuda_mma_tiles", torch.bfloat16),
     (40, "cuda_mma_tiles", torch.float16), (200, "cuda_wgmma", torch.bfloat16), (80, "cuda_wgmma", torch.float16),
     (24, "cuda_wgmma", torch.bfloat16)],
)
def test_linear_cuda_graph_capture_replays(monkeypatch, m, name, dtype):
    layout = _layout_for(name)
    packed, scale = _weights(4096 if m != 40 else 1024, 1024)  # 1024 x 1024 at M = 40 splits K
    packed = layouts.repack(packed, layout)
    bias = torch.randn(packed.shape[0], device="cuda", dtype=dtype)
    x = torch.randn(m, 1024, device="cuda", dtype=dtype)
    _skip_unavailable(name, x, packed, scale, layout=layout)
    _force(monkeypatch, name)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: JIT compiles and the extension build happen here
        for _ in range(2):
            ternop.linear(x, packed, scale, bias, layout=layout)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ternop.linear(x, packed, scale, bias, layout=layout)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, ternop.linear(x, packed, scale, bias, layout=layout), rtol=0, atol=0)


def test_linear_cuda_reduce_overhead_matches_eager():
    packed, scale = _weights(1152, 4096)

    def f(x):
        return ternop.linear(x, packed, scale)

    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    for m in (1, 1, 1, 256, 256, 256):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        y = compiled(x).clone()
        torch.testing.assert_close(y, f(x), rtol=0, atol=0)


@pytest.mark.parametrize("m", [1, 100])
def test_linear_cuda_unaligned_x_falls_back(m):
    """x at a 2-byte offset (a slice of a fused output): the 16-byte-load kernel declines,
    another backend runs, and the result is right."""
    k, n = 512, 136
    packed, scale = _weights(n, k)
    flat = torch.randn(m * k + 1, device="cuda", dtype=torch.float16)
    x = flat[1:].view(m, k)
    assert x.data_ptr() % 16 != 0
    reasons = {name: why for name, ok, why in backends.explain(_call(x, packed, scale)) if not ok}
    for name in CPP_BACKENDS:
        if m == 1 and name in reasons and "extension not built" not in reasons[name]:
            assert "aligned" in reasons[name] or "needs sm_80" in reasons[name]
    _check(ternop.linear(x, packed, scale), x, packed, scale)


# --- W2A8 ---------------------------------------------------------------------------------------

A8_SHAPES = [(1, 128, 64), (3, 384, 136), (16, 4096, 1152), (17, 1024, 520), (64, 3072, 1024),
             (129, 1024, 4096), (300, 14336, 256), (1000, 384, 1152)]


A8_CPP = ("cuda_mma_a8", "cuda_mma_a8_fused", "cuda_wgmma_a8")


def _a8_takes(name, m, k, row=False):
    """Whether the C++ W2A8 backend ``name`` takes M rows of K, with row scales if ``row`` (the
    others take every shape)."""
    if name == "cuda_mma_a8":
        return m <= (64 if row else 32)
    if name == "cuda_mma_a8_fused":
        return m <= 2 and m * k <= 40 * 1024
    return True


@pytest.mark.parametrize("name", [None, "triton_a8", *A8_CPP])
@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_linear_cuda_a8_against_the_spec(monkeypatch, name, layout, dtype):
    if name in A8_CPP and layout != "a8":
        pytest.skip("the C++ W2A8 kernel reads the a8 layout only")
    for m, k, n in A8_SHAPES + [(2, 1152, 136), (9, 2176, 40), (16, 14336, 264), (8, 4096, 4096), (1, 14336, 520)]:
        if not _a8_takes(name, m, k):
            continue
        v1, scale = _weights(n, k)
        packed = layouts.repack(v1, layout)
        x = torch.randn(m, 2 * k, device="cuda").to(dtype)[:, :k]  # strided rows
        bias = torch.randn(2 * n, device="cuda").to(dtype)[::2]
        if name in A8_CPP:
            _skip_unavailable(name, x, packed, scale, bits=8, layout=layout)
        _force(monkeypatch, name)
        y = ternop.linear(x, packed, scale, bias, activation_bits=8, layout=layout)
        monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
        ref = linear_a8_fp64(x, packed, scale, bias, layout)
        tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
        assert y.dtype == dtype and _rel_err(y, ref) <= tol, (m, k, n, _rel_err(y, ref))


@pytest.mark.parametrize("name", [None, "triton_a8", *A8_CPP])
def test_linear_cuda_a8_partials_are_exact(monkeypatch, name):
    """With one power-of-two scale per layer and fp32 x, every fp32 operation after the int32
    block partials is exact, so the kernel must equal the CPU reference bit for bit."""
    for m, k, n in [(1, 4096, 1152), (2, 1024, 136), (7, 1024, 136), (16, 2176, 264), (64, 3072, 4096),
                    (300, 2048, 256)]:  # fmt: skip
        if not _a8_takes(name, m, k):
            continue
        v1, _ = _weights(n, k)
        scale = torch.full((n, k // 128), 2.0**-6, dtype=torch.float16, device="cuda")
        packed = layouts.repack(v1, "a8")
        x = torch.randn(m, k, device="cuda")
        if name in A8_CPP:
            _skip_unavailable(name, x, packed, scale, bits=8, layout="a8")
        _force(monkeypatch, name)
        y = ternop.linear(x, packed, scale, activation_bits=8, layout="a8")
        monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
        want = ternop.linear(x.cpu(), packed.cpu(), scale.cpu(), activation_bits=8, layout="a8")
        assert torch.equal(y.cpu(), want), (m, k, n)


def test_linear_cuda_wgmma_a8_tiles_equal_the_reference_bit_for_bit():
    """Both tiles of the Hopper W2A8 kernel (64 and 128 tokens), ragged M and N, odd and even block
    counts, a bias: with one power-of-two scale every fp32 step after the int32 partials is exact,
    so each tile equals the spec's arithmetic on the same q and s_x bit for bit. The GPU
    quantization is checked against the CPU one on the way, so that a failure says which of the
    two differs."""
    from ternop import activations
    from ternop.cuda.launch_fused import quantize_rows

    for m, k, n in [(17, 1024, 136), (200, 2048, 520), (1000, 384, 1152), (129, 4096, 256), (300, 640, 200)]:
        v1, _ = _weights(n, k)
        scale = torch.full((n, k // 128), 2.0**-6, dtype=torch.float16, device="cuda")
        packed = layouts.repack(v1, "a8")
        x = torch.randn(m, k, device="cuda")
        bias = torch.randn(n, device="cuda")
        _skip_unavailable("cuda_wgmma_a8", x, packed, scale, bits=8, layout="a8")
        q, qs = quantize_rows(x)
        q_ref, qs_ref = activations.quantize_rows(x.cpu())
        assert torch.equal(qs.cpu(), qs_ref), (m, k, "token scales differ from the spec")
        diff = (q.cpu() != q_ref).nonzero()
        assert diff.numel() == 0, (m, k, "int8 x differs from the spec at", diff[:8].tolist())
        p = activations.block_partials(q.cpu(), activations.weight_values(packed.cpu(), "a8"))
        want = (p.to(torch.float32) * scale.cpu().to(torch.float32)).sum(dim=2) * qs.cpu()[:, None] + bias.cpu()
        for tile in (0, 1):
            y = torch.ops.ternop.linear_cuda_wgmma_a8(q, qs, packed, scale, bias, torch.float32, tile).cpu()
            bad = (y != want).nonzero()
            assert bad.numel() == 0, (m, k, n, tile, len(bad), bad[:8].tolist(), (y - want).abs().max())


def _row_scale(n):
    return (torch.rand(n, 1, device="cuda") * 0.1 + 0.01).half()


@pytest.mark.parametrize("depth", [2, 4])
@pytest.mark.parametrize("row_groups", [-1, 1, 2, 8])
def test_mma_a8_eight_tiles_take_row_scales_to_m_64(row_groups, depth):
    """Eight token tiles (M = 33..64) sum their int32 partials over all of K and take row scales
    only: equal to the CPU reference bit for bit at every set count and both depths, with K from 3
    to 112 blocks (warps with one block, and counts that are not multiples of the depth) and N
    ragged against 16 rows a set. Block scales past M = 32 are refused, and so is M = 65."""
    from ternop.activations import quantize_rows

    for m, k, n in [(33, 384, 200), (40, 2176, 264), (57, 14336, 136), (64, 4096, 520), (64, 1024, 1160)]:
        v1, scale = _weights(n, k)
        packed, row = layouts.repack(v1, "a8"), _row_scale(n)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        _skip_unavailable("cuda_mma_a8", x[:16], packed, row, bits=8, layout="a8")  # inside its bucket
        want = ternop.linear(x.cpu(), packed.cpu(), row.cpu(), bias.cpu(), activation_bits=8, layout="a8")
        q, qs = quantize_rows(x)
        y = torch.ops.ternop.linear_cuda_mma_a8(q, qs, packed, row, bias, x.dtype, row_groups, depth)
        bad = (y.cpu() != want).nonzero()
        assert bad.numel() == 0, (m, k, n, len(bad), bad[:4].tolist())
    with pytest.raises(RuntimeError, match="takes 1..32"):
        torch.ops.ternop.linear_cuda_mma_a8(q, qs, packed, scale, bias, x.dtype, row_groups, depth)
    q65, qs65 = quantize_rows(torch.randn(65, k, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="takes 1..64"):
        torch.ops.ternop.linear_cuda_mma_a8(q65, qs65, packed, row, bias, x.dtype, row_groups, depth)


@pytest.mark.parametrize("slab", [8, 16])
@pytest.mark.parametrize("row_groups", [-1, 1, 8])
def test_mma_token_slabs_equal_a_launch_of_each_slab(slab, row_groups):
    """The 16-bit small-M kernel over ceil(M / slab) token slabs along the grid's y (a16 weights): the
    2x rule, and every slab, the last one ragged included, equal bit for bit to a launch of its rows
    alone, at every set count and with K from 3 to 112 blocks and N ragged against 16 rows a set."""
    for m, k, n in [(slab + 1, 384, 200), (24, 2176, 264), (40, 4096, 520), (64, 1024, 1160), (77, 14336, 136)]:
        v1, scale = _weights(n, k)
        a16 = layouts.repack(v1, "a16")
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        _skip_unavailable("cuda_mma", x[:16], v1, scale)
        y = torch.ops.ternop.linear_cuda_mma(x, a16, scale, bias, True, row_groups, slab=slab)
        _check(y, x, v1, scale, bias)
        for m0 in range(0, m, slab):
            rows = x[m0:m0 + slab].contiguous()
            one = torch.ops.ternop.linear_cuda_mma(rows, a16, scale, bias, True, row_groups)
            assert torch.equal(y[m0:m0 + slab], one), (m, k, n, m0)


@pytest.mark.parametrize("slab", [8, 16, 32])
@pytest.mark.parametrize("row_groups", [-1, 1, 2, 4, 8])
def test_mma_a8_token_slabs_equal_the_reference(slab, row_groups):
    """The int8 small-M kernel over ceil(M / slab) token slabs of one, two or four tiles: with row
    scales bit for bit the CPU reference, with block scales within the W2A8 tolerance of the fp64 spec
    (test_linear_cuda_a8_against_the_spec), past the one-launch bounds (M = 64, 32) up to M = 200."""
    from ternop.activations import quantize_rows

    for m, k, n in [(slab + 1, 384, 200), (40, 2176, 264), (64, 4096, 520), (100, 1024, 1160), (200, 2048, 136)]:
        v1, scale = _weights(n, k)
        packed, row = layouts.repack(v1, "a8"), _row_scale(n)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        _skip_unavailable("cuda_mma_a8", x[:16], packed, row, bits=8, layout="a8")
        q, qs = quantize_rows(x)
        y_row = torch.ops.ternop.linear_cuda_mma_a8(q, qs, packed, row, bias, x.dtype, row_groups, 2, slab)
        y_block = torch.ops.ternop.linear_cuda_mma_a8(q, qs, packed, scale, bias, x.dtype, row_groups, 2, slab)
        want = ternop.linear(x.cpu(), packed.cpu(), row.cpu(), bias.cpu(), activation_bits=8, layout="a8")
        bad = (y_row.cpu() != want).nonzero()
        assert bad.numel() == 0, (m, k, n, len(bad), bad[:4].tolist())
        ref = linear_a8_fp64(x, packed, scale, bias, "a8")
        assert _rel_err(y_block, ref) <= 8e-3, (m, k, n, _rel_err(y_block, ref))


def test_dispatched_int8_slabs_with_more_sets_of_rows_equal_the_reference():
    """At M = 65..128 on the N >= K layers of the 0.6B family the dispatcher runs int8 row-scaled calls
    on cuda_mma_a8 in token slabs with 2 or 4 sets of 16 rows a CTA (configs.mma_a8_row_groups, Hopper):
    bit for bit the CPU reference, with a bias, ragged last slabs included."""
    from ternop.cuda import configs

    for m, k, n in [(65, 1024, 4096), (100, 1024, 4096), (128, 1024, 4096), (72, 1024, 6144), (113, 1024, 6144)]:
        v1, _ = _weights(n, k)
        row = _row_scale(n)
        packed = layouts.repack(v1, "a8")
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        _skip_unavailable("cuda_mma_a8", x[:16], packed, row, bits=8, layout="a8")
        if configs.mma_a8_row_groups(m, n, k, True, x.device) == -1:
            pytest.skip("the rule sets the rows a CTA on Hopper only")
        assert backends.select(_call(x, packed, row, bits=8, layout="a8")).name == "cuda_mma_a8", (m, k, n)
        y = ternop.linear(x, packed, row, bias, activation_bits=8, layout="a8")
        want = ternop.linear(x.cpu(), packed.cpu(), row.cpu(), bias.cpu(), activation_bits=8, layout="a8")
        bad = (y.cpu() != want).nonzero()
        assert bad.numel() == 0, (m, k, n, len(bad), bad[:4].tolist())


def test_small_m_kernels_refuse_a_slab_they_do_not_take():
    """A slab the kernel has no form for is refused with its rule, never run as another: 16-bit slabs
    take a16 weights at the default depth, 8 or 16 tokens; int8 slabs 8, 16 or 32."""
    from ternop.activations import quantize_rows

    v1, scale = _weights(256, 1024)
    x = torch.randn(40, 1024, device="cuda", dtype=torch.bfloat16)
    _skip_unavailable("cuda_mma", x[:4], v1, scale)
    a16 = layouts.repack(v1, "a16")
    mma = torch.ops.ternop.linear_cuda_mma
    for args, why in [((v1, scale, None, False, -1, -1), "with v1 weights"), ((a16, scale, None, True, -1, 4), "depth 4"),
                      ((a16, scale, None, True, -1, -1), "got 32")]:  # fmt: skip
        with pytest.raises(RuntimeError, match="slab must be 0") as err:
            mma(x, *args, slab=32 if why == "got 32" else 16)
        assert why in str(err.value), str(err.value)
    with pytest.raises(RuntimeError, match="takes 1..16"):
        mma(x, a16, scale, None, True)  # M = 40 without slabs
    q, qs = quantize_rows(x)
    a8 = layouts.repack(v1, "a8")
    for slab in (4, 64, -1):
        with pytest.raises(RuntimeError, match="slab must be 0"):
            torch.ops.ternop.linear_cuda_mma_a8(q, qs, a8, scale, None, x.dtype, -1, -1, slab)


@pytest.mark.parametrize("name", [None, "triton_a8", "dequant_a8", "cuda_dequant_a8", *A8_CPP])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_cuda_a8_row_scales_equal_the_reference_bit_for_bit(monkeypatch, name, dtype):
    """One scale per row (weight_scale [N, 1]) leaves a kernel no freedom (ternop/activations.py):
    every W2A8 backend must equal the CPU reference bit for bit, on ragged shapes, strided x, a
    strided bias, the split-K launches of the small-M shapes, and M past the large-M floors."""
    for m, k, n in A8_SHAPES + [(2, 1152, 136), (9, 2176, 40), (16, 14336, 264), (1, 14336, 520), (33, 2176, 264),
                                (47, 1024, 520), (2049, 2048, 264), (2100, 1024, 1100)]:  # fmt: skip
        if not _a8_takes(name, m, k, row=True):
            continue
        v1, _ = _weights(n, k)
        row = _row_scale(n)
        packed = layouts.repack(v1, "a8")
        x = torch.randn(m, 2 * k, device="cuda").to(dtype)[:, :k]
        bias = torch.randn(2 * n, device="cuda").to(dtype)[::2]
        if name is not None:
            _skip_unavailable(name, x, packed, row, bits=8, layout="a8")
        _force(monkeypatch, name)
        y = ternop.linear(x, packed, row, bias, activation_bits=8, layout="a8")
        monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
        want = ternop.linear(x.cpu(), packed.cpu(), row.cpu(), bias.cpu(), activation_bits=8, layout="a8")
        bad = (y.cpu() != want).nonzero()
        assert bad.numel() == 0, (name, m, k, n, len(bad), bad[:4].tolist())


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_decode_int8_cuda_gives_the_values_of_the_spec(layout):
    """ternop::decode_int8_cuda: the values of the codes (reserved ones read 0) as int8 [N, K], the same
    as the Triton decode's, for row counts that leave a partial block of threads and K of one block."""
    from ternop.cuda import cuda_ext
    from ternop.cuda.launch_dequant_a8 import decode_int8
    from ternop.layouts import LAYOUT_CODES

    ok, why = cuda_ext.load()
    if not ok:
        _no_extension(why)
    for n, k in [(1, 128), (17, 384), (300, 1152), (4096, 1024)]:
        v1, _ = _weights(n, k, reserved=True)
        packed = layouts.repack(v1, layout)
        w8 = torch.ops.ternop.decode_int8_cuda(packed, LAYOUT_CODES[layout])
        assert w8.dtype == torch.int8 and w8.shape == (n, k)
        want = torch.from_numpy(unpack_layout_values(packed, layout)).to(torch.int8)
        assert torch.equal(w8.cpu(), want), (n, k)
        assert torch.equal(w8, decode_int8(packed, layout)), (n, k)
    with pytest.raises(RuntimeError, match="contiguous, 16-byte aligned uint8"):
        torch.ops.ternop.decode_int8_cuda(packed[:, 4:], LAYOUT_CODES[layout])
    with pytest.raises(RuntimeError, match="layout must be 0"):
        torch.ops.ternop.decode_int8_cuda(packed, 3)


def test_linear_cuda_wgmma_a8_row_scale_tiles_equal_the_reference_bit_for_bit():
    """Every tile of the Hopper W2A8 kernel with row scales (0-3: 128 weight rows at 64 and 128
    tokens, 192 at 128, 256 at 64; 4 and 5: 128 rows at 128 and 256 tokens, the weights decoded into
    shared memory, which never split K), odd and even block counts, ragged M and N, and tile counts
    above and below the number of SMs. Launches of fewer CTAs than SMs split K over a cluster
    (a8_row_splits in ternary_wgmma_a8.cu): into 2 CTAs on 768 -> 5100 at M = 50, 4 or 8 on the other
    narrow launches; the block counts 3 and 5 and the wide launch of 1024 -> 2100 do not split. A
    split must not change a bit."""
    for m, k, n in [(17, 1024, 136), (200, 2048, 520), (1000, 384, 1152), (129, 4096, 256), (300, 640, 200),
                    (64, 14336, 128), (3000, 1024, 2100), (50, 768, 5100)]:  # fmt: skip
        v1, _ = _weights(n, k)
        row = _row_scale(n)
        packed = layouts.repack(v1, "a8")
        x = torch.randn(m, k, device="cuda")
        bias = torch.randn(n, device="cuda")
        _skip_unavailable("cuda_wgmma_a8", x, packed, row, bits=8, layout="a8")
        want = ternop.linear(x.cpu(), packed.cpu(), row.cpu(), bias.cpu(), activation_bits=8, layout="a8")
        from ternop.cuda.launch_fused import quantize_rows

        q, qs = quantize_rows(x)
        for tile in (0, 1, 2, 3, 4, 5):
            y = torch.ops.ternop.linear_cuda_wgmma_a8(q, qs, packed, row, bias, torch.float32, tile).cpu()
            bad = (y != want).nonzero()
            assert bad.numel() == 0, (m, k, n, tile, len(bad), bad[:8].tolist(), (y - want).abs().max())


def _assert_row_tiles_equal_the_q8_reference(x, v1, dtype, tiles):
    """cuda_wgmma_a8 with row scales and a bias, on each of ``tiles`` forced, gives the bits of the CPU
    reference from the same q and s_x in ``dtype``."""
    from ternop.cuda.launch_fused import quantize_rows

    (m, k), n = x.shape, v1.shape[0]
    row = _row_scale(n)
    packed = layouts.repack(v1, "a8")
    bias = torch.randn(n, device="cuda").to(dtype)
    _skip_unavailable("cuda_wgmma_a8", x, packed, row, bits=8, layout="a8")
    q, qs = quantize_rows(x)
    want = ternop.linear_q8(q.cpu(), qs.cpu(), packed.cpu(), row.cpu(), bias.cpu(), out_dtype=dtype, layout="a8")
    for tile in tiles:
        y = torch.ops.ternop.linear_cuda_wgmma_a8(q, qs, packed, row, bias, dtype, tile).cpu()
        assert y.dtype == dtype
        bad = (y != want).nonzero()
        assert bad.numel() == 0, (m, k, n, tile, len(bad), bad[:8].tolist())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_linear_cuda_wgmma_a8_shared_memory_tiles_store_every_dtype_bit_for_bit(dtype):
    """The shared-memory tiles (4 and 5) stage 16-bit outputs as packed pairs (stmatrix) and fp32 ones
    element by element: each output dtype equals the CPU reference from the same q and s_x bit for
    bit, with a bias, on ragged M and N. On the long layer x is all ones (q = 127) and weight
    rows 0 and 1 are all +1 and all -1, so that |S| = 127 K there, the largest sums an
    absmax-quantized x makes: 127 * 32768 still converts to fp32 exactly."""
    for m, k, n in [(300, 1024, 264), (520, 4096, 200), (256, 32768, 136)]:
        v1, _ = _weights(n, k)
        x = torch.randn(m, k, device="cuda")
        if k > 4096:
            x[:] = 1.0
            v1[0], v1[1] = 0x55, 0xAA  # codes 0b01 (+1) and 0b10 (-1)
        _assert_row_tiles_equal_the_q8_reference(x, v1, dtype, (4, 5))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_linear_cuda_wgmma_a8_split_k_stores_every_dtype_bit_for_bit(dtype):
    """The register tiles (0-3) with row scales split K over a cluster where their CTAs are few, and
    the cluster's CTAs add their sums four rows at a time: each output dtype equals the CPU
    reference from the same q and s_x bit for bit, with a bias, where N is a multiple of four (the
    four outputs leave in one store) and where it is not (the last quad is cut at N)."""
    for m, k, n in [(50, 2048, 1024), (40, 1024, 130), (100, 2048, 262), (200, 3072, 1024), (300, 2048, 1024)]:
        v1, _ = _weights(n, k)
        x = torch.randn(m, k, device="cuda")
        _assert_row_tiles_equal_the_q8_reference(x, v1, dtype, (0, 1, 2, 3))


def _assert_a8_row_capture_and_compile_match_eager(x, packed, row):
    """ternop.linear with int8 activations and row scales gives eager's bits when captured in a CUDA
    graph and replayed, and when compiled (dynamic shapes)."""
    eager = ternop.linear(x, packed, row, activation_bits=8, layout="a8")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ternop.linear(x, packed, row, activation_bits=8, layout="a8")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: ternop.linear(t, packed, row, activation_bits=8, layout="a8"), dynamic=True)
    assert torch.equal(compiled(x), eager)


def test_linear_cuda_wgmma_a8_split_k_graph_capture_and_compile(monkeypatch):
    """The Hopper W2A8 kernel splitting K over a cluster (eight CTAs on 4096 -> 1024 at M = 40, row
    scales, forced) under CUDA-graph capture and torch.compile: the same bits as eager, and as the
    CPU reference."""
    v1, _ = _weights(1024, 4096)
    packed, row = layouts.repack(v1, "a8"), _row_scale(1024)
    x = torch.randn(40, 4096, device="cuda", dtype=torch.bfloat16)
    _skip_unavailable("cuda_wgmma_a8", x, packed, row, bits=8, layout="a8")
    x32 = x.float()
    want = ternop.linear(x32.cpu(), packed.cpu(), row.cpu(), activation_bits=8, layout="a8")
    _force(monkeypatch, "cuda_wgmma_a8")
    assert torch.equal(ternop.linear(x32, packed, row, activation_bits=8, layout="a8").cpu(), want)
    _assert_a8_row_capture_and_compile_match_eager(x, packed, row)


def test_linear_cuda_a8_row_above_the_graphs_runs_the_cpp_launch_and_captures(monkeypatch):
    """A row-scaled int8 call above vLLM's CUDA-graph sizes with M * N * K up to
    configs.EAGER_A8_ROW_MAX_MNK runs on cuda_wgmma_a8 (one launch from C++): 1024 -> 4096 at M = 2048.
    One token row more than the product allows goes back to the table's dense int8 path. The choice does not
    depend on capture, so the same call captured after its eager warm-up replays the same kernel, with
    the bits of eager and of the CPU reference."""
    from ternop.cuda import configs
    from ternop.cuda.launch_fused import quantize_rows

    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    monkeypatch.delenv(configs.ENV_GRAPH_MAX_M, raising=False)
    monkeypatch.setattr(configs, "_engine_graph_max_m", None)  # an in-process vLLM engine may have set it
    backends.clear_cache()
    v1, _ = _weights(4096, 1024)
    packed, row = layouts.repack(v1, "a8"), _row_scale(4096)
    top = configs.EAGER_A8_ROW_MAX_MNK // (4096 * 1024)
    x = torch.randn(top + 1, 1024, device="cuda", dtype=torch.bfloat16)
    _skip_unavailable("cuda_wgmma_a8", x, packed, row, bits=8, layout="a8")
    _skip_unless_wgmma("cuda_wgmma_a8")
    if configs.dequant_a8_declines(top + 1, 4096, x.device):
        pytest.skip("dequant_a8 leaves this layer to the fused kernels on a GPU of this many SMs")
    q, qs = quantize_rows(x)

    def call(m):
        return backends.LinearCall(q[:m], packed, row, None, 8, "a8", qs[:m], torch.bfloat16)

    assert backends.select(call(2048)).name == "cuda_wgmma_a8"
    assert backends.select(call(top)).name == "cuda_wgmma_a8"
    assert backends.select(call(top + 1)).name == _dense_a8()
    q2, qs2 = q[:2048].clone(), qs[:2048].clone()

    def run():
        return ternop.linear_q8(q2, qs2, packed, row, out_dtype=torch.bfloat16, layout="a8")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up a captured call gets, as vLLM gives it
        eager = run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    want = ternop.linear_q8(q2.cpu(), qs2.cpu(), packed.cpu(), row.cpu(), out_dtype=torch.bfloat16, layout="a8")
    assert torch.equal(eager.cpu(), want)


def test_linear_cuda_a8_row_shared_memory_tile_takes_the_k4096_layers_and_captures(monkeypatch):
    """With row scales on a K = 4096 layer, where the dense int8 path used to run at M >= 2048, the
    dispatcher gives the call to cuda_wgmma_a8, whose tile rule takes the shared-memory tile (128 x 256
    CTAs filling the GPU): 4096 -> 4096 at M = 2048 (256 CTAs). A ragged M (2000) on a ragged N (4000)
    too. Captured after its warm-up and compiled, the call gives eager's bits, and eager gives the CPU
    reference's."""
    from ternop.cuda import configs

    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    monkeypatch.delenv(configs.ENV_GRAPH_MAX_M, raising=False)
    monkeypatch.setattr(configs, "_engine_graph_max_m", None)
    backends.clear_cache()
    for m, n in ((2048, 4096), (2000, 4000)):
        v1, _ = _weights(n, 4096)
        packed, row = layouts.repack(v1, "a8"), _row_scale(n)
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        _skip_unavailable("cuda_wgmma_a8", x, packed, row, bits=8, layout="a8")
        _skip_unless_wgmma("cuda_wgmma_a8")
        if not configs.wgmma_a8_smem_takes(m, n, 4096, x.device):
            pytest.skip("the shared-memory tile's CTAs do not fill a GPU of this many SMs")
        assert backends.select(_call(x, packed, row, bits=8, layout="a8")).name == "cuda_wgmma_a8"
        eager = ternop.linear(x, packed, row, activation_bits=8, layout="a8")
        want = ternop.linear(x.cpu(), packed.cpu(), row.cpu(), activation_bits=8, layout="a8")
        assert torch.equal(eager.cpu(), want), (m, n)
        _assert_a8_row_capture_and_compile_match_eager(x, packed, row)


def test_linear_cuda_16_bit_above_the_graphs_runs_cuda_wgmma_on_small_layers(monkeypatch):
    """Above vLLM's CUDA-graph sizes a 16-bit call on a layer of N * K < 2^22 goes to cuda_wgmma up to
    M * N * K = configs.EAGER_A16_MAX_MNK (2048 -> 1024 up to M = 4096), where the table takes the
    dequantizing path; the result meets the 2x rule, and captured after its warm-up it replays the
    same bits."""
    from ternop.cuda import configs

    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    monkeypatch.delenv(configs.ENV_GRAPH_MAX_M, raising=False)
    monkeypatch.setattr(configs, "_engine_graph_max_m", None)
    backends.clear_cache()
    v1, scale = _weights(1024, 2048)
    packed = layouts.repack(v1, "a16")
    x = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    _skip_unavailable("cuda_wgmma", x, packed, scale, layout="a16")
    _skip_unless_wgmma()
    top = configs.EAGER_A16_MAX_MNK // (1024 * 2048)
    assert backends.select(_call(x, packed, scale, layout="a16")).name == "cuda_wgmma"
    wide = torch.randn(top + 1, 2048, device="cuda", dtype=torch.bfloat16)
    assert backends.select(_call(wide, packed, scale, layout="a16")).name != "cuda_wgmma"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = ternop.linear(x, packed, scale, layout="a16")
    torch.cuda.current_stream().wait_stream(side)
    _check(eager, x, v1, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ternop.linear(x, packed, scale, layout="a16")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("m", [3, 48, 200, 2100])
def test_linear_cuda_a8_row_scales_graph_capture_and_compile(m):
    v1, _ = _weights(520, 1024)
    packed, row = layouts.repack(v1, "a8"), _row_scale(520)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    _assert_a8_row_capture_and_compile_match_eager(x, packed, row)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_linear_cuda_a8_fused_quantization_equals_the_separate_one(monkeypatch, dtype):
    """The kernel that quantizes x itself gives, bit for bit, what the quantization kernel
    followed by the same product gives: same int8 rows, same token scale, same sums. A zero
    row (amax = 0) and rows of every magnitude are included."""
    for m, k, n in [(1, 128, 64), (1, 4096, 1152), (2, 2048, 520), (1, 40960, 136), (2, 20480, 72)]:
        v1, scale = _weights(n, k)
        packed = layouts.repack(v1, "a8")
        x = (torch.randn(m, k, device="cuda") * 10.0 ** torch.randint(-3, 4, (m, 1), device="cuda")).to(dtype)
        if m == 2:
            x[1] = 0
        bias = torch.randn(n, device="cuda").to(dtype)
        _skip_unavailable("cuda_mma_a8_fused", x, packed, scale, bits=8, layout="a8")
        _force(monkeypatch, "cuda_mma_a8_fused")
        fused = ternop.linear(x, packed, scale, bias, activation_bits=8, layout="a8")
        _force(monkeypatch, "cuda_mma_a8")
        separate = ternop.linear(x, packed, scale, bias, activation_bits=8, layout="a8")
        monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
        assert torch.equal(fused, separate), (m, k, n, (fused.float() - separate.float()).abs().max())
    v1, scale = _weights(72, 1024)
    x = torch.randn(3, 1024, device="cuda", dtype=dtype)
    ok, why = backends.get("cuda_mma_a8_fused").can_implement(_call(x, layouts.repack(v1, "a8"), scale, bits=8,
                                                                     layout="a8"))
    assert not ok and "M <= 2" in why
    # The widest 8B layer at M = 1: from sm_90, with the early start on, left to the quantization
    # launch and cuda_mma_a8 started early (configs.a8_fused_declines); taken with it off.
    from ternop.cuda import configs

    v1, scale = _weights(28672, 4096)
    wide = layouts.repack(v1, "a8")
    x = torch.randn(1, 4096, device="cuda", dtype=dtype)
    monkeypatch.delenv("TERNOP_PDL", raising=False)
    ok, why = backends.get("cuda_mma_a8_fused").can_implement(_call(x, wide, scale, bits=8, layout="a8"))
    if configs.starts_early(x.device):
        assert not ok and "2^24" in why, why
    else:
        assert ok, why
    monkeypatch.setenv("TERNOP_PDL", "0")
    ok, why = backends.get("cuda_mma_a8_fused").can_implement(_call(x, wide, scale, bits=8, layout="a8"))
    assert ok, why


def test_linear_cuda_a8_never_falls_back(monkeypatch):
    v1, scale = _weights(136, 512)
    x = torch.randn(2, 512, device="cuda", dtype=torch.float16)
    ternop.linear(x, v1, scale)  # loads the CUDA backends
    for name in BACKENDS:
        ok, why = backends.get(name).can_implement(_call(x, v1, scale, bits=8))
        assert not ok and "16-bit" in why, name
    keep = {k: b for k, b in backends._BACKENDS.items()
            if k not in ("triton_a8", "dequant_a8", "cuda_dequant_a8", *A8_CPP)}  # fmt: skip
    monkeypatch.setattr(backends, "_BACKENDS", keep)
    monkeypatch.setattr(backends, "_ORDER", {})
    monkeypatch.setattr(backends, "_CHOICE", {})
    with pytest.raises(RuntimeError, match="no backend can run .*activation_bits=8"):
        ternop.linear(x, v1, scale, activation_bits=8)


@pytest.mark.parametrize("m", [1, 5, 16, 64, 700])
def test_linear_cuda_a8_graph_capture_replays(m):
    v1, scale = _weights(4096, 1024)
    packed = layouts.repack(v1, "a8")
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            ternop.linear(x, packed, scale, bias, activation_bits=8, layout="a8")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ternop.linear(x, packed, scale, bias, activation_bits=8, layout="a8")
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, ternop.linear(x, packed, scale, bias, activation_bits=8, layout="a8"), rtol=0, atol=0)


def _replays_with_new_x(chain, x, monkeypatch, times):
    """Runs chain(x) once on a side stream, captures it in one CUDA graph with the backend the test
    forced, then replays the graph `times` times with new values in x, yielding chain's captured
    outputs after each replay. The forced backend is dropped after the capture, so that the
    caller's CPU references run on the CPU backend."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(x)
    monkeypatch.delenv(backends.ENV_BACKEND)
    for _ in range(times):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        yield outs


def _replay_int8_chain(name, layers, x, monkeypatch, times):
    """_replays_with_new_x over int8 layers ((packed a8, scale) each) chained with backend `name`
    forced, each layer's output the next one's input; skips where `name` cannot run. Yields the
    chain's outputs, x first."""
    _skip_unavailable(name, x, layers[0][0], layers[0][1], bits=8, layout="a8")
    _force(monkeypatch, name)

    def chain(h):
        outs = [h]
        for packed, scale in layers:
            outs.append(ternop.linear(outs[-1], packed, scale, activation_bits=8, layout="a8"))
        return outs

    yield from _replays_with_new_x(chain, x, monkeypatch, times)


@pytest.mark.parametrize("name, m", [("cuda_mma_a8", 1), ("cuda_mma_a8", 5), ("cuda_mma_a8", 16), ("cuda_mma_a8", 29),
                                     ("triton_a8", 5), ("triton_a8", 100), ("triton_a8", 700)])
def test_linear_a8_kernel_reads_each_quantization_when_started_early(monkeypatch, name, m):
    """From sm_90 the small-M int8 kernel and the Triton one may start before the quantization of
    their x has finished (programmatic dependent launch) and must wait for it before they read the
    int8 rows. Eight layers chained in one CUDA graph, each layer's output the next one's input,
    replayed with new x: every layer's output must be the CPU reference of the input it was given,
    bit for bit (row scales leave no freedom). A kernel that read the rows too early would see the
    previous replay's, or a half-written buffer. (On these K = 1024 layers the Triton kernel starts
    early up to M = 512; at M = 5 and 100 on an H100 or H200 it splits K in two, so a reduction launch
    follows it. M = 700 runs it plainly, unsplit, as the control.)"""
    n = k = 1024
    layers = []
    for i in range(8):
        v1, _ = random_packed(n, k, generator=torch.Generator().manual_seed(1000 + i))
        layers.append((layouts.repack(v1.cuda(), "a8"), _row_scale(n)))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for outs in _replay_int8_chain(name, layers, x, monkeypatch, 6):
        for i, (packed, row) in enumerate(layers):
            want = ternop.linear(outs[i].cpu(), packed.cpu(), row.cpu(), activation_bits=8, layout="a8")
            assert torch.equal(outs[i + 1].cpu(), want), (m, i)


@pytest.mark.parametrize("m", [1, 5, 16])
def test_linear_q8_after_rms_norm_quant_reads_its_rows_when_started_early(monkeypatch, m):
    """The same for rows quantized by the RMSNorm before the layer (``ternop::rms_norm_quant``, BitNet's
    norms), which also lets the int8 kernel start early: four norm + layer pairs chained in one CUDA
    graph and replayed with new x. Each layer's output must be the CPU reference of the int8 rows
    and scales its norm wrote, bit for bit."""
    n = k = 1024
    layers = []
    for i in range(4):
        v1, _ = random_packed(n, k, generator=torch.Generator().manual_seed(2000 + i))
        norm_w = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
        layers.append((norm_w, layouts.repack(v1.cuda(), "a8"), _row_scale(n)))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    _skip_unavailable("cuda_mma_a8", x, layers[0][1], layers[0][2], bits=8, layout="a8")
    _force(monkeypatch, "cuda_mma_a8")

    def chain(h):
        steps = []
        for norm_w, packed, row in layers:
            q, qs = ternop.rms_norm_quant(h, norm_w, 1e-6)
            h = ternop.linear_q8(q, qs, packed, row, out_dtype=torch.bfloat16, layout="a8")
            steps.append((q, qs, h))
        return steps

    for steps in _replays_with_new_x(chain, x, monkeypatch, 6):
        for i, ((q, qs, y), (_, packed, row)) in enumerate(zip(steps, layers)):
            want = ternop.linear_q8(q.cpu(), qs.cpu(), packed.cpu(), row.cpu(), out_dtype=torch.bfloat16, layout="a8")
            assert torch.equal(y.cpu(), want), (m, i)


@pytest.mark.parametrize("m, nk", [(64, 2048), (1540, 1024)])
def test_linear_cuda_wgmma_a8_reads_each_quantization_when_started_early(monkeypatch, m, nk):
    """The Hopper int8 kernel may also start before the quantization of its x has finished (tiles of
    which one CTA fills an SM, launches that do not split K): its producer asks for the first
    stages' codes, then waits before it asks for the rows of q. M = 1540 on 1024 x 1024 runs tile 1,
    which starts early; M = 64 runs tile 0, which does not (the control). Four layers with a scale
    per 128 weights (a form that never splits) chained in one CUDA graph and replayed with new x:
    each layer's output must match the CPU reference of the input it was given (the block-scale sums
    leave the rounding order free, so to 1e-2; rows read from another replay would be off by far
    more)."""
    _skip_unless_wgmma("cuda_wgmma_a8")
    layers = []
    for i in range(4):
        v1, scale = random_packed(nk, nk, generator=torch.Generator().manual_seed(3000 + i))
        layers.append((layouts.repack(v1.cuda(), "a8"), scale.cuda()))
    x = torch.randn(m, nk, device="cuda", dtype=torch.bfloat16)
    for outs in _replay_int8_chain("cuda_wgmma_a8", layers, x, monkeypatch, 3):
        for i, (packed, scale) in enumerate(layers):
            want = ternop.linear(outs[i].cpu(), packed.cpu(), scale.cpu(), activation_bits=8, layout="a8").float()
            got = outs[i + 1].cpu().float()
            err = float((got - want).abs().max() / want.abs().max())
            assert err < 1e-2, (m, i, err)


def test_linear_cuda_a8_compile_dynamic_m_one_graph():
    v1, scale = _weights(1152, 1024)
    packed = layouts.repack(v1, "a8")

    def f(x):
        return ternop.linear(x, packed, scale, activation_bits=8, layout="a8") * 2.0

    skip = getattr(torch.compiler, "skip_all_guards_unsafe", _skip_guards)
    compiled = torch.compile(f, fullgraph=True, dynamic=True, options={"guard_filter_fn": skip})
    compiled(torch.randn(5, 1024, device="cuda", dtype=torch.bfloat16))
    for m in (1, 4096):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        with torch._dynamo.config.patch(error_on_recompile=True):
            y = compiled(x)
        torch.testing.assert_close(y, f(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", [None, "triton_a8", "dequant_a8", "cuda_mma_a8", "cuda_wgmma_a8"])
@pytest.mark.parametrize("rows", [False, True], ids=["block-scales", "row-scales"])
def test_linear_q8_equals_linear_a8_bit_for_bit(monkeypatch, name, rows):
    """ternop::linear_q8 on the rows quantize_rows makes is ternop::linear with activation_bits=8,
    bit for bit, on every W2A8 backend that takes already quantized rows (cuda_mma_a8_fused
    quantizes x itself and declines them)."""
    from ternop.activations import quantize_rows

    if name == "dequant_a8" and not rows:
        pytest.skip("dequant_a8 runs row scales only")
    for m, k, n in [(1, 1024, 136), (16, 2048, 264), (200, 1024, 520), (2100, 1024, 1100)]:
        if name == "cuda_mma_a8" and m > 16:
            continue
        v1, scale = _weights(n, k)
        packed = layouts.repack(v1, "a8")
        if rows:
            scale = _row_scale(n)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        if name is not None:
            _skip_unavailable(name, x, packed, scale, bits=8, layout="a8")
        _force(monkeypatch, name)
        want = ternop.linear(x, packed, scale, bias, activation_bits=8, layout="a8")
        got = ternop.linear_q8(*quantize_rows(x), packed, scale, bias, out_dtype=torch.bfloat16, layout="a8")
        monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
        assert torch.equal(got, want), (name, m, k, n)


def test_compiled_quantize_rows_on_cuda_matches_the_spec():
    """Inductor's CUDA code for quantize_rows (what the vLLM plugin's compiled W2A8 layers run)
    gives the CPU reference's bits on two million values: its fp32 divisions would not (Triton's
    `/` is approximate), its fp64 ones do."""
    from ternop.activations import quantize_rows

    x = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(0)) * 5
    x[2] = 0
    torch._dynamo.reset()
    q, s = torch.compile(quantize_rows, fullgraph=True, dynamic=True)(x.cuda())
    q_ref, s_ref = quantize_rows(x)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu(), q_ref), int((q.cpu() != q_ref).sum())
