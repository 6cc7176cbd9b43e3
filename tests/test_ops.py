import os

import numpy as np
import pytest
import torch

import ternop
from ternop import backends, cpu, layouts
from tests.reference import (
    assert_within_2x_of_dense,
    linear_a8_fp64,
    linear_a8_row_scales_np,
    quantize_rows_np,
    random_packed,
    unpack_layout_values,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def _check_2x_rule(x, packed, scale, bias=None):
    """Error vs the fp64 oracle is at most 2x that of F.linear on dequantized weights in x's dtype."""
    y = ternop.linear(x, packed, scale, bias)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], packed.shape[0])
    assert_within_2x_of_dense(y, x, packed, scale, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 257])
def test_linear_numerics_2d(dtype, m):
    packed, scale = random_packed(136, 384)
    x = torch.randn(m, 384).to(dtype)
    _check_2x_rule(x, packed, scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_numerics_3d_bias_noncontiguous(dtype):
    packed, scale = random_packed(64, 256)
    bias = torch.randn(128).to(dtype)[::2]  # a strided bias must be read by its stride
    x3 = torch.randn(2, 5, 256).to(dtype)
    _check_2x_rule(x3, packed, scale, bias)
    x_nc = torch.randn(512, 7).to(dtype).t()[:, ::2]  # [7, 256], strides (1, 14)
    assert not x_nc.is_contiguous()
    _check_2x_rule(x_nc, packed, scale, bias)
    assert torch.equal(ternop.linear(x_nc, packed, scale, bias), ternop.linear(x_nc.contiguous(), packed, scale, bias))


def test_linear_empty_m():
    packed, scale = random_packed(16, 128)
    y = ternop.linear(torch.randn(0, 3, 128), packed, scale)
    assert y.shape == (0, 3, 16)


def test_linear_1d_input():
    packed, scale = random_packed(16, 128)
    x = torch.randn(128)
    y = ternop.linear(x, packed, scale)
    assert y.shape == (16,)
    assert torch.allclose(y, ternop.linear(x[None], packed, scale)[0])


def test_linear_reserved_code_reads_as_zero():
    packed, scale = random_packed(16, 128)
    x = torch.randn(4, 128)
    zeroed = packed.clone()
    zeroed[3, 7] = 0
    corrupt = packed.clone()
    corrupt[3, 7] = 0xFF
    assert torch.equal(ternop.linear(x, corrupt, scale), ternop.linear(x, zeroed, scale))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 256), (3, 256), (257, 256), (2, 3, 256), "noncontiguous"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_opcheck_cpu(dtype, shape, with_bias):
    packed, scale = random_packed(40, 256)
    if shape == "noncontiguous":
        x = torch.randn(256, 6).to(dtype).t()
    else:
        x = torch.randn(*shape).to(dtype)
    bias = torch.randn(40).to(dtype) if with_bias else None
    torch.library.opcheck(torch.ops.ternop.linear.default, (x, packed, scale, bias))


def test_linear_cpu_memory_is_bounded(monkeypatch):
    # A 14336 x 4096 layer with M=1 must never dequantize the whole fp32 matrix (235 MB).
    seen = []
    real = cpu.dequantize

    def spy(wp, ws, dtype):  # noqa: ANN001
        seen.append(wp.shape[0] * wp.shape[1] * 4)
        return real(wp, ws, dtype)

    monkeypatch.setattr(cpu, "dequantize", spy)
    packed = torch.zeros((14336, 1024), dtype=torch.uint8)
    scale = torch.ones((14336, 32), dtype=torch.float16)
    y = ternop.linear(torch.randn(1, 4096), packed, scale)
    assert y.shape == (1, 14336)
    assert sum(seen) == 14336 * 4096
    assert max(seen) * 4 <= 16 * 2**20


_GOOD = dict(n=16, k=256)


