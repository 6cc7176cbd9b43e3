"""``torch.ops.ternop.rms_norm_quant``: an RMSNorm whose output goes straight to int8 rows.

    ternop::rms_norm_quant(Tensor x, Tensor weight, float eps, str act="none") -> (Tensor q, Tensor x_scale)
    ternop::add_rms_norm_quant(Tensor x, Tensor residual, Tensor weight, float eps)
        -> (Tensor q, Tensor x_scale, Tensor h)

A W2A8 layer quantizes its input per token (``ternop.activations``). Where that input is an
RMSNorm's output and nothing else reads it (every norm of a BitNet block: the two pre-norms
and the sub-norms before ``o_proj`` and ``down_proj``), the normalized rows exist only to be
quantized. Compiled, the two fuse into one generated kernel, but at decode sizes that kernel
walks each row three times in a loop (the sum of squares, the absmax, the rounding) on one
program per row: 2.4-5.2 us a call on the H200 against 1.9-2.0 us for bf16's own norm
(benchmarks/results/h200/bench_vllm_bitnet_a5c96c3.json). These ops keep a row in registers
and read it once (docs/KERNELS.md has their speed).

Spec. ``dt`` rounds to x's dtype; every step is the torch op the plain model runs:

    act = "none":       h = x                                        x [..., D]
    act = "relu2_glu":  g, u = x[..., :D], x[..., D:]                x [..., 2D]
                        h = dt(dt(relu(g)^2) * u)
    r      = 1 / sqrt_rn(fp32(sum_k fp32(h_k)^2) / D + eps)          (fp32; torch.rsqrt)
    y      = dt(weight * dt(fp32(h) * r))                           (weight [D] in x's dtype)
    q, x_scale = ternop.activations.quantize_rows(y)

``add_rms_norm_quant`` is a block's pre-norm with its residual add: ``h = x + residual``
(in x's dtype, as the torch op rounds it, and returned: it is the next residual), then
``rms_norm_quant(h, weight, eps)``.

The order of the sum of squares is the only freedom an implementation has. ``q`` and
``x_scale`` go to ``ternop::linear_q8``. The ops are functional and have no backward.
"""

from __future__ import annotations

import torch

from ternop.activations import quantize_rows

SCHEMA = "(Tensor x, Tensor weight, float eps, str act=\"none\") -> (Tensor, Tensor)"
QUALNAME = "ternop::rms_norm_quant"
ADD_SCHEMA = "(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor, Tensor)"
ADD_QUALNAME = "ternop::add_rms_norm_quant"
ACTS = ("none", "relu2_glu")
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OP = "ternop.rms_norm_quant"

_lib = torch.library.Library("ternop", "FRAGMENT")
_lib.define("rms_norm_quant" + SCHEMA)
_lib.define("add_rms_norm_quant" + ADD_SCHEMA)


def check_inputs(x: torch.Tensor, weight: torch.Tensor, eps: float, act: str) -> int:
    """Checks the arguments and returns D, the width of the normalized rows."""
    torch._check(act in ACTS, lambda: f"{OP}: act must be one of {', '.join(ACTS)}, got {act!r}")
    torch._check(x.dtype in X_DTYPES, lambda: f"{OP}: x must be float16, bfloat16 or float32, got {x.dtype}")
    torch._check(x.dim() >= 1, lambda: f"{OP}: x must have at least 1 dimension [..., D], got a 0-d tensor")
    torch._check(weight.dim() == 1, lambda: f"{OP}: weight must be 1-D [D], got shape {tuple(weight.shape)}")
    torch._check(weight.dtype == x.dtype, lambda: f"{OP}: weight must have x's dtype {x.dtype}, got {weight.dtype}")
    torch._check(weight.device == x.device, lambda: f"{OP}: weight is on {weight.device}, x on {x.device}")
    torch._check(eps >= 0, lambda: f"{OP}: eps must be >= 0, got {eps}")
    d = weight.shape[0]
    width = 2 * d if act == "relu2_glu" else d
    torch._check(
        x.shape[-1] == width,
        lambda: f"{OP}: x's last dimension must be {width} (weight has {d} features, act={act!r}), got {x.shape[-1]}",
    )
    return d


