"""``torch.ops.ternop.linear``: the schema, the public entry point, and dispatch.

    ternop::linear(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None,
                   int activation_bits=16, str layout="v1") -> Tensor

x [..., K] float16/bfloat16/float32 (any strides), weight_packed uint8 [N, K/4] in
``layout`` (``ternop.layouts``: "v1" is the checkpoint format, "a16"/"a8" the kernel
layouts), weight_scale float16 [N, K/128] (or [N, 1]: one scale per row), bias [N] in x's
dtype or None -> a new [..., N] tensor in x's dtype. ``activation_bits=16`` uses x as given
and accumulates in fp32; ``activation_bits=8`` quantizes x per token to int8 and accumulates
int32 per 128-block, or over all of K with row scales (``ternop.activations`` is its spec).
The op is functional (it mutates nothing) and inference-only: it has no backward.

    ternop::linear_q8(Tensor q, Tensor x_scale, Tensor weight_packed, Tensor weight_scale,
                      Tensor? bias, ScalarType out_dtype, str layout="v1") -> Tensor

is the same product with ``activation_bits=8`` after the per-token quantization: q int8
[..., K] and x_scale fp32 [...] as ``ternop.activations.quantize_rows`` makes them, the
output [..., N] in ``out_dtype``. ``linear_q8(*quantize_rows(x), w, s, b, x.dtype)`` is
``linear(x, w, s, b, 8)`` bit for bit. It exists so that a compiled graph can fuse the
quantization into what produces x (an RMSNorm, an activation) and hand int8 rows straight
to the GEMM; the vLLM plugin calls it under ``torch.compile``.

Every device runs the same entry: check, view x as [M, K] (copying only when K is not its
unit-stride dimension), pick a backend from the registry for this call, view the result back.
Above vLLM's CUDA-graph sizes every call pays this on the host, so a call whose signature (the
shapes, strides, dtypes, devices and alignments of its tensors, and its other arguments) was
seen before, and that needed no copy, goes straight to the backend that signature took: the
checks passed for the same signature, and the registry's choice depends on nothing else.
"""

from __future__ import annotations

import torch

from ternop import backends
from ternop.format import BLOCK_SIZE
from ternop.meta import check_linear_inputs, check_q8_inputs, inputs_ok, linear_fake, linear_q8_fake, q8_inputs_ok

SCHEMA = (
    "(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None, "
    "int activation_bits=16, str layout=\"v1\") -> Tensor"
)
QUALNAME = "ternop::linear"
Q8_SCHEMA = (
    "(Tensor q, Tensor x_scale, Tensor weight_packed, Tensor weight_scale, Tensor? bias, "
    "ScalarType out_dtype, str layout=\"v1\") -> Tensor"
)
Q8_QUALNAME = "ternop::linear_q8"

_lib = torch.library.Library("ternop", "DEF")
_lib.define("linear" + SCHEMA)
_lib.define("linear_q8" + Q8_SCHEMA)

_cuda_loaded = False


def _load_cuda_backends() -> None:
    # Deferred so that `import ternop` never imports triton or touches CUDA.
    global _cuda_loaded
    if not _cuda_loaded:
        import ternop.cuda  # noqa: F401  (registers the CUDA backends)

        _cuda_loaded = True


def _signature(x: torch.Tensor) -> tuple:
    """What the checks, the row view and the registry's key read of x (or of q)."""
    return x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16


def _weights_signature(weight_packed: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """What the checks and the registry's key read of the weights and the bias."""
    return (
        weight_packed.shape, weight_packed.stride(), weight_packed.dtype, weight_packed.device,
        weight_packed.data_ptr() % 16, weight_scale.shape, weight_scale.stride(), weight_scale.dtype,
        weight_scale.device, None if bias is None else (bias.shape, bias.dtype, bias.device),
    )  # fmt: skip


def _as_is(x: torch.Tensor, x2: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """Whether the call reaches its backend without a copy: x2 views x, the weights are as given."""
    return x2.data_ptr() == x.data_ptr() and weight_packed.is_contiguous() and weight_scale.is_contiguous()


def _viewed(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as [M, K], for a signature whose earlier call took it without a copy."""
    return x if x.dim() == 2 else x.view(-1, x.shape[-1])


def _shaped(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The [M, N] result as [..., N], for x [..., K]."""
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[1])


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] viewed as [M, K]. Kernels take any row stride, but K must be the unit-stride
    dimension and rows may not overlap: only then is x copied."""
    k = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # a 2-D x is already its own [M, K] view
    if x2.stride(1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    return x2


def _run(call: backends.LinearCall, x: torch.Tensor, signature: tuple | None) -> torch.Tensor:
    """Runs ``call`` (x as [M, K]) on the backend the registry picks; the result shaped as x's
    [..., N]. The choice is cached under ``signature`` (None: under the call's key)."""
    if not _cuda_loaded and call.x.is_cuda:
        _load_cuda_backends()
    return _shaped(backends.select(call, signature).run(call), x)


def _expands(weight_scale: torch.Tensor, k: int, activation_bits: int) -> bool:
    return weight_scale.shape[1] != k // BLOCK_SIZE and activation_bits == 16


def linear_call(
    x2: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation_bits: int = 16,
    layout: str = "v1",
) -> backends.LinearCall:
    """The registry's call that ``ternop::linear`` makes of checked arguments with x2 [M, K] (unit
    stride along K, rows apart): a row scale with 16-bit activations becomes its expansion, since
    16-bit kernels read a scale per block."""
    n, k = weight_packed.shape[0], x2.shape[1]
    if _expands(weight_scale, k, activation_bits):
        weight_scale = weight_scale.expand(n, k // BLOCK_SIZE)
    return backends.LinearCall(x2, weight_packed.contiguous(), weight_scale.contiguous(), bias, activation_bits, layout)


def _linear_impl(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation_bits: int = 16,
    layout: str = "v1",
) -> torch.Tensor:
    signature = ("linear", *_signature(x), *_weights_signature(weight_packed, weight_scale, bias), activation_bits,
                 layout)  # fmt: skip
    backend = backends.cached(signature)
    if backend is not None:
        call = backends.LinearCall(_viewed(x), weight_packed, weight_scale, bias, activation_bits, layout)
        return _shaped(backend.run(call), x)
    if not inputs_ok(x, weight_packed, weight_scale, bias, activation_bits, layout):
        check_linear_inputs(x, weight_packed, weight_scale, bias, activation_bits, layout)  # raises, naming the problem
    n, k = weight_packed.shape[0], x.shape[-1]
    x2 = _rows(x)
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], n))
    # A row scale with 16-bit activations is expanded (linear_call): not the tensor the signature saw.
    as_is = _as_is(x, x2, weight_packed, weight_scale) and not _expands(weight_scale, k, activation_bits)
    call = linear_call(x2, weight_packed, weight_scale, bias, activation_bits, layout)
    return _run(call, x, signature if as_is else None)