def _args(**over):
    packed, scale = random_packed(_GOOD["n"], _GOOD["k"])
    args = dict(x=torch.randn(3, _GOOD["k"]), weight_packed=packed, weight_scale=scale, bias=None)
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(x=torch.randint(0, 3, (3, 256))), "x must be float16, bfloat16 or float32, got torch.int64"),
        (dict(x=torch.tensor(1.0)), "x must have at least 1 dimension"),
        (dict(x=torch.randn(3, 384)), r"x has K=384 .* holds K=256"),
        (dict(weight_packed=torch.zeros(16, 64, dtype=torch.int8)), "weight_packed must be uint8"),
        (dict(weight_packed=torch.zeros(16, 64, 1, dtype=torch.uint8)), "weight_packed must be 2-D"),
        (dict(weight_packed=torch.zeros(16, 48, dtype=torch.uint8), x=torch.randn(3, 192)), "K=192 must be a multiple of 128"),
        (dict(weight_packed=torch.zeros(0, 64, dtype=torch.uint8)), "weight_packed is empty"),
        (dict(weight_scale=torch.ones(16, 2)), "weight_scale must be float16"),
        (dict(weight_scale=torch.ones(15, 2, dtype=torch.float16)), r"weight_scale must have shape \[N, K/128\] = \[16, 2\] \(or \[16, 1\], a scale per row\), got \[15, 2\]"),
        (dict(weight_scale=torch.ones(16, 3, dtype=torch.float16)), r"= \[16, 2\] \(or \[16, 1\], a scale per row\), got \[16, 3\]"),
        (dict(bias=torch.randn(15)), r"bias must have shape \[N\] = \[16\]"),
        (dict(bias=torch.randn(16, dtype=torch.float16)), "bias must have x's dtype torch.float32"),
        (dict(x=torch.randn(3, 256, device="meta")), "all tensors must be on one device"),
        (dict(activation_bits=4), "activation_bits must be 16 or 8, got 4"),
        (dict(layout="v2"), "layout must be one of v1, a16, a8, got 'v2'"),
    ],
)
def test_linear_errors_name_the_argument(over, message):
    with pytest.raises(RuntimeError, match=message):
        ternop.linear(**_args(**over))


def test_linear_backward_is_an_error():
    packed, scale = random_packed(8, 128)
    x = torch.randn(2, 128, requires_grad=True)
    y = ternop.linear(x, packed, scale)
    with pytest.raises(RuntimeError, match="inference-only"):
        y.sum().backward()


def test_backend_forced_and_explained(monkeypatch):
    packed, scale = random_packed(8, 128)
    x = torch.randn(2, 128)
    monkeypatch.setenv("TERNOP_BACKEND", "cpu")
    call = backends.LinearCall(x, packed, scale, None)
    assert torch.equal(ternop.linear(x, packed, scale), cpu._linear_cpu(call))
    monkeypatch.setenv("TERNOP_BACKEND", "no_such_backend")
    with pytest.raises(RuntimeError, match="'no_such_backend' names no backend; registered: .*'cpu'"):
        ternop.linear(x, packed, scale)
    monkeypatch.delenv("TERNOP_BACKEND")
    assert ("cpu", True, "") in backends.explain(call)


def test_forcing_sets_the_backend_for_a_block_and_restores_it(monkeypatch):
    """backends.forcing(name) is TERNOP_BACKEND=name inside the block; after it, the variable is
    what it was before (set or unset), also when the block raises."""
    packed, scale = random_packed(8, 128)
    x = torch.randn(2, 128)
    monkeypatch.delenv("TERNOP_BACKEND", raising=False)
    with backends.forcing("no_such_backend"):
        with pytest.raises(RuntimeError, match="'no_such_backend' names no backend"):
            ternop.linear(x, packed, scale)
    assert "TERNOP_BACKEND" not in os.environ
    ternop.linear(x, packed, scale)
    monkeypatch.setenv("TERNOP_BACKEND", "cpu")
    with pytest.raises(ValueError, match="inside"):
        with backends.forcing("other"):
            assert os.environ["TERNOP_BACKEND"] == "other"
            raise ValueError("inside")
    assert os.environ["TERNOP_BACKEND"] == "cpu"
    with backends.forcing(None):
        assert "TERNOP_BACKEND" not in os.environ
    assert os.environ["TERNOP_BACKEND"] == "cpu"


