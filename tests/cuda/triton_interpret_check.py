"""Runs the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1`` (run as a script).

tests/cuda/test_triton_interpret.py starts this in a subprocess, because the variable
must be set before triton is first imported and must not leak into other tests. It
calls the launchers with the raw kernels (wrap_triton refuses interpreted kernels on some
triton versions), not ``ternop::linear``, whose CPU dispatch goes to the CPU backend. Exits non-zero with a message on the first failure.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ternop  # noqa: E402
from ternop import layouts  # noqa: E402
from ternop.cuda import launch_dequant_a8, launch_fused, launch_triton, triton_kernels  # noqa: E402
from ternop.cuda.configs import DequantA8Config, FusedConfig  # noqa: E402
from tests.reference import (  # noqa: E402
    exact_sum_rows,
    linear_a8_fp64,
    linear_fp64,
    quantize_rows_np,
    random_packed,
    rms_norm_quant_np,
)


def _rel_err(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


def check(name, y, x, packed, scale, bias):
    ref = linear_fp64(x, packed, scale, bias)
    baseline = F.linear(x, ternop.dequantize(packed, scale, x.dtype), bias)
    err, base = _rel_err(y, ref), _rel_err(baseline, ref)
    ok = y.dtype == x.dtype and y.shape == (x.shape[0], packed.shape[0]) and err <= 2 * base + 1e-6
    print(f"{name}: M={x.shape[0]} K={x.shape[1]} N={packed.shape[0]} {x.dtype} rel err {err:.3g} "
          f"(F.linear {base:.3g}) {'ok' if ok else 'FAIL'}")
    return ok


def main() -> int:
    torch.manual_seed(0)
    ok = True
    # bf16 tl.dot is wrong in the interpreter (numpy has no bf16), so the GEMM's bf16 path
    # (per-block partial * scale) is exercised with fp16 x and FOLD_SCALE=False.
    for m, k, n, dtype, with_bias in [
        (1, 384, 40, torch.float16, True),
        (3, 256, 20, torch.bfloat16, False),
        (2, 128, 16, torch.float32, True),
    ]:
        packed, scale = random_packed(n, k, reserved=True)
        x = torch.randn(m, k).to(dtype)
        bias = torch.randn(n).to(dtype) if with_bias else None
        y = launch_triton.launch_gemv(triton_kernels.ternary_gemv_kernel, x, packed, scale, bias, 16, 256, 4, 1)
        ok &= check("gemv", y, x, packed, scale, bias)
    for m, k, n, dtype, with_bias in [
        (17, 384, 40, torch.float16, True),
        (5, 256, 24, torch.float32, False),
    ]:
        packed, scale = random_packed(n, k, reserved=True)
        x = torch.randn(m, k).to(dtype)
        bias = torch.randn(n).to(dtype) if with_bias else None
        y = launch_triton.launch_gemm(triton_kernels.ternary_gemm_kernel, x, packed, scale, bias, 16, 16, 2, 4, 1)
        ok &= check("gemm", y, x, packed, scale, bias)
    # The unfolded path: fp32 partial per 128-wide block times that block's scale.
    m, k, n = 9, 256, 24
    packed, scale = random_packed(n, k, reserved=True)
    x = torch.randn(m, k).to(torch.float16)
    y = torch.empty(m, n, dtype=x.dtype)
    w32 = packed.view(torch.int32)
    triton_kernels.ternary_gemm_kernel[(1 * 2,)](
        x, w32, scale, x, y, m, n, k, x.stride(0), w32.stride(0), scale.stride(0), 0, y.stride(0),
        HAS_BIAS=False, FOLD_SCALE=False, BLOCK_M=16, BLOCK_N=16, GROUP_M=1,
    )
    ok &= check("gemm unfolded", y, x, packed, scale, None)
    # Dequantization matches ternop.dequantize bit for bit in fp16 and fp32. The interpreter
    # converts fp32 -> bf16 without round-to-nearest, so bf16 is held to one bf16 ulp here.
    packed, scale = random_packed(24, 640, reserved=True)
    same = True
    for dtype in (torch.float16, torch.float32, torch.bfloat16):
        got = launch_triton.launch_dequant(triton_kernels.ternary_dequant_kernel, packed, scale, dtype, 16, 256)
        want = ternop.dequantize(packed, scale, dtype)
        if dtype == torch.bfloat16:
            same &= bool(((got.float() - want.float()).abs() <= want.float().abs() * 2**-7).all())
        else:
            same &= torch.equal(got, want)
    for layout in ("a16", "a8"):  # every layout dequantizes to the same weights
        got = launch_triton.launch_dequant(
            triton_kernels.ternary_dequant_kernel, layouts.repack(packed, layout), scale, torch.float32, 16, 256, layout
        )
        same &= torch.equal(got, ternop.dequantize(packed, scale, torch.float32))
    print(f"dequant: N=24 K=640 {'ok' if same else 'FAIL'}")
    ok &= same
    ok &= check_fused()
    ok &= check_dequant_a8()
    ok &= check_rms_norm_quant()
    return 0 if ok else 1


def check_fused() -> bool:
    """The fused kernels' plain decoders (the GPU's inline asm is checked against them there).

    bf16 arithmetic is wrong in the interpreter, so 16-bit activations run in fp16; the tiles
    are small, split-K and the transposed product both run, x rows and the bias are strided.
    """
    ok = True
    C = FusedConfig
    for m, k, n, layout, config in [
        (5, 256, 48, "v1", C(16, 16)),
        (20, 384, 40, "a16", C(16, 32, swap=True)),
        (33, 512, 24, "a8", C(16, 16, max_split_k=4)),
    ]:
        packed, scale = random_packed(n, k, reserved=layout != "a16")
        repacked = layouts.repack(packed, layout)
        x = torch.randn(m, 2 * k).to(torch.float16)[:, :k]
        bias = torch.randn(2 * n).to(torch.float16)[::2]
        y = launch_fused.linear_a16(x, repacked, scale, bias, layout, config)
        ok &= check(f"fused a16 [{layout}]", y, x, packed, scale, bias)
    q_ok = True
    for m, k, n, layout, dtype, config in [
        (7, 256, 40, "a8", torch.float32, C(16, 16)),
        (33, 512, 24, "v1", torch.float16, C(16, 16, max_split_k=4)),
        (3, 384, 20, "a16", torch.float32, C(16, 16)),
    ]:
        packed, scale = layouts.repack(random_packed(n, k)[0], layout), random_packed(n, k)[1]
        x = torch.randn(m, k).to(dtype)
        bias = torch.randn(2 * n).to(dtype)[::2]
        y = launch_fused.linear_a8(x, packed, scale, bias, layout, config)
        ref = linear_a8_fp64(x, packed, scale, bias, layout)
        err = _rel_err(y, ref)
        good = y.dtype == dtype and err <= (1e-6 if dtype == torch.float32 else 1e-3)
        print(f"fused a8 [{layout}]: M={m} K={k} N={n} {dtype} rel err {err:.3g} {'ok' if good else 'FAIL'}")
        ok &= good
        q, s = launch_fused.quantize_rows(x)
        q_np, s_np = quantize_rows_np(x)
        q_ok &= bool((q.numpy() == q_np).all() and (s.numpy() == s_np).all())
    # With one power-of-two scale and fp32 x every step after the int32 partials is exact, so a
    # split-K launch must equal the CPU reference bit for bit: the token scale multiplies the
    # sum of the slices once, as the spec says.
    packed = layouts.repack(random_packed(24, 1024)[0], "a8")
    scale = torch.full((24, 8), 2.0**-6, dtype=torch.float16)
    x = torch.randn(3, 1024)
    y = launch_fused.linear_a8(x, packed, scale, None, "a8", C(16, 16, max_split_k=4))
    exact = torch.equal(y, ternop.linear(x, packed, scale, activation_bits=8, layout="a8"))
    print(f"fused a8 split-K: bit for bit {'ok' if exact else 'FAIL'}")
    ok &= exact
    # One scale per row: the int32 sums run over all of K; no freedom, so bit for bit, with and
    # without split-K, with a bias.
    for splits in (1, 4):
        packed = layouts.repack(random_packed(24, 1024)[0], "a8")
        row = (torch.rand(24, 1) * 0.1 + 0.01).to(torch.float16)
        x, bias = torch.randn(3, 1024), torch.randn(24)
        y = launch_fused.linear_a8(x, packed, row, bias, "a8", C(16, 16, max_split_k=splits))
        exact = torch.equal(y, ternop.linear(x, packed, row, bias, activation_bits=8, layout="a8"))
        print(f"fused a8 row scales, split-K up to {splits}: bit for bit {'ok' if exact else 'FAIL'}")
        ok &= exact
    # Rows longer than one block are read twice (absmax, then rounding).
    from ternop.cuda.triton_fused import quant_rows_kernel

    x = torch.randn(5, 384) * 3
    q = torch.empty(5, 384, dtype=torch.int8)
    s = torch.empty(5, dtype=torch.float32)
    quant_rows_kernel[(5,)](x, q, s, 384, x.stride(0), q.stride(0), BLOCK_K=128)
    q_np, s_np = quantize_rows_np(x)
    q_ok &= bool((q.numpy() == q_np).all() and (s.numpy() == s_np).all())
    print(f"quantize_rows: bit for bit {'ok' if q_ok else 'FAIL'}")
    return ok and q_ok


def check_dequant_a8() -> bool:
    """dequant_a8 (decode to int8, dense int8 GEMM) with row scales: bit for bit the CPU
    reference, every layout with reserved codes, ragged M and N, strided x, a strided bias."""
    ok = True
    for m, k, n, layout in [(37, 512, 40, "a8"), (5, 256, 24, "v1"), (19, 384, 200, "a16")]:
        packed = layouts.repack(random_packed(n, k, reserved=True)[0], layout)
        row = (torch.rand(n, 1) * 0.1 + 0.01).to(torch.float16)
        x = torch.randn(m, 2 * k)[:, :k]
        bias = torch.randn(2 * n)[::2]
        q, qs = launch_fused.quantize_rows(x)
        y = launch_dequant_a8.linear_dequant_a8(q, qs, packed, row, bias, layout, DequantA8Config(16, 16, 64, num_stages=2),
                                                x.dtype)  # fmt: skip
        exact = torch.equal(y, ternop.linear(x, packed, row, bias, activation_bits=8, layout=layout))
        print(f"dequant a8 [{layout}]: M={m} K={k} N={n} bit for bit {'ok' if exact else 'FAIL'}")
        ok &= exact
    return ok


def check_rms_norm_quant() -> bool:
    """The norm-and-quantize kernel on values whose sums of squares are exact in any order
    (tests.reference.exact_sum_rows): bit for bit NumPy's reading of the spec, a partly empty row, widths
    that are not powers of two, both acts. fp16 and fp32 (the interpreter's bf16 does not round)."""
    from ternop.cuda.triton_norm_quant import rms_norm_quant

    ok = True
    for m, d, act, dtype in [(3, 384, "none", torch.float16), (2, 200, "relu2_glu", torch.float32),
                             (4, 96, "relu2_glu", torch.float16)]:  # fmt: skip
        x, w = exact_sum_rows(m, d, act, dtype)
        q, s = rms_norm_quant(x, w, 1e-5, act)
        q_np, s_np = rms_norm_quant_np(x, w, 1e-5, act)
        exact = bool((q.numpy() == q_np).all() and (s.numpy() == s_np).all() and (q != 0).any())
        print(f"rms_norm_quant [{act}]: M={m} D={d} {x.dtype} bit for bit {'ok' if exact else 'FAIL'}")
        ok &= exact
    # With a residual: h = x + r written out, then the same norm of h.
    x = (torch.randint(-8, 9, (3, 200)) / 8).to(torch.float16)
    r = (torch.randint(-8, 9, (3, 200)) / 8).to(torch.float16)
    w = (torch.randint(1, 9, (200,)) / 4).to(torch.float16)
    q, s, h = rms_norm_quant(x, w, 1e-5, "none", r)
    q_np, s_np = rms_norm_quant_np(x + r, w, 1e-5)
    exact = bool(torch.equal(h, x + r) and (q.numpy() == q_np).all() and (s.numpy() == s_np).all())
    print(f"add_rms_norm_quant: M=3 D=200 {x.dtype} bit for bit {'ok' if exact else 'FAIL'}")
    return ok and exact


if __name__ == "__main__":
    sys.exit(main())
