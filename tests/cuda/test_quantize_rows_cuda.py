"""``ternop::quantize_rows_cuda`` (``csrc/quantize_rows.cu``) against the spec's CPU reference,
``ternop.activations.quantize_rows``, bit for bit: every dtype, every group size the launch
picks (one warp a row up to eight, and rows longer than eight warps' registers, which are read
twice), ragged M, strided and misaligned rows, zero rows, ties, and a NaN."""

from __future__ import annotations

import pytest
import torch

from ternop import activations

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.fixture(scope="module", autouse=True)
def extension():
    from torch.utils import cpp_extension

    from ternop.cuda import cuda_ext

    ok, why = cuda_ext.load()
    if not ok:
        if cpp_extension.CUDA_HOME is None:
            pytest.skip(why)
        pytest.fail(f"nvcc is present but the CUDA extension did not build: {why}")


def _assert_spec(x: torch.Tensor):
    q, qs = torch.ops.ternop.quantize_rows_cuda(x)
    q_ref, qs_ref = activations.quantize_rows(x.cpu())
    assert q.dtype == torch.int8 and q.shape == x.shape and q.is_contiguous()
    assert qs.dtype == torch.float32 and qs.shape == x.shape[:1]
    assert torch.equal(qs.cpu(), qs_ref), (tuple(x.shape), x.dtype, "token scales differ from the spec")
    bad = (q.cpu() != q_ref).nonzero()
    assert bad.numel() == 0, (tuple(x.shape), x.dtype, len(bad), bad[:8].tolist())


# M x K: one warp a row (K <= 3072 in 16-bit), two to eight (4096, 14336), the rows past eight warps'
# registers (40960 in 16-bit, 28672 and 40960 in fp32), and the small-M launches that give each row
# more warps than its length needs.
@pytest.mark.parametrize("m,k", [(1, 128), (3, 1024), (16, 4096), (16, 14336), (257, 384), (1000, 3072),
                                 (2050, 4096), (131, 14336), (9, 40960), (70, 28672)])  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_the_spec_bit_for_bit(m, k, dtype):
    g = torch.Generator(device="cuda").manual_seed(m * 7919 + k)
    x = torch.randn(m, k, device="cuda", generator=g) * torch.rand(m, 1, device="cuda", generator=g) * 8
    _assert_spec(x.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_misaligned_and_zero_rows(dtype):
    """Rows a wider tensor apart (read in place), a view 8 bytes off alignment (copied first), an
    all-zero row (inv = 0, q = 0, s_x = 0)."""
    x = torch.randn(300, 2 * 1152, device="cuda").to(dtype)
    x[7] = 0
    _assert_spec(x[:, :1152])
    _assert_spec(x[:, 4 : 4 + 1152])
    _assert_spec(x[::3, 128 : 128 + 1024])


def test_ties_round_half_to_even():
    """Rows whose absmax is 127 have inv = 1, so x * inv is x: the halves must round to even."""
    halves = torch.arange(-126, 126, dtype=torch.float32) + 0.5
    x = torch.zeros(2, 384)
    x[:, : halves.numel()] = halves
    x[:, 300] = 127.0
    x[1] *= -1
    _assert_spec(x.cuda())
    q, _ = torch.ops.ternop.quantize_rows_cuda(x.cuda())
    assert q[0, :4].tolist() == [-126, -124, -124, -122]  # -125.5 -> -126, -124.5 -> -124, ...


def test_a_nan_makes_its_rows_scale_nan_and_leaves_the_others():
    x = torch.randn(20, 4096, device="cuda", dtype=torch.bfloat16)
    x[5, 1000] = float("nan")
    q, qs = torch.ops.ternop.quantize_rows_cuda(x)
    q_ref, qs_ref = activations.quantize_rows(x.cpu())
    assert torch.isnan(qs[5]) and torch.isnan(qs_ref[5])
    keep = torch.arange(20) != 5
    assert torch.equal(qs.cpu()[keep], qs_ref[keep]) and torch.equal(q.cpu()[keep], q_ref[keep])


def test_refuses_what_it_cannot_quantize():
    with pytest.raises(RuntimeError, match="positive multiple of 128"):
        torch.ops.ternop.quantize_rows_cuda(torch.randn(4, 100, device="cuda"))
    with pytest.raises(RuntimeError, match="float16, bfloat16 or float32"):
        torch.ops.ternop.quantize_rows_cuda(torch.zeros(4, 128, device="cuda", dtype=torch.int32))
    with pytest.raises(RuntimeError, match="2-D CUDA tensor"):
        torch.ops.ternop.quantize_rows_cuda(torch.randn(2, 4, 128, device="cuda"))
    q, qs = torch.ops.ternop.quantize_rows_cuda(torch.randn(0, 256, device="cuda"))
    assert q.shape == (0, 256) and qs.shape == (0,)


def test_the_triton_kernel_gives_the_same_bits():
    """The Triton kernel (``launch_fused.quantize_rows``) that triton_a8 and dequant_a8 still run."""
    from ternop.cuda.launch_fused import quantize_rows

    for m, k in [(5, 14336), (3000, 1024)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        q, qs = torch.ops.ternop.quantize_rows_cuda(x)
        q_t, qs_t = quantize_rows(x)
        assert torch.equal(q, q_t) and torch.equal(qs, qs_t), (m, k)