def test_backend_rejections_are_reported(monkeypatch):
    never = backends.Backend("never", "cpu", 0, lambda *a: (False, "M too large"), run=None)
    monkeypatch.setattr(backends, "_BACKENDS", {"never": never})
    monkeypatch.setattr(backends, "_ORDER", {})
    monkeypatch.setattr(backends, "_CHOICE", {})
    packed, scale = random_packed(8, 128)
    with pytest.raises(RuntimeError, match="no backend can run x \\(2, 128\\).*never: M too large"):
        ternop.linear(torch.randn(2, 128), packed, scale)


def test_backend_skipped_by_name(monkeypatch):
    """TERNOP_SKIP_BACKENDS takes a backend out of the walk: the next one runs, or the call
    fails naming the skip; an unknown name is an error, not a silent no-op."""
    first = backends.Backend("first", "cpu", 0, lambda *a: (True, ""), run=lambda call: call.x * 0 + 1)
    second = backends.Backend("second", "cpu", 1, lambda *a: (True, ""), run=lambda call: call.x * 0 + 2)
    monkeypatch.setattr(backends, "_BACKENDS", {"first": first, "second": second})
    monkeypatch.setattr(backends, "_ORDER", {})
    packed, scale = random_packed(8, 128)
    x = torch.randn(2, 128)
    call = backends.LinearCall(x, packed, scale, None)
    for skip, want in (("", "first"), ("first", "second"), (" second , first", None), ("third", "unknown")):
        monkeypatch.setattr(backends, "_CHOICE", {})
        monkeypatch.setenv("TERNOP_SKIP_BACKENDS", skip)
        if want == "unknown":
            with pytest.raises(RuntimeError, match="TERNOP_SKIP_BACKENDS names no backend \\['third'\\]"):
                backends.select(call)
        elif want is None:
            with pytest.raises(RuntimeError, match="first: skipped .*second: skipped"):
                backends.select(call)
        else:
            assert backends.select(call).name == want


# --- kernel layouts --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_layouts_repack_matches_the_spec(layout):
    packed, _ = random_packed(24, 384, reserved=True)
    repacked = layouts.repack(packed, layout)
    assert repacked.shape == packed.shape and repacked.dtype == torch.uint8
    np.testing.assert_array_equal(unpack_layout_values(repacked, layout), unpack_layout_values(packed, "v1"))
    back = layouts.to_v1(repacked, layout)
    np.testing.assert_array_equal(unpack_layout_values(back, "v1"), unpack_layout_values(packed, "v1"))


def test_layouts_golden_word():
    # One word, k = 0..15 holding the values of codes 0b01 (k even) and 0b10 (k odd):
    # v = +1, -1, +1, -1, ...
    codes = torch.tensor([[1, 2] * 8], dtype=torch.uint8)
    v1 = ternop.pack_codes(codes)
    assert v1.tolist() == [[0x99, 0x99, 0x99, 0x99]]
    # a16: field p < 8 holds k = 2p (v = +1, u = 2), field p >= 8 holds k = 2(p-8)+1 (u = 0).
    assert layouts.repack(v1, "a16").tolist() == [[0xAA, 0xAA, 0x00, 0x00]]
    # a8: fields 0, 1, 2, 3 hold k = 0, 4, 1, 5 (codes 01, 01, 10, 10), and so on: 0xA5 per byte.
    assert layouts.repack(v1, "a8").tolist() == [[0xA5, 0xA5, 0xA5, 0xA5]]


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_layouts_match_v1(layout, dtype):
    packed, scale = random_packed(40, 256, reserved=True)
    x = torch.randn(3, 256).to(dtype)
    bias = torch.randn(40).to(dtype)
    want = ternop.linear(x, packed, scale, bias)
    assert torch.equal(ternop.linear(x, layouts.repack(packed, layout), scale, bias, layout=layout), want)


def test_layouts_errors():
    with pytest.raises(ValueError, match="unknown weight layout 'v2'"):
        layouts.repack(torch.zeros(2, 32, dtype=torch.uint8), "v2")
    with pytest.raises(ternop.FormatError, match="must be uint8"):
        layouts.repack(torch.zeros(2, 32, dtype=torch.int8), "a16")
    assert layouts.preferred_layout(16, "cpu") == "v1"
    assert layouts.preferred_layout(8, "cuda") == "a8" and layouts.preferred_layout(16, "cuda") == "a16"
    with pytest.raises(ValueError, match="activation_bits must be 8 or 16"):
        layouts.preferred_layout(4, "cpu")


