import expecttest
import torch
from torch import nn
from torch.fx.node import _get_qualified_name

import ternop
from ternop import TernaryLinear
from tests.reference import random_packed


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = TernaryLinear(256, 384, bias=True)
        self.down = TernaryLinear(384, 128, bias=False)
        for layer in (self.up, self.down):
            packed, scale = random_packed(layer.out_features, layer.in_features)
            layer.weight_packed.copy_(packed)
            layer.weight_scale.copy_(scale)
        self.up.bias.normal_()

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_compile_fullgraph_dynamic_two_m():
    torch._dynamo.reset()
    model = TwoLayer().eval()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for m in (3, 17):
            x = torch.randn(2, m, 256)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    explanation = torch._dynamo.explain(model)(torch.randn(5, 256))
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1


def test_compile_one_trace_serves_many_m():
    # Like vLLM: one trace with a symbolic M; later sizes must not recompile or reuse a fixed M.
    torch._dynamo.reset()
    counts = {"compiles": 0}

    def backend(gm, example_inputs):
        counts["compiles"] += 1
        return gm.forward

    model = TwoLayer().eval()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for m in (2, 9, 300):
            x = torch.randn(m, 256)
            torch.testing.assert_close(compiled(x), model(x))
    assert counts["compiles"] == 1


class TestExpected(expecttest.TestCase):
    def test_schema(self):
        self.assertExpectedInline(
            str(torch.ops.ternop.linear.default._schema),
            """ternop::linear(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None, int activation_bits=16, str layout="v1") -> Tensor""",
        )

    def test_traced_graph(self):
        torch._dynamo.reset()
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        model = TwoLayer().eval()
        with torch.no_grad():
            torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 256))
        ops = [
            f"{node.op} {_get_qualified_name(node.target)}"
            for node in graphs[0].graph.nodes
            if node.op == "call_function"
        ]
        self.assertExpectedInline(
            "\n".join(ops),
            """\
call_function torch.ops.ternop.linear
call_function torch.relu
call_function torch.ops.ternop.linear""",
        )


def test_ternary_linear_module_matches_dense():
    model = TwoLayer().eval()
    x = torch.randn(4, 256)
    up_w = ternop.dequantize(model.up.weight_packed, model.up.weight_scale)
    down_w = ternop.dequantize(model.down.weight_packed, model.down.weight_scale)
    ref = torch.relu(x @ up_w.T + model.up.bias) @ down_w.T
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)


def test_compiled_quantization_fuses_before_linear_q8_with_the_same_bits():
    """The vLLM plugin's compiled W2A8 path: an RMSNorm, the plain-torch per-token quantization,
    then ternop::linear_q8. Inductor compiles the norm and the quantization into its own code
    (no ternop::linear is left to quantize inside). Given the same x, the compiled quantization
    and product equal the eager ``ternop.linear(x, activation_bits=8)`` bit for bit, for two M
    from one dynamic trace, and the compiled quantization matches the spec's numpy form on half
    a million values, its fp64 divisions included. (Through a norm, only the norm's own
    rounding under Inductor may differ from eager.)"""
    import numpy as np
    from torch._inductor.utils import run_and_get_code

    from ternop.activations import quantize_rows
    from tests.reference import quantize_rows_np

    packed, scale = random_packed(96, 384)
    row = scale[:, :1].contiguous()
    weight = torch.randn(384)

    def q8(x):
        return ternop.linear_q8(*quantize_rows(x), packed, row, out_dtype=x.dtype)

    def rms_q8(x):
        return q8(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight)

    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(q8, fullgraph=True, dynamic=True)
        for m in (7, 33):
            x = torch.randn(m, 384) * 3
            assert torch.equal(compiled(x), ternop.linear(x, packed, row, activation_bits=8)), m
        x = torch.randn(7, 384)
        got, code = run_and_get_code(torch.compile(rms_q8, fullgraph=True, dynamic=True), x)
        assert torch.allclose(got, rms_q8(x), rtol=1e-2, atol=1e-2)
        text = "\n".join(code)
        assert "linear_q8" in text and "ternop.linear.default" not in text
        big = torch.randn(512, 1024, generator=torch.Generator().manual_seed(1)) * 5
        big[3] = 0
        q, s = torch.compile(quantize_rows, fullgraph=True, dynamic=True)(big)
        q_np, s_np = quantize_rows_np(big)
        np.testing.assert_array_equal(q.numpy(), q_np)
        np.testing.assert_array_equal(s.numpy(), s_np)


def test_compiled_a8_ternary_linear_quantizes_in_the_graph():
    """TernaryLinear with activation_bits=8 under torch.compile quantizes x in the graph and calls
    ternop::linear_q8; the model's output is eager's, bit for bit."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = TwoLayer().eval()
    for layer in (model.up, model.down):
        layer.activation_bits = 8
    with torch.no_grad():
        x = torch.randn(5, 256)
        got, code = run_and_get_code(torch.compile(model, fullgraph=True, dynamic=True), x)
        assert torch.equal(got, model(x))
    text = "\n".join(code)
    assert text.count("linear_q8") >= 2 and "ternop.linear.default" not in text
