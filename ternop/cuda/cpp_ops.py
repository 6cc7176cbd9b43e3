"""Schemas and fake kernels of the CUDA C++ kernels' private ops.

    ternop::linear_cuda(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None) -> Tensor
    ternop::linear_cuda_mma(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None,
                            bool a16=False, int row_groups=-1, int depth=-1, int slab=0) -> Tensor
    ternop::linear_cuda_mma_a8(Tensor q, Tensor qs, Tensor weight_packed, Tensor weight_scale,
                               Tensor? bias, ScalarType dtype, int row_groups=-1, int depth=-1,
                               int slab=0) -> Tensor
    ternop::linear_cuda_mma_a8_fused(Tensor x, Tensor weight_packed, Tensor weight_scale,
                                     Tensor? bias=None, int row_groups=-1, int depth=-1) -> Tensor
    ternop::linear_cuda_dequant(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias,
                                int layout) -> Tensor
    ternop::linear_cuda_mma_tiles(Tensor x, Tensor weight_packed, Tensor weight_scale,
                                  Tensor? bias=None, int tile=-1) -> Tensor
    ternop::linear_cuda_wgmma(Tensor x, Tensor weight_packed, Tensor weight_scale,
                              Tensor? bias=None, int tile=-1) -> Tensor
    ternop::linear_cuda_wgmma_a8(Tensor q, Tensor qs, Tensor weight_packed, Tensor weight_scale,
                                 Tensor? bias, ScalarType dtype, int tile=-1) -> Tensor
    ternop::decode_int8_cuda(Tensor weight_packed, int layout) -> Tensor

``decode_int8_cuda`` is not a product: it returns the values of uint8 [N, K/4] codes in ``layout``
(0 = v1, 1 = a16, 2 = a8) as int8 [N, K], -1, 0 or +1 without the scale, the dense operand of the
W2A8 int8 GEMM (``launch_dequant_a8.int8_gemm``) from one C++ launch.

The schemas live here, next to every other ternop schema, so they exist (and trace) whether
or not the extension was built; ``csrc/linear_cuda.cpp`` only registers the CUDA kernels,
which ``cuda_ext.load()`` builds on the first call that can use them. Shapes and dtypes are
those of ``linear_cuda.cpp``'s header comment. ``tile`` of ``linear_cuda_mma_tiles`` is -1 (the
kernel picks its tile by M, N and K) or one of its tiles, 0 or 1 (for benchmarks); that of
``linear_cuda_wgmma`` (Hopper, sm_90a builds) is -1 or one of its tiles 0-7 (``WgTile0``-``WgTile7`` of
``csrc/ternary_wgmma.cu``); that of ``linear_cuda_wgmma_a8`` is -1, 0 (64 tokens a CTA) or 1 (128), or with row scales
(``weight_scale`` [N, 1]) also 2 (128 tokens on 192 weight rows) or 3 (64 on 256). ``row_groups`` of
the three small-M ops is -1 (the kernel picks from N, K and the multiprocessor count) or the
number of sets of 16 weight rows one CTA owns, 1, 2, 4 or 8 (for benchmarks). Their ``depth`` is
-1 (the kernel's choice: 2) or the number of 128-wide scale blocks of weight loads each warp
keeps in flight, 2 or 4; 4 in ``linear_cuda_mma`` only with ``a16`` weights (for benchmarks; the
result is the same bits at either depth). ``slab`` of ``linear_cuda_mma`` and ``linear_cuda_mma_a8``
is 0 (one CTA column takes all of M: M <= 16, or 32 / 64 in the W2A8 op) or the tokens one CTA
takes, 8 or 16 (and 32 in the W2A8 op; in ``linear_cuda_mma`` only with ``a16`` weights at the
default depth): M then runs as ceil(M / slab) token slabs along the grid's y, each the same bits
as a call on its rows alone. The dispatcher picks it (``configs.mma_slab``, ``configs.mma_a8_slab``).
"""

from __future__ import annotations

import torch

_lib = torch.library.Library("ternop", "FRAGMENT")
_lib.define("linear_cuda(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None) -> Tensor")
_lib.define(
    "linear_cuda_mma(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None, bool a16=False, "
    "int row_groups=-1, int depth=-1, int slab=0) -> Tensor"
)
_lib.define(
    "linear_cuda_mma_a8(Tensor q, Tensor qs, Tensor weight_packed, Tensor weight_scale, Tensor? bias, "
    "ScalarType dtype, int row_groups=-1, int depth=-1, int slab=0) -> Tensor"
)