# --- W2A8 -------------------------------------------------------------------------------------


def test_quantize_rows_matches_the_spec():
    from ternop.activations import quantize_rows

    # Two million values: enough that a reciprocal-times-127 in place of the IEEE division
    # 127 / amax changes some rounding (it changed 2 of them here before the fix).
    x = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(0)) * 5
    x[2] = 0  # an all-zero row quantizes to zeros with scale 0
    x[4, 7] = 1e-30
    q, s = quantize_rows(x)
    q_np, s_np = quantize_rows_np(x)
    np.testing.assert_array_equal(q.numpy(), q_np)
    np.testing.assert_array_equal(s.numpy(), s_np)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and int(q.abs().max()) == 127
    assert float(s[2]) == 0 and int(q[2].abs().max()) == 0


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_a8_matches_the_spec(layout, dtype):
    packed, scale = random_packed(72, 384, reserved=True)
    packed = layouts.repack(packed, layout)
    x = torch.randn(2, 3, 384).to(dtype)
    bias = torch.randn(72).to(dtype)
    y = ternop.linear(x, packed, scale, bias, activation_bits=8, layout=layout)
    ref = linear_a8_fp64(x, packed, scale, bias, layout)
    assert y.dtype == dtype and y.shape == (2, 3, 72)
    # Only the fp32 adds of the block terms and the final rounding to x's dtype differ.
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert _rel_err(y, ref) <= tol


def test_linear_a8_differs_from_a16_by_the_rounding_of_x():
    packed, scale = random_packed(64, 512)
    x = torch.randn(5, 512)
    a16, a8 = ternop.linear(x, packed, scale), ternop.linear(x, packed, scale, activation_bits=8)
    err = _rel_err(a8, a16.double())
    assert 1e-4 < err < 2e-2  # int8 rounding of x: visible, but small


# --- one scale per row ---------------------------------------------------------------------------


