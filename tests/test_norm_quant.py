"""``ternop::rms_norm_quant`` on the CPU: its reference against a NumPy reading of the spec,
the model's own ops, the input checks, and opcheck."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ternop.norm_quant as nq
from ternop.activations import quantize_rows
from tests.reference import exact_sum_rows, rms_norm_quant_np

CASES = [(3, 384, "none"), (2, 200, "relu2_glu"), (5, 96, "none"), (1, 6912, "relu2_glu")]


@pytest.mark.parametrize("m,d,act", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_reference_equals_the_spec_in_numpy(m, d, act, dtype):
    x, w = exact_sum_rows(m, d, act, dtype)
    q, s = torch.ops.ternop.rms_norm_quant(x, w, 1e-5, act)
    q_np, s_np = rms_norm_quant_np(x, w, 1e-5, act)
    assert q.dtype == torch.int8 and q.shape == (m, d) and s.dtype == torch.float32 and s.shape == (m,)
    np.testing.assert_array_equal(q.numpy().astype(np.int64), q_np)
    np.testing.assert_array_equal(s.numpy(), s_np)
    assert (q != 0).any()  # the check sees real values, not only zeros


@pytest.mark.parametrize("act", ["none", "relu2_glu"])
def test_reference_is_the_models_norm_then_quantize_rows(act):
    # What BitNet's sub-norms computed before the op: ShardedRMSNorm's arithmetic, then quantize_rows.
    torch.manual_seed(0)
    d = 256
    x = torch.randn(4, 7, 2 * d if act == "relu2_glu" else d).to(torch.bfloat16) * 3
    w = (torch.rand(d) + 0.5).to(torch.bfloat16)
    h = torch.square(torch.relu(x[..., :d])) * x[..., d:] if act == "relu2_glu" else x
    hf = h.to(torch.float32)
    want = quantize_rows(w * (hf * torch.rsqrt(hf.pow(2).sum(-1, keepdim=True) / d + 1e-6)).to(x.dtype))
    got = torch.ops.ternop.rms_norm_quant(x, w, 1e-6, act)
    assert got[0].shape == (4, 7, d) and got[1].shape == (4, 7)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_relu2_glu_rounds_as_the_spec_says(dtype):
    # Random values, whose products round: the op on [g | u] equals the op without act on
    # h = dt(dt(relu(g)^2) * u) made in NumPy from the spec.
    torch.manual_seed(1)
    d = 320
    x = (torch.randn(6, 2 * d) * 3).to(dtype)
    w = (torch.rand(d) + 0.5).to(dtype)
    dt = {torch.float16: np.float16, torch.float32: np.float32}[dtype]
    g = np.maximum(x[:, :d].numpy().astype(np.float32), 0)
    h = ((g * g).astype(dt).astype(np.float32) * x[:, d:].numpy().astype(np.float32)).astype(dt)
    got = torch.ops.ternop.rms_norm_quant(x, w, 1e-6, "relu2_glu")
    want = torch.ops.ternop.rms_norm_quant(torch.from_numpy(h), w, 1e-6, "none")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_add_variant_is_the_norm_of_the_rounded_sum(dtype):
    x, w = exact_sum_rows(4, 384, "none", dtype, torch.Generator().manual_seed(3))
    r, _ = exact_sum_rows(4, 384, "none", dtype, torch.Generator().manual_seed(4))
    q, s, h = torch.ops.ternop.add_rms_norm_quant(x.view(2, 2, 384), r.view(2, 2, 384), w, 1e-5)
    q_np, s_np = rms_norm_quant_np(x + r, w, 1e-5)
    assert h.shape == (2, 2, 384) and torch.equal(h.view(4, 384), x + r)
    np.testing.assert_array_equal(q.view(4, 384).numpy().astype(np.int64), q_np)
    np.testing.assert_array_equal(s.view(4).numpy(), s_np)


def test_add_variant_refuses_a_residual_unlike_x():
    x, w = torch.randn(2, 128), torch.ones(128)
    with pytest.raises(RuntimeError, match="residual must be like x"):
        torch.ops.ternop.add_rms_norm_quant(x, torch.randn(2, 64), w, 1e-6)
    with pytest.raises(RuntimeError, match="residual must be like x"):
        torch.ops.ternop.add_rms_norm_quant(x, x.to(torch.float16), w, 1e-6)


def test_add_variant_opcheck():
    x = torch.randn(3, 2, 128)
    torch.library.opcheck(torch.ops.ternop.add_rms_norm_quant.default, (x, torch.randn_like(x), torch.rand(128), 1e-6))


def test_zero_row_gives_zero_codes_and_scale():
    q, s = torch.ops.ternop.rms_norm_quant(torch.zeros(2, 128), torch.ones(128), 1e-6)
    assert torch.equal(q, torch.zeros(2, 128, dtype=torch.int8)) and torch.equal(s, torch.zeros(2))


@pytest.mark.parametrize(
    "x,w,act,match",
    [
        (torch.randn(2, 128), torch.ones(64), "none", "last dimension must be 64"),
        (torch.randn(2, 128), torch.ones(128), "relu2_glu", "last dimension must be 256"),
        (torch.randn(2, 128), torch.ones(128, dtype=torch.float16), "none", "weight must have x's dtype"),
        (torch.randn(2, 128), torch.ones(1, 128), "none", "weight must be 1-D"),
        (torch.randn(2, 128).to(torch.int32), torch.ones(128, dtype=torch.int32), "none", "x must be float16"),
        (torch.randn(2, 128), torch.ones(128), "gelu", "act must be one of none, relu2_glu"),
    ],
)
def test_bad_inputs_name_the_problem(x, w, act, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.ternop.rms_norm_quant(x, w, 1e-6, act)


@pytest.mark.parametrize("act", ["none", "relu2_glu"])
def test_opcheck(act):
    d = 128
    x = torch.randn(3, 2, 2 * d if act == "relu2_glu" else d)
    torch.library.opcheck(torch.ops.ternop.rms_norm_quant.default, (x, torch.rand(d) + 0.5, 1e-6, act))


def test_compiles_without_graph_breaks():
    def f(x, w):
        q, s = nq.rms_norm_quant(x * 2, w, 1e-6, "relu2_glu")
        return q, s

    x, w = torch.randn(5, 256), torch.rand(128) + 0.5
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for got, want in zip(compiled(x, w), f(x, w)):
        assert torch.equal(got, want)
