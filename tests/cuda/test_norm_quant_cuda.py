"""``ternop::rms_norm_quant`` on the GPU against the CPU reference (``ternop/norm_quant.py``)."""

from __future__ import annotations

import pytest
import torch

import ternop.norm_quant as nq
from tests.reference import exact_sum_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("m,d,act", [(1, 2560, "none"), (16, 6912, "relu2_glu"), (7, 100, "none"), (33, 640, "relu2_glu")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_exact_sums_give_the_references_bits(m, d, act, dtype):
    x, w = exact_sum_rows(m, d, act, dtype, torch.Generator().manual_seed(m + d))
    want = nq.reference(x, w, 1e-5, act)
    got = torch.ops.ternop.rms_norm_quant(x.cuda(), w.cuda(), 1e-5, act)
    assert got[0].dtype == torch.int8 and got[1].dtype == torch.float32
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("shape,d,act", [((1, 2560), 2560, "none"), ((16, 13824), 6912, "relu2_glu"),
                                         ((2, 3, 1024), 1024, "none"), ((300, 2048), 1024, "relu2_glu"),
                                         ((3, 8448), 8448, "none")])  # fmt: skip
def test_random_rows_within_the_sum_order(shape, d, act):
    # Random bf16: the sum of squares may round differently in another order, which can move a
    # normalized value by one bf16 step and its int8 code by one. D = 8448 runs the torch ops.
    torch.manual_seed(0)
    x = torch.randn(shape).to(torch.bfloat16) * 4
    w = (torch.rand(d) + 0.5).to(torch.bfloat16)
    q_ref, s_ref = nq.reference(x, w, 1e-6, act)
    q, s = torch.ops.ternop.rms_norm_quant(x.cuda(), w.cuda(), 1e-6, act)
    assert q.shape == (*shape[:-1], d) and s.shape == shape[:-1]
    diff = (q.cpu().int() - q_ref.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3
    assert torch.allclose(s.cpu(), s_ref, rtol=2**-7, atol=0)


@pytest.mark.parametrize("m,d", [(1, 2560), (16, 2560), (5, 100), (257, 4096)])
def test_add_variant_exact_sums_give_the_references_bits(m, d):
    g = torch.Generator().manual_seed(m * d)
    x, r = ((torch.randint(-8, 9, (m, d), generator=g) / 8).to(torch.bfloat16) for _ in range(2))
    w = (torch.randint(1, 9, (d,), generator=g) / 4).to(torch.bfloat16)
    want = nq.add_reference(x, r, w, 1e-5)
    got = torch.ops.ternop.add_rms_norm_quant(x.cuda(), r.cuda(), w.cuda(), 1e-5)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)


def test_add_variant_random_rows_within_the_sum_order():
    torch.manual_seed(1)
    x, r = (torch.randn(2, 9, 2560).to(torch.bfloat16) * 4 for _ in range(2))
    w = (torch.rand(2560) + 0.5).to(torch.bfloat16)
    q_ref, s_ref, h_ref = nq.add_reference(x, r, w, 1e-6)
    q, s, h = torch.ops.ternop.add_rms_norm_quant(x.cuda(), r.cuda(), w.cuda(), 1e-6)
    assert torch.equal(h.cpu(), h_ref)
    diff = (q.cpu().int() - q_ref.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3
    assert torch.allclose(s.cpu(), s_ref, rtol=2**-7, atol=0)


def test_strided_rows_and_capture_and_compile():
    d = 512
    base = torch.randn(9, 2 * d + 64, device="cuda").to(torch.bfloat16)
    x = base[:, : 2 * d]  # rows with a stride longer than the row
    w = (torch.rand(d, device="cuda") + 0.5).to(torch.bfloat16)
    want = torch.ops.ternop.rms_norm_quant(x.contiguous(), w, 1e-6, "relu2_glu")
    got = torch.ops.ternop.rms_norm_quant(x, w, 1e-6, "relu2_glu")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    graph = torch.cuda.CUDAGraph()
    torch.ops.ternop.rms_norm_quant(x, w, 1e-6, "relu2_glu")  # warm-up outside the capture
    with torch.cuda.graph(graph):
        out = torch.ops.ternop.rms_norm_quant(x, w, 1e-6, "relu2_glu")
    graph.replay()
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    compiled = torch.compile(lambda t: nq.rms_norm_quant(t, w, 1e-6, "relu2_glu"), fullgraph=True, dynamic=True)
    got = compiled(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
