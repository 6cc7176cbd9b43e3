"""The chunked path of ternop::linear_cuda_dequant: the weight dequantized a chunk of rows at a
time on a side stream, under cuBLAS GEMMs that write the output columns in place.

Skipped without a CUDA device. ``_chunks`` restates the policy of ``dequant_chunking`` in
``csrc/linear_cuda.cpp``; the profiler test counts the dequantization launches against it,
so a change to one without the other fails here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ternop
from ternop import backends, layouts
from ternop.layouts import LAYOUT_CODES
from tests.reference import random_packed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# (M, K, N) -> chunks in bf16: 5 of 1024 rows (the last 904, so the ring buffers are reused),
# 2 of 2048 (one per ring buffer), 3 of 3072 rows (the last 2856).
SHAPES = [(2048, 4096, 5000), (1024, 4096, 4096), (1536, 2048, 9000)]


def _chunks(m: int, n: int, k: int, elem: int) -> tuple[int, int]:
    """(count, rows) of dequant_chunking (csrc/linear_cuda.cpp)."""
    dense, target = n * k * elem, 8 << 20
    if m < 1024 or dense < 2 * target:
        return 1, n
    count = min((dense + target // 2) // target, 16, int(2.0 * m * n * k / 16e9))
    if count < 2:
        return 1, n
    rows = -(-(-(-n // count)) // 128) * 128
    count = -(-n // rows)
    return (count, rows) if count >= 2 else (1, n)


def _load():
    from ternop.cuda import cuda_ext

    ok, why = cuda_ext.load()
    if not ok:
        from torch.utils import cpp_extension

        if cpp_extension.CUDA_HOME is None or "disabled" in why:
            pytest.skip(why)
        pytest.fail(f"nvcc is present but the CUDA extension did not build: {why}")


def _weights(n: int, k: int, layout: str = "v1"):
    g = torch.Generator().manual_seed(n * 100003 + k)
    v1, scale = random_packed(n, k, generator=g, reserved=True)
    v1, scale = v1.cuda(), scale.cuda()
    return v1, layouts.repack(v1, layout), scale


def _op(x, packed, scale, bias, layout):
    return torch.ops.ternop.linear_cuda_dequant(x, packed, scale, bias, LAYOUT_CODES[layout])


def _assert_close(y, want):
    """cuBLAS may sum a chunk in another order than the whole GEMM (fp32 accumulation either
    way): at most one rounding step of x's dtype, relative to the largest output."""
    assert y.dtype == want.dtype and y.shape == want.shape
    tol = 1e-5 if y.dtype == torch.float32 else torch.finfo(y.dtype).eps
    diff = float((y.float() - want.float()).abs().max())
    assert diff <= tol * float(want.float().abs().max()), diff


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_equals_dequantize_then_f_linear(layout, dtype, with_bias):
    """Every layout and dtype, N not a multiple of the chunk, rows of x with a stride of 2K,
    and a strided bias."""
    _load()
    for m, k, n in SHAPES:
        assert _chunks(m, n, k, torch.tensor([], dtype=dtype).element_size())[0] >= 2
        v1, packed, scale = _weights(n, k, layout)
        x = torch.randn(m, 2 * k, device="cuda").to(dtype)[:, :k]
        bias = torch.randn(2 * n, device="cuda").to(dtype)[::2] if with_bias else None
        y = _op(x, packed, scale, bias, layout)
        _assert_close(y, F.linear(x, ternop.dequantize(v1, scale, dtype), bias))


def test_chunked_column_major_x_and_dispatcher(monkeypatch):
    """x with neither stride 1 per row (made contiguous once), and the forced backend on a
    3-D x whose 2048 rows chunk."""
    _load()
    k, n = 4096, 5000
    v1, packed, scale = _weights(n, k, "a16")
    w = ternop.dequantize(v1, scale, torch.bfloat16)
    x_cm = torch.randn(k, 2048, device="cuda", dtype=torch.bfloat16).t()  # strides (1, 2048)
    _assert_close(_op(x_cm, packed, scale, None, "a16"), F.linear(x_cm, w))
    monkeypatch.setenv(backends.ENV_BACKEND, "cuda_dequant")
    x3 = torch.randn(2, 1024, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    _assert_close(ternop.linear(x3, packed, scale, bias, layout="a16"), F.linear(x3, w, bias))


@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_writes_in_place(with_bias):
    """One dequantization launch per chunk, and no copy of x or of the output: the GEMMs
    write out[:, n0:n1] themselves. With a bias, the only copies are its C fills."""
    _load()
    m, k, n = 2048, 4096, 5000
    count, _ = _chunks(m, n, k, 2)
    _, packed, scale = _weights(n, k)
    x = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)[:, :k]
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if with_bias else None
    _op(x, packed, scale, bias, "v1")  # warm-up: cuBLAS handles, workspaces, pool streams
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        _op(x, packed, scale, bias, "v1")
        torch.cuda.synchronize()
    events = prof.events()
    launches = [e for e in events if "ternary_dequant_kernel" in e.name and e.device_type.name == "CUDA"]
    assert len(launches) == count, [e.name for e in launches]
    copies = [e.name for e in events if e.name in ("aten::copy_", "aten::clone", "aten::contiguous")]
    assert copies == (["aten::copy_"] * count if with_bias else []), copies


def test_chunked_temporary_is_the_ring():
    """The temporary is two chunks, not the whole dense weight."""
    _load()
    m, k, n = 2048, 4096, 5000
    _, rows = _chunks(m, n, k, 2)
    _, packed, scale = _weights(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    _op(x, packed, scale, None, "v1")  # warm-up: cuBLAS workspaces stay allocated afterwards
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = _op(x, packed, scale, None, "v1")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    out_bytes, ring_bytes = y.numel() * 2, 2 * rows * k * 2
    assert peak <= out_bytes + ring_bytes + (1 << 20), (peak, out_bytes, ring_bytes)
    assert peak < out_bytes + n * k * 2


@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_graph_capture_replays(with_bias):
    """The fork/join of the side stream captures; replays with new x equal eager calls."""
    _load()
    m, k, n = 2048, 4096, 5000
    _, packed, scale = _weights(n, k, "a16")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if with_bias else None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        for _ in range(2):
            _op(x, packed, scale, bias, "a16")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _op(x, packed, scale, bias, "a16")
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, _op(x, packed, scale, bias, "a16"), rtol=0, atol=0)