def check_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> int:
    """Checks the arguments of ``add_rms_norm_quant`` and returns D."""
    d = check_inputs(x, weight, eps, "none")
    torch._check(
        residual.shape == x.shape and residual.dtype == x.dtype and residual.device == x.device,
        lambda: f"{OP}: residual must be like x ({tuple(x.shape)}, {x.dtype}, {x.device}), got "
        f"{tuple(residual.shape)}, {residual.dtype}, {residual.device}",
    )
    return d


def add_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``add_rms_norm_quant`` in torch ops: (q, x_scale, h = x + residual)."""
    h = x + residual
    return (*reference(h, weight, eps), h)


def normed(x: torch.Tensor, weight: torch.Tensor, eps: float, act: str = "none") -> torch.Tensor:
    """y of the spec (module docstring) in plain torch ops: the normalized rows, in x's dtype."""
    if act == "relu2_glu":
        g, u = x.chunk(2, dim=-1)
        h = torch.square(torch.relu(g)) * u
    else:
        h = x
    hf = h.to(torch.float32)
    hf = hf * torch.rsqrt(hf.pow(2).sum(dim=-1, keepdim=True) / h.shape[-1] + eps)
    return weight * hf.to(x.dtype)


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float, act: str = "none"):
    """The spec in plain torch ops (module docstring): what the CPU runs, and the kernels' check."""
    return quantize_rows(normed(x, weight, eps, act))


def _fake(x: torch.Tensor, weight: torch.Tensor, eps: float, act: str = "none"):
    d = check_inputs(x, weight, eps, act)
    lead = x.shape[:-1]
    return x.new_empty((*lead, d), dtype=torch.int8), x.new_empty(lead, dtype=torch.float32)


def _torch_ops(x: torch.Tensor, weight: torch.Tensor, eps: float, act: str = "none"):
    check_inputs(x, weight, eps, act)
    q, s = reference(x, weight, eps, act)
    return q.contiguous(), s.contiguous()


def _cuda(x: torch.Tensor, weight: torch.Tensor, eps: float, act: str = "none"):
    check_inputs(x, weight, eps, act)
    from ternop.cuda.triton_norm_quant import MAX_D, rms_norm_quant  # deferred: triton loads on first use

    if weight.shape[0] > MAX_D:
        return _torch_ops(x, weight, eps, act)  # the same torch ops, on the GPU
    return rms_norm_quant(x, weight, eps, act)


def _add_fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    check_residual(x, residual, weight, eps)
    return (*_fake(x, weight, eps), torch.empty_like(x, memory_format=torch.contiguous_format))


def _add_torch_ops(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    check_residual(x, residual, weight, eps)
    return tuple(t.contiguous() for t in add_reference(x, residual, weight, eps))


def _add_cuda(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    check_residual(x, residual, weight, eps)
    from ternop.cuda.triton_norm_quant import MAX_D, rms_norm_quant  # deferred: triton loads on first use

    if weight.shape[0] > MAX_D:
        return _add_torch_ops(x, residual, weight, eps)
    return rms_norm_quant(x, weight, eps, "none", residual)


_lib.impl("rms_norm_quant", _torch_ops, "CPU")
_lib.impl("rms_norm_quant", _cuda, "CUDA")
torch.library.register_fake(QUALNAME, _fake, lib=_lib)
_lib.impl("add_rms_norm_quant", _add_torch_ops, "CPU")
_lib.impl("add_rms_norm_quant", _add_cuda, "CUDA")
torch.library.register_fake(ADD_QUALNAME, _add_fake, lib=_lib)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, act: str = "none"):
    """(q int8 [..., D], x_scale fp32 [...]): ``quantize_rows(rms_norm(x) * weight)`` as the
    module docstring says; ``torch.ops.ternop.rms_norm_quant``."""
    return torch.ops.ternop.rms_norm_quant(x, weight, eps, act)


def add_rms_norm_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(q int8 [..., D], x_scale fp32 [...], h = x + residual): a pre-norm with its residual
    add, as the module docstring says; ``torch.ops.ternop.add_rms_norm_quant``."""
    return torch.ops.ternop.add_rms_norm_quant(x, residual, weight, eps)