_lib.define(
    "linear_cuda_mma_a8_fused(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None, "
    "int row_groups=-1, int depth=-1) -> Tensor"
)

_lib.define(
    "linear_cuda_dequant(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias, int layout) -> Tensor"
)

_lib.define(
    "linear_cuda_mma_tiles(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None, int tile=-1) "
    "-> Tensor"
)

_lib.define(
    "linear_cuda_wgmma(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None, int tile=-1) -> Tensor"
)

_lib.define(
    "linear_cuda_wgmma_a8(Tensor q, Tensor qs, Tensor weight_packed, Tensor weight_scale, Tensor? bias, "
    "ScalarType dtype, int tile=-1) -> Tensor"
)

_lib.define("decode_int8_cuda(Tensor weight_packed, int layout) -> Tensor")

OPS = (
    "linear_cuda", "linear_cuda_mma", "linear_cuda_mma_a8", "linear_cuda_mma_a8_fused", "linear_cuda_dequant",
    "linear_cuda_mma_tiles", "linear_cuda_wgmma", "linear_cuda_wgmma_a8", "decode_int8_cuda",
)


def _out(rows: torch.Tensor, weight_packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    torch._check(rows.dim() == 2, lambda: f"expected a 2-D [M, K] input, got {tuple(rows.shape)}")
    torch._check(
        weight_packed.dim() == 2 and weight_packed.shape[1] * 4 == rows.shape[1],
        lambda: f"weight_packed {tuple(weight_packed.shape)} does not hold K={rows.shape[1]}",
    )
    return rows.new_empty((rows.shape[0], weight_packed.shape[0]), dtype=dtype)


@torch.library.register_fake("ternop::linear_cuda", lib=_lib)
def _linear_cuda_fake(x, weight_packed, weight_scale, bias=None):
    return _out(x, weight_packed, x.dtype)


@torch.library.register_fake("ternop::linear_cuda_mma", lib=_lib)
def _linear_cuda_mma_fake(x, weight_packed, weight_scale, bias=None, a16=False, row_groups=-1, depth=-1, slab=0):
    return _out(x, weight_packed, x.dtype)


@torch.library.register_fake("ternop::linear_cuda_mma_a8", lib=_lib)
def _linear_cuda_mma_a8_fake(q, qs, weight_packed, weight_scale, bias, dtype, row_groups=-1, depth=-1, slab=0):
    return _out(q, weight_packed, dtype)


@torch.library.register_fake("ternop::linear_cuda_mma_a8_fused", lib=_lib)
def _linear_cuda_mma_a8_fused_fake(x, weight_packed, weight_scale, bias=None, row_groups=-1, depth=-1):
    return _out(x, weight_packed, x.dtype)


@torch.library.register_fake("ternop::linear_cuda_dequant", lib=_lib)
def _linear_cuda_dequant_fake(x, weight_packed, weight_scale, bias, layout):
    return _out(x, weight_packed, x.dtype)


@torch.library.register_fake("ternop::linear_cuda_mma_tiles", lib=_lib)
def _linear_cuda_mma_tiles_fake(x, weight_packed, weight_scale, bias=None, tile=-1):
    return _out(x, weight_packed, x.dtype)


@torch.library.register_fake("ternop::linear_cuda_wgmma", lib=_lib)
def _linear_cuda_wgmma_fake(x, weight_packed, weight_scale, bias=None, tile=-1):
    return _out(x, weight_packed, x.dtype)


@torch.library.register_fake("ternop::linear_cuda_wgmma_a8", lib=_lib)
def _linear_cuda_wgmma_a8_fake(q, qs, weight_packed, weight_scale, bias, dtype, tile=-1):
    return _out(q, weight_packed, dtype)


@torch.library.register_fake("ternop::decode_int8_cuda", lib=_lib)
def _decode_int8_cuda_fake(weight_packed, layout):
    torch._check(weight_packed.dim() == 2, lambda: f"weight_packed must be [N, K/4], got {tuple(weight_packed.shape)}")
    return weight_packed.new_empty((weight_packed.shape[0], weight_packed.shape[1] * 4), dtype=torch.int8)


def has_kernel(op: str) -> bool:
    """Whether the built extension registered the CUDA kernel of ``ternop::<op>`` (asks the dispatcher)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"ternop::{op}", "CUDA")