def _row_scaled(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed, _ = random_packed(n, k, generator=g, reserved=True)
    row = (torch.rand((n, 1), generator=g) * 0.1 + 0.01).to(torch.float16)
    return packed, row


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_a8_row_scales_match_the_spec_bit_for_bit(layout, dtype):
    packed, row = _row_scaled(72, 1152)
    packed = layouts.repack(packed, layout)
    x = torch.randn(2, 5, 1152).to(dtype) * 3
    bias = torch.randn(72).to(dtype)
    y = ternop.linear(x, packed, row, bias, activation_bits=8, layout=layout)
    want = torch.from_numpy(linear_a8_row_scales_np(x, packed, row, bias, layout)).to(dtype).reshape(2, 5, 72)
    assert torch.equal(y, want)


def test_linear_a8_row_scales_sum_over_all_of_k():
    """The row form is not the block form with equal scales: that one rounds after every block."""
    from ternop.format import pack_codes

    g = torch.Generator().manual_seed(1)
    # Mostly +1 weights and positive x: sums of about 2^18 that fp32 must round in both forms.
    codes = torch.where(torch.rand(64, 4096, generator=g) < 0.8, 0b01, 0b10).to(torch.uint8)
    packed = pack_codes(codes)
    row = (torch.rand((64, 1), generator=g) * 0.1 + 0.01).to(torch.float16)
    x = torch.rand(64, 4096, generator=g) + 0.5
    y_row = ternop.linear(x, packed, row, activation_bits=8)
    y_blocks = ternop.linear(x, packed, row.expand(-1, 32).contiguous(), activation_bits=8)
    assert not torch.equal(y_row, y_blocks) and _rel_err(y_row, y_blocks.double()) < 1e-6
    # One block: both forms are the same arithmetic.
    from ternop.activations import block_partials, quantize_rows, weight_values

    packed, row = _row_scaled(16, 128, seed=2)
    x = torch.randn(3, 128)
    q, sx = quantize_rows(x)
    blocks = (block_partials(q, weight_values(packed)).float() * row.float()).sum(dim=2) * sx[:, None]
    assert torch.equal(ternop.linear(x, packed, row, activation_bits=8), blocks)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_a16_row_scales_mean_their_expansion(dtype):
    packed, row = _row_scaled(40, 384, seed=3)
    x = torch.randn(3, 384).to(dtype)
    assert torch.equal(ternop.linear(x, packed, row), ternop.linear(x, packed, row.expand(-1, 3).contiguous()))


def test_row_scales_of_a_checkpoint():
    from ternop.activations import row_scales

    scale = torch.tensor([[0.5, 0.5, 0.5], [0.25, 0.25, 0.25]], dtype=torch.float16)
    assert torch.equal(row_scales(scale), scale[:, :1]) and row_scales(scale).is_contiguous()
    scale[1, 2] = 0.125
    assert row_scales(scale) is None
    # Bitwise: -0.0 is not 0.0.
    assert row_scales(torch.tensor([[0.0, -0.0]], dtype=torch.float16)) is None
    one = torch.ones(4, 1, dtype=torch.float16)
    assert row_scales(one) is one


@pytest.mark.parametrize(
    "scale_shape, k, message",
    [((8, 2), 384, r"\[N, K/128\] = \[8, 3\] \(or \[8, 1\], a scale per row\)"),
     ((8, 1), 132224, "row scales .* take K <= 132096")],
)
def test_linear_row_scale_errors(scale_shape, k, message):
    packed = torch.zeros(8, k // 4, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=message):
        ternop.linear(torch.randn(1, k), packed, torch.ones(scale_shape, dtype=torch.float16), activation_bits=8)


@pytest.mark.parametrize("bits", [16, 8])
def test_linear_opcheck_row_scales(bits):
    packed, row = _row_scaled(40, 512, seed=4)
    torch.library.opcheck(torch.ops.ternop.linear.default, (torch.randn(3, 512), packed, row, None, bits, "v1"))


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("layout", ["v1", "a8"])
def test_linear_opcheck_modes(bits, layout):
    packed, scale = random_packed(40, 256)
    packed = layouts.repack(packed, layout)
    x = torch.randn(3, 256)
    torch.library.opcheck(torch.ops.ternop.linear.default, (x, packed, scale, None, bits, layout))


def test_linear_dispatch_is_cached_per_signature():
    packed, scale = random_packed(16, 128)
    backends.clear_cache()
    ternop.linear(torch.randn(3, 128), packed, scale)
    ternop.linear(torch.randn(3, 128), packed, scale)
    assert len(backends._CHOICE) == 1
    ternop.linear(torch.randn(4, 128), packed, scale, activation_bits=8)
    ternop.linear(torch.randn(4, 128), packed, scale)
    assert len(backends._CHOICE) == 3
    # A scale per row is part of the signature: backends may take one form and not the other.
    packed, scale = random_packed(16, 256)
    backends.clear_cache()
    ternop.linear(torch.randn(3, 256), packed, scale, activation_bits=8)
    ternop.linear(torch.randn(3, 256), packed, scale[:, :1].contiguous(), activation_bits=8)
    assert len(backends._CHOICE) == 2


def _two_backends(monkeypatch, first_takes=lambda call: True):
    """Registers two CPU backends that log their runs; ``first`` (tried first) takes the calls
    that ``first_takes`` accepts. Returns the log."""
    ran = []

    def backend(name, priority, takes):
        def run(call):
            ran.append(name)
            return cpu._linear_cpu(call)

        return backends.Backend(name, "cpu", priority, lambda call: (takes(call), "declined"), run)

    monkeypatch.setattr(backends, "_BACKENDS", {"first": backend("first", 0, first_takes),
                                                "second": backend("second", 1, lambda call: True)})  # fmt: skip
    monkeypatch.setattr(backends, "_ORDER", {})
    monkeypatch.setattr(backends, "_CHOICE", {})
    return ran


def test_a_call_seen_before_skips_the_checks_and_runs_what_it_ran(monkeypatch):
    """The second call with the same signature goes straight to the backend the first took:
    same result, no second pass through the checks. 2-D, 3-D and 1-D x, a bias, and linear_q8."""
    from ternop import ops
    from ternop.activations import quantize_rows

    ran = _two_backends(monkeypatch)
    checked = []
    real_ok, real_q8_ok = ops.inputs_ok, ops.q8_inputs_ok
    monkeypatch.setattr(ops, "inputs_ok", lambda *a: checked.append("linear") or real_ok(*a))
    monkeypatch.setattr(ops, "q8_inputs_ok", lambda *a: checked.append("q8") or real_q8_ok(*a))
    packed, scale = random_packed(24, 256)
    bias = torch.randn(24)
    for x in (torch.randn(5, 256), torch.randn(2, 3, 256), torch.randn(256), torch.randn(4, 512)[:, 128:384]):
        want = cpu._linear_cpu(backends.LinearCall(x.reshape(-1, 256), packed, scale, bias)).view(*x.shape[:-1], 24)
        first, again = ternop.linear(x, packed, scale, bias), ternop.linear(x, packed, scale, bias)
        assert torch.equal(first, want) and torch.equal(again, want) and again.shape == (*x.shape[:-1], 24)
    assert checked == ["linear"] * 4 and ran == ["first"] * 8
    q, s = quantize_rows(torch.randn(2, 3, 256))
    want = ternop.linear_q8(q, s, packed, scale, out_dtype=torch.float32)
    assert torch.equal(ternop.linear_q8(q.clone(), s.clone(), packed, scale, out_dtype=torch.float32), want)
    assert checked[4:] == ["q8"]


def test_a_seen_call_still_obeys_a_forced_backend_and_new_registrations(monkeypatch):
    ran = _two_backends(monkeypatch)
    packed, scale = random_packed(16, 128)
    x = torch.randn(3, 128)
    ternop.linear(x, packed, scale)
    monkeypatch.setenv("TERNOP_BACKEND", "second")
    ternop.linear(x, packed, scale)
    monkeypatch.delenv("TERNOP_BACKEND")
    ternop.linear(x, packed, scale)
    assert ran == ["first", "second", "first"]
    backends.register(backends.Backend("third", "cpu", -1, lambda call: (True, ""),
                                       lambda call: ran.append("third") or cpu._linear_cpu(call)))  # fmt: skip
    ternop.linear(x, packed, scale)
    assert ran[-1] == "third"


def test_a_call_unlike_a_seen_one_is_checked_and_chosen_anew(monkeypatch):
    """Same shapes as a cached call, but another dtype, bias, alignment or weight stride: the
    checks run again (a bad argument still fails naming it) and the registry chooses again."""
    ran = _two_backends(monkeypatch, first_takes=lambda call: call.x.data_ptr() % 16 == 0)
    packed, scale = random_packed(16, 256)
    x = torch.randn(3, 257)
    aligned, odd = x[:, :256], x[:, 1:]  # the same shape and strides, 4 bytes apart
    assert aligned.data_ptr() % 16 == 0
    ternop.linear(aligned, packed, scale)
    torch.testing.assert_close(ternop.linear(odd, packed, scale), ternop.linear(odd.contiguous(), packed, scale))
    assert ran == ["first", "second", "first"]
    with pytest.raises(RuntimeError, match="bias must have x.s dtype"):
        ternop.linear(aligned, packed, scale, torch.randn(16, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="weight_packed"):
        ternop.linear(aligned, packed.to(torch.int8), scale)
    y = ternop.linear(aligned.double().float().to(torch.bfloat16), packed, scale)
    assert y.dtype == torch.bfloat16


def test_calls_that_copy_are_checked_every_time(monkeypatch):
    """x strided along K, non-contiguous weights or scales and a row scale under 16-bit activations are
    copied on the way in; such calls never skip the checks, and give what their copies give."""
    from ternop import ops

    _two_backends(monkeypatch)
    checked = []
    real_ok = ops.inputs_ok
    monkeypatch.setattr(ops, "inputs_ok", lambda *a: checked.append(1) or real_ok(*a))
    packed, scale = random_packed(16, 256)
    wide_packed = torch.zeros(16, 128, dtype=torch.uint8)
    wide_packed[:, ::2] = packed
    calls = [
        (torch.randn(256, 3).t(), packed, scale),
        (torch.randn(3, 256), wide_packed[:, ::2], scale),
        (torch.randn(3, 256), packed, scale[:, :1]),
        (torch.randn(3, 256), packed, scale.t().contiguous().t()),
    ]
    for x, p, s in calls:
        want = ternop.linear(x.contiguous(), p.contiguous(), s.expand(16, 2).contiguous())
        for _ in range(2):
            assert torch.equal(ternop.linear(x, p, s), want)
    assert len(checked) == 4 * 2 + 1  # each call that copies, twice; the copies' call once (then cached)


def test_the_choice_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(backends, "MAX_CACHED_CHOICES", 3)
    monkeypatch.setattr(backends, "_CHOICE", {})
    packed, scale = random_packed(16, 128)
    for m in range(1, 9):
        x = torch.randn(m, 128)
        assert torch.equal(ternop.linear(x, packed, scale), ternop.linear(x, packed, scale))
        assert len(backends._CHOICE) <= 3


def test_linear_takes_row_strided_x_without_a_copy(monkeypatch):
    """x whose rows are strided (a slice of a wider tensor) reaches the backend as it is;
    only a K that is not the unit-stride dimension is copied."""
    seen = []
    real = backends.get("cpu")
    spy = backends.Backend("cpu", "cpu", 100, real.can_implement, lambda call: seen.append(call.x) or real.run(call))
    monkeypatch.setattr(backends, "_BACKENDS", {"cpu": spy})
    monkeypatch.setattr(backends, "_ORDER", {})
    monkeypatch.setattr(backends, "_CHOICE", {})
    packed, scale = random_packed(16, 256)
    wide = torch.randn(5, 512)
    y = ternop.linear(wide[:, 128:384], packed, scale)
    assert seen[-1].data_ptr() == wide[:, 128:].data_ptr() and seen[-1].stride() == (512, 1)
    assert torch.equal(y, ternop.linear(wide[:, 128:384].contiguous(), packed, scale))
    ternop.linear(torch.randn(256, 5).t(), packed, scale)  # K strided: copied
    assert seen[-1].is_contiguous()


def test_cuda_op_schemas_and_fake_kernels_exist_without_a_gpu():
    """The C++ kernels' ops are defined in Python with fake kernels, so they trace (and fail
    clearly) whether or not the extension was built."""
    from ternop.cuda import cpp_ops

    meta = dict(device="meta")
    w = torch.empty(64, 64, dtype=torch.uint8, **meta)
    s = torch.empty(64, 2, dtype=torch.float16, **meta)
    y = torch.ops.ternop.linear_cuda_mma(torch.empty(3, 256, dtype=torch.bfloat16, **meta), w, s, None, True)
    assert y.shape == (3, 64) and y.dtype == torch.bfloat16
    q = torch.empty(5, 256, dtype=torch.int8, **meta)
    y = torch.ops.ternop.linear_cuda_mma_a8(q, torch.empty(5, **meta), w, s, None, torch.float16)
    assert y.shape == (5, 64) and y.dtype == torch.float16
    y = torch.ops.ternop.linear_cuda_mma_a8_fused(torch.empty(2, 256, dtype=torch.float32, **meta), w, s)
    assert y.shape == (2, 64) and y.dtype == torch.float32
    # The small-M ops' row_groups and depth, by name (the benchmarks pass them).
    y = torch.ops.ternop.linear_cuda_mma(torch.empty(3, 256, dtype=torch.bfloat16, **meta), w, s, None, True,
                                         row_groups=2, depth=4)  # fmt: skip
    assert y.shape == (3, 64)
    y = torch.ops.ternop.linear_cuda_mma_a8(q, torch.empty(5, **meta), w, s, None, torch.float16, row_groups=1, depth=4)
    assert y.shape == (5, 64)
    y = torch.ops.ternop.linear_cuda_dequant(torch.empty(700, 256, dtype=torch.float16, **meta), w, s, None, 1)
    assert y.shape == (700, 64) and y.dtype == torch.float16
    with pytest.raises(RuntimeError, match="does not hold K=128"):
        torch.ops.ternop.linear_cuda(torch.empty(3, 128, **meta), w, s)
    w8 = torch.ops.ternop.decode_int8_cuda(w, 2)
    assert w8.shape == (64, 256) and w8.dtype == torch.int8
    if not torch.cuda.is_available():
        assert not any(cpp_ops.has_kernel(op) for op in cpp_ops.OPS)


# --- ternop::linear_q8: the W2A8 product from already quantized rows ---------------------------


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [False, True], ids=["block-scales", "row-scales"])
def test_linear_q8_is_linear_a8_bit_for_bit(layout, dtype, rows):
    """linear_q8(*quantize_rows(x)) is linear(x, activation_bits=8): same backend arithmetic,
    the quantization moved out of the op. Leading dims, strided q, a bias."""
    from ternop.activations import quantize_rows

    packed, scale = random_packed(72, 384, reserved=True)
    packed = layouts.repack(packed, layout)
    if rows:
        scale = scale[:, :1].contiguous()
    x = torch.randn(2, 3, 384).to(dtype)
    bias = torch.randn(72).to(dtype)
    q, s = quantize_rows(x)
    assert q.shape == (2, 3, 384) and s.shape == (2, 3)
    want = ternop.linear(x, packed, scale, bias, activation_bits=8, layout=layout)
    got = ternop.linear_q8(q, s, packed, scale, bias, out_dtype=dtype, layout=layout)
    assert got.dtype == dtype and torch.equal(got, want)
    wide = torch.zeros(6, 512, dtype=torch.int8)
    wide[:, :384] = q.reshape(6, 384)
    strided = ternop.linear_q8(wide[:, :384], s.reshape(6), packed, scale, bias, out_dtype=dtype, layout=layout)
    assert torch.equal(strided, want.reshape(6, 72))
    assert ternop.linear_q8(q[:0], s[:0], packed, scale, out_dtype=dtype, layout=layout).shape == (0, 3, 72)


def test_linear_q8_opcheck_and_fake():
    from ternop.activations import quantize_rows

    packed, scale = random_packed(40, 256)
    q, s = quantize_rows(torch.randn(5, 256))
    bias = torch.randn(40, dtype=torch.bfloat16)
    for args in [(q, s, packed, scale, bias, torch.bfloat16, "v1"), (q, s, packed, scale[:, :1], None, torch.float32, "v1")]:
        torch.library.opcheck(torch.ops.ternop.linear_q8.default, args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.ternop.linear_q8(mode.from_tensor(q), mode.from_tensor(s), mode.from_tensor(packed),
                                          mode.from_tensor(scale), None, torch.float16)  # fmt: skip
    assert fake.shape == (5, 40) and fake.dtype == torch.float16


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(q=torch.zeros(5, 256)), "q must be int8"),
        (dict(s=torch.zeros(5, dtype=torch.float16)), "x_scale must be float32"),
        (dict(s=torch.zeros(4)), r"x_scale must have q's leading shape \[5\], got \[4\]"),
        (dict(out_dtype=torch.int8), "out_dtype must be float16, bfloat16 or float32"),
        (dict(bias=torch.zeros(40, dtype=torch.float16)), "bias must have out_dtype torch.float32"),
        (dict(q=torch.zeros(5, 384, dtype=torch.int8)), "q has K=384 in its last dimension"),
        (dict(layout="v2"), "layout must be one of v1, a16, a8"),
    ],
)
def test_linear_q8_errors_name_the_argument(over, message):
    packed, scale = random_packed(40, 256)
    args = dict(q=torch.zeros(5, 256, dtype=torch.int8), s=torch.ones(5), bias=None, out_dtype=torch.float32,
                layout="v1")  # fmt: skip
    args.update(over)
    from ternop.meta import q8_inputs_ok

    assert not q8_inputs_ok(args["q"], args["s"], packed, scale, args["bias"], args["out_dtype"], args["layout"])
    assert q8_inputs_ok(torch.zeros(5, 256, dtype=torch.int8), torch.ones(5), packed, scale, None, torch.float32)
    with pytest.raises(RuntimeError, match=f"ternop.linear_q8: {message}"):
        ternop.linear_q8(args["q"], args["s"], packed, scale, args["bias"], out_dtype=args["out_dtype"],
                         layout=args["layout"])  # fmt: skip


def test_linear_q8_has_no_backward():
    packed, scale = random_packed(40, 256)
    s = torch.ones(5, requires_grad=True)
    y = ternop.linear_q8(torch.zeros(5, 256, dtype=torch.int8), s, packed, scale, out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="inference-only"):
        y.sum().backward()
