"""The CUDA kernel of ``ternop::rms_norm_quant`` and ``ternop::add_rms_norm_quant``
(``ternop/norm_quant.py`` is their spec), and its launcher.

One program per row holds the whole row in registers: one read of x (both halves with
``relu2_glu``; x and the residual for ``ternop::add_rms_norm_quant``, whose sum it also writes),
the sum of squares, the normalization, the absmax and the rounding, then one write of the
int8 row and its scale. Each step rounds where the spec's torch ops round,
and the launch turns off fp fusion, so the only difference from the reference is the order
of the sum of squares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ternop.cuda import configs

# The widest row kept in registers (32 KiB of fp32 over 16 warps). ``ternop::rms_norm_quant`` runs
# wider rows with its reference's torch ops: slower, the same bits but for the sum's order.
MAX_D = 8192


@triton.jit
def rms_norm_quant_kernel(x_ptr, r_ptr, h_ptr, w_ptr, q_ptr, qs_ptr, D, stride_xm, stride_rm, stride_qm, eps,
                          GLU: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                          LAUNCH_DEPENDENTS: tl.constexpr = False):  # fmt: skip
    if LAUNCH_DEPENDENTS:  # the int8 GEMM after it may start now; it waits before reading q (quant_rows_kernel)
        tl.extra.cuda.gdc_launch_dependents()
    dt = x_ptr.dtype.element_ty
    m = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    row = x_ptr + m * stride_xm
    if GLU:
        g = tl.maximum(tl.load(row + offs, mask=mask, other=0.0).to(tl.float32), 0.0)
        u = tl.load(row + D + offs, mask=mask, other=0.0).to(tl.float32)
        h = (g * g).to(dt).to(tl.float32)
        h = (h * u).to(dt).to(tl.float32)
    elif RESIDUAL:  # h = dt(x + residual), also written out: the next block's residual
        h = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
        h = (h + tl.load(r_ptr + m * stride_rm + offs, mask=mask, other=0.0).to(tl.float32)).to(dt)
        tl.store(h_ptr + m * D + offs, h, mask=mask)
        h = h.to(tl.float32)
    else:
        h = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    ss = tl.sum(h * h, axis=0)
    r = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(ss, D.to(tl.float32)) + eps))
    y = (h * r).to(dt).to(tl.float32)
    y = (tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) * y).to(dt).to(tl.float32)
    a = tl.max(tl.abs(y), axis=0)
    inv = tl.where(a > 0, tl.math.div_rn(127.0, tl.where(a > 0, a, 1.0)), 0.0)
    # Round half to even: for |t| < 2^22, t + 1.5 * 2^23 rounds t to an integer.
    t = (y * inv + 12582912.0) - 12582912.0
    t = tl.minimum(tl.maximum(t, -127.0), 127.0)
    tl.store(q_ptr + m * stride_qm + offs, t.to(tl.int8), mask=mask)
    tl.store(qs_ptr + m, tl.math.div_rn(a, 127.0))


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, act: str, residual: torch.Tensor | None = None):
    """x [..., D or 2D], weight [D], residual like x or None (checked by the op) ->
    (q int8 [..., D], x_scale fp32 [...]), and with a residual also h = x + residual [..., D]."""
    d = weight.shape[0]
    assert d <= MAX_D, f"rows of {d} > {MAX_D} features go to the op's torch reference"
    lead = x.shape[:-1]
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    m = x2.shape[0]
    q = torch.empty((m, d), dtype=torch.int8, device=x.device)
    qs = torch.empty((m,), dtype=torch.float32, device=x.device)
    h = torch.empty((m, d), dtype=x.dtype, device=x.device) if residual is not None else q
    if m:
        block = triton.next_power_of_2(d)
        rms_norm_quant_kernel[(m,)](
            x2, r2, h, weight.contiguous(), q, qs, d, x2.stride(0), r2.stride(0), q.stride(0), float(eps),
            GLU=act == "relu2_glu", RESIDUAL=residual is not None, BLOCK=block,
            LAUNCH_DEPENDENTS=configs.signals_dependents(x.device),
            num_warps=max(4, min(16, block // 512)),
            # Every product rounds before it is added or rounded further, as in the reference.
            enable_fp_fusion=False,
        )  # fmt: skip
    out = (q.view(*lead, d), qs.view(lead))
    return out if residual is None else (*out, h.view(*lead, d))