def _linear_q8_impl(
    q: torch.Tensor,
    x_scale: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    layout: str = "v1",
) -> torch.Tensor:
    signature = ("linear_q8", *_signature(q), x_scale.shape, x_scale.stride(), x_scale.dtype, x_scale.device,
                 *_weights_signature(weight_packed, weight_scale, bias), out_dtype, layout)  # fmt: skip
    backend = backends.cached(signature)
    if backend is not None:
        call = backends.LinearCall(_viewed(q), weight_packed, weight_scale, bias, 8, layout,
                                   x_scale if x_scale.dim() == 1 else x_scale.view(-1), out_dtype)  # fmt: skip
        return _shaped(backend.run(call), q)
    if not q8_inputs_ok(q, x_scale, weight_packed, weight_scale, bias, out_dtype, layout):
        check_q8_inputs(q, x_scale, weight_packed, weight_scale, bias, out_dtype, layout)  # raises, naming the problem
    n = weight_packed.shape[0]
    q2 = _rows(q)
    if q2.shape[0] == 0:
        return q.new_empty((*q.shape[:-1], n), dtype=out_dtype)
    as_is = _as_is(q, q2, weight_packed, weight_scale) and x_scale.is_contiguous()
    call = backends.LinearCall(q2, weight_packed.contiguous(), weight_scale.contiguous(), bias, 8, layout,
                               x_scale.reshape(-1).contiguous(), out_dtype)  # fmt: skip
    return _run(call, q, signature if as_is else None)


_lib.impl("linear", _linear_impl, "CPU")
_lib.impl("linear", _linear_impl, "CUDA")
torch.library.register_fake(QUALNAME, linear_fake, lib=_lib)
_lib.impl("linear_q8", _linear_q8_impl, "CPU")
_lib.impl("linear_q8", _linear_q8_impl, "CUDA")
torch.library.register_fake(Q8_QUALNAME, linear_q8_fake, lib=_lib)


def _backward(ctx, grad):
    raise RuntimeError(
        "ternop.linear is inference-only: it has no backward. Run it under torch.no_grad() / "
        "torch.inference_mode(), or train with a straight-through estimator on dense weights "
        "(see `ternop distill`)."
    )


torch.library.register_autograd(QUALNAME, _backward, lib=_lib)
torch.library.register_autograd(Q8_QUALNAME, _backward, lib=_lib)


def ternary_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation_bits: int = 16,
    layout: str = "v1",
) -> torch.Tensor:
    """y = x @ dequantize(weight_packed, weight_scale).T + bias, via ``torch.ops.ternop.linear``.

    x: [..., K] float16/bfloat16/float32; weight_packed: uint8 [N, K/4] in ``layout``
    (see ``ternop.layouts``; "v1" is the checkpoint format); weight_scale: float16 [N, K/128],
    or [N, 1] for one scale per row (``ternop.activations.row_scales`` makes it);
    bias: [N] in x's dtype or None. ``activation_bits=8`` quantizes x per token to int8
    first (see ``ternop.activations``). Returns [..., N] in x's dtype.
    """
    return torch.ops.ternop.linear(x, weight_packed, weight_scale, bias, activation_bits, layout)


linear = ternary_linear


def linear_q8(
    q: torch.Tensor,
    x_scale: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype,
    layout: str = "v1",
) -> torch.Tensor:
    """``ternop.linear(x, ..., activation_bits=8)`` from x already quantized, via
    ``torch.ops.ternop.linear_q8``.

    q: int8 [..., K] and x_scale: float32 [...], as ``ternop.activations.quantize_rows(x)``
    returns them; the weights as for ``ternary_linear``; bias: [N] in ``out_dtype`` or None.
    Returns [..., N] in ``out_dtype``.
    """
    return torch.ops.ternop.linear_q8(q, x_scale, weight_packed, weight_scale, bias, out_dtype, layout)
