import pytest
import torch
from torch import nn

import ternop
from ternop import TernaryLinear, quantize_module
from ternop.selection import should_quantize


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.query = nn.Linear(128, 128)
        self.odd = nn.Linear(100, 128)
        self.out = nn.Linear(128, 256, bias=False)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 128)
        self.layers = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(256, 10)
        self.pooler = nn.Linear(256, 256)


def test_from_linear_matches_dequantized_dense():
    linear = nn.Linear(256, 64)
    layer = TernaryLinear.from_linear(linear, method="absmean")
    packed, scale = ternop.quantize_weight(linear.weight, "absmean")
    assert torch.equal(layer.weight_packed, packed) and torch.equal(layer.weight_scale, scale)
    x = torch.randn(5, 256)
    ref = x @ ternop.dequantize(packed, scale).T + linear.bias
    torch.testing.assert_close(layer(x), ref.detach(), rtol=1e-5, atol=1e-5)
    assert set(dict(layer.named_buffers())) == {"weight_packed", "weight_scale", "bias"}
    assert list(layer.parameters()) == []


def test_ternary_linear_activation_bits_8_runs_the_w2a8_arithmetic():
    from tests.reference import linear_a8_fp64

    torch.manual_seed(3)
    linear = nn.Linear(384, 37)
    a16 = TernaryLinear.from_linear(linear)
    a8 = TernaryLinear.from_linear(linear, activation_bits=8)
    assert (a16.activation_bits, a8.activation_bits) == (16, 8) and "activation_bits=8" in repr(a8)
    x = torch.randn(2, 5, 384)
    want = linear_a8_fp64(x, a8.weight_packed, a8.weight_scale, a8.bias)
    got = a8(x)
    assert got.shape == (2, 5, 37)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, ternop.linear(x, a8.weight_packed, a8.weight_scale, a8.bias, activation_bits=8))
    assert not torch.allclose(got, a16(x), rtol=0, atol=1e-6)  # the mode is used, not ignored
    assert set(dict(a8.named_buffers())) == {"weight_packed", "weight_scale", "bias"}  # the state dict is the format's


@pytest.mark.parametrize("bits", [4, 32, "8", True, 8.0])
def test_ternary_linear_rejects_unknown_activation_bits(bits):
    with pytest.raises(ValueError, match="activation_bits"):
        TernaryLinear(128, 8, activation_bits=bits)
    with pytest.raises(ValueError, match="activation_bits"):
        quantize_module(Tiny(), activation_bits=bits)


def test_quantize_module_activation_bits_reaches_every_layer():
    model = Tiny()
    quantize_module(model, activation_bits=8)
    layers = [m for m in model.modules() if isinstance(m, TernaryLinear)]
    assert len(layers) == 4 and all(m.activation_bits == 8 for m in layers)


def test_from_linear_bf16_bias_follows_input_dtype():
    linear = nn.Linear(128, 32).to(torch.bfloat16)
    layer = TernaryLinear.from_linear(linear)
    assert layer.bias.dtype == torch.bfloat16
    assert layer(torch.randn(2, 128, dtype=torch.float16)).dtype == torch.float16


def test_quantize_module_report_and_swap():
    model = Tiny()
    report = quantize_module(model, skip=["layers.1.out"])
    assert report.quantized == ["layers.0.query", "layers.0.out", "layers.1.query"]
    assert report.skipped == {
        "layers.0.odd": "K=100 is not a multiple of 128",
        "layers.1.odd": "K=100 is not a multiple of 128",
        "layers.1.out": "matches skip pattern 'layers.1.out'",
        "lm_head": "matches skip pattern 'lm_head'",
        "pooler": "outside the transformer blocks",
    }
    assert isinstance(model.layers[0].query, TernaryLinear)
    assert type(model.layers[1].out) is nn.Linear
    dense = (128 * 128 + 256 * 128 + 128 * 128) * 4
    assert report.dense_bytes == dense
    assert report.ternary_bytes == (128 * 32 + 128 * 2) * 2 + 256 * 32 + 256 * 2
    assert "3 linear layers" in str(report)


def test_quantize_module_output_close_to_dense_for_ternary_weights():
    # Weights that are already ternary x one scale per block quantize exactly.
    model = Tiny()
    with torch.no_grad():
        w = torch.randint(-1, 2, (128, 128)).float() * 0.25
        model.layers[0].query.weight.copy_(w)
    x = torch.randn(3, 128)
    before = model.layers[0].query(x)
    quantize_module(model)
    torch.testing.assert_close(model.layers[0].query(x), before.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name, k, skip, expected",
    [
        ("model.layers.3.mlp.down_proj", 3072, (), (True, "")),
        ("encoder.layer.0.attention.self.query", 384, (), (True, "")),
        ("transformer.h.2.attn.c_proj", 768, (), (True, "")),
        ("encoder.layer.0.attention.self.query", 384, ("attention",), (False, "matches skip pattern 'attention'")),
        ("model.layers.3.mlp.down_proj", 3072, ("*.3.*",), (False, "matches skip pattern '*.3.*'")),
        ("lm_head", 4096, (), (False, "matches skip pattern 'lm_head'")),
        ("pooler.dense", 384, (), (False, "outside the transformer blocks")),
        ("model.layers.0.mlp.up_proj", 100, (), (False, "K=100 is not a multiple of 128")),
    ],
)
def test_selection_rules(name, k, skip, expected):
    assert should_quantize(name, k, skip) == expected


DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                            reason="needs a CUDA device"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ternary_linear_to_dtype_moves_the_bias_once_and_keeps_the_scales(device, dtype):
    """``module.to(dtype)`` casts the bias like a dense layer's; the scales keep their float16 bits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.reference import assert_within_2x_of_dense

    layer = TernaryLinear.from_linear(nn.Linear(256, 96)).to(device)
    assert layer.layout == ("a16" if device == "cuda" else "v1")  # the kernels' layout on a GPU
    scale = layer.weight_scale.clone()
    layer.to(dtype)
    assert layer.bias.dtype == dtype and layer.weight_scale.dtype == torch.float16
    assert torch.equal(layer.weight_scale, scale)
    assert list(layer.state_dict()) == ["weight_packed", "weight_scale", "bias"]

    class Casts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Casts.count += func is torch.ops.aten._to_copy.default
            return func(*args, **(kwargs or {}))

    x = torch.randn(7, 256, device=device, dtype=dtype)
    with Casts():
        y = layer(x)
    assert Casts.count == 0  # nothing is cast per call
    assert_within_2x_of_dense(y, x, layer.state_dict()["weight_packed"], layer.weight_scale, layer.bias)  # v1 codes


def test_quantize_module_rejects_a_skip_pattern_that_matches_nothing():
    model = Tiny()
    with pytest.raises(ValueError, match=r"skip pattern 'atention' matches no linear layer"):
        quantize_module(model, skip=["atention"])
    assert type(model.layers[0].query) is nn.Linear  # checked before anything changed


# --- kernel layouts inside TernaryLinear ------------------------------------------------------


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("layout", ["a16", "a8"])
def test_ternary_linear_in_a_kernel_layout_keeps_its_output_and_a_v1_state_dict(layout, bits):
    from ternop.layouts import repack

    v1 = TernaryLinear.from_linear(nn.Linear(384, 48), activation_bits=bits)
    layer = TernaryLinear.from_linear(nn.Linear(384, 48), activation_bits=bits)
    layer.load_state_dict(v1.state_dict())
    codes = v1.weight_packed.clone()
    assert layer.use_layout(layout) is layer and layer.layout == layout
    assert torch.equal(layer.weight_packed, repack(codes, layout))
    x = torch.randn(2, 3, 384)
    assert torch.equal(layer(x), v1(x))
    assert torch.equal(layer.state_dict()["weight_packed"], codes) and layer.layout == layout
    assert torch.equal(layer.dequantized_weight(), v1.dequantized_weight())
    # A v1 state dict loads into the layer's layout.
    other = TernaryLinear.from_linear(nn.Linear(384, 48), activation_bits=bits).use_layout(layout)
    other.load_state_dict(v1.state_dict())
    assert other.layout == layout and torch.equal(other.weight_packed, repack(codes, layout))
    assert torch.equal(other(x), v1(x))
    assert torch.equal(layer.use_layout("v1").weight_packed, codes) and f"layout={layout}" not in repr(layer)
    with pytest.raises(ValueError, match="layout"):
        layer.use_layout("a4")


def test_ternary_linear_takes_its_devices_layout_when_made_and_moved(monkeypatch):
    """from_linear and every .to() leave the codes in the layout preferred on the layer's device (on
    the CPU that is v1; here the CPU is made to prefer the GPU's layouts to see the moves)."""
    import ternop.modules

    linear = nn.Linear(256, 32)
    reference = TernaryLinear.from_linear(linear)
    x = torch.randn(5, 256)
    monkeypatch.setattr(ternop.modules, "preferred_layout", lambda bits, device: "a8" if bits == 8 else "a16")
    layer = TernaryLinear.from_linear(linear)
    assert layer.layout == "a16" and torch.equal(layer(x), reference(x))
    plain = TernaryLinear(256, 32)
    plain.load_state_dict(reference.state_dict())
    assert plain.layout == "v1"
    plain.half()
    want = ternop.linear(x.half(), reference.weight_packed, reference.weight_scale, reference.bias.half())
    assert plain.layout == "a16" and torch.equal(plain(x.half()), want)
    eight = TernaryLinear.from_linear(linear, activation_bits=8)
    assert eight.layout == "a8" and torch.equal(eight.state_dict()["weight_packed"], reference.weight_packed)
    monkeypatch.setattr(ternop.modules, "preferred_layout", lambda bits, device: "v1")
    layer.to("cpu")
    assert layer.layout == "v1" and torch.equal(layer.weight_packed, reference.weight_packed)
