"""nn.Module API: a ternary linear layer, and in-place conversion of a model's nn.Linear layers."""

from __future__ import annotations

import torch
from torch import nn

from ternop.format import (
    BLOCK_SIZE,
    CODES_PER_BYTE,
    DEFAULT_ACTIVATION_BITS,
    SCALE_DTYPE,
    check_activation_bits,
    dequantize,
    packed_bytes,
)
from ternop.activations import quantize_rows
from ternop.layouts import check_layout, preferred_layout, repack, to_v1
from ternop.ops import linear_q8, ternary_linear
from ternop.quantize import quantize_weight
from ternop.selection import QuantizeReport, select_linears

__all__ = ["QuantizeReport", "TernaryLinear", "quantize_module"]


class TernaryLinear(nn.Module):
    """A linear layer with ternary weights: y = x @ (codes * scale).T + bias.

    Buffers: ``weight_packed`` uint8 [out, in/4], ``weight_scale`` float16 [out, in/128],
    ``bias`` [out] or None. Inference-only.

    ``activation_bits`` is how the layer treats its input: 16 (as given, the default) or 8
    (quantized per token to int8, int32 per 128-block; ternop/activations.py is the spec).
    A checkpoint's ``quantization_config.activation_bits`` sets it when ``ternop.hf`` loads one.
    Under ``torch.compile`` an 8-bit layer quantizes x with ``ternop.activations.quantize_rows``
    in the graph and calls ``ternop::linear_q8`` (the same bits for a given x), so the
    quantization can fuse into what produces x (which Inductor may then round differently in
    the last bit, as compiled code does anyway).

    ``module.to(dtype)`` / ``.half()`` move the bias to that dtype once, like a dense layer's;
    ``weight_scale`` stays float16 (the format's dtype) and only changes device.

    ``layout`` names the order of the codes in ``weight_packed`` (``ternop.layouts``). A new layer
    holds format v1. After ``from_linear`` and after every ``.to()`` / ``.cuda()`` / ``.half()``,
    the layer holds its codes in the layout whose kernels read them fastest on its device
    (``preferred_layout``: "a16" or "a8" on CUDA, v1 on the CPU); ``use_layout`` picks one by
    hand. ``state_dict()`` always holds v1 codes, and ``load_state_dict`` takes v1 codes and
    repacks them into the layer's layout, so checkpoints stay format v1. Code that writes
    ``weight_packed`` directly writes codes in ``layout``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 activation_bits: int = DEFAULT_ACTIVATION_BITS):  # fmt: skip
        super().__init__()
        if in_features % BLOCK_SIZE != 0:
            raise ValueError(f"in_features={in_features} must be a multiple of {BLOCK_SIZE}")
        self.in_features = in_features
        self.out_features = out_features
        self.activation_bits = check_activation_bits(activation_bits, "TernaryLinear")
        self.register_buffer(
            "weight_packed",
            torch.zeros((out_features, in_features // CODES_PER_BYTE), dtype=torch.uint8, device=device),
        )
        self.register_buffer(
            "weight_scale",
            torch.zeros((out_features, in_features // BLOCK_SIZE), dtype=SCALE_DTYPE, device=device),
        )
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype or torch.float32, device=device))
        else:
            self.bias = None
        self.layout = "v1"

    @classmethod
    def from_linear(cls, linear: nn.Linear, method: str = "optimal",
                    activation_bits: int = DEFAULT_ACTIVATION_BITS) -> "TernaryLinear":  # fmt: skip
        """Quantizes an nn.Linear (its bias is kept in its dtype), in the layout preferred on its device."""
        w = linear.weight.detach()
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device=w.device,
            dtype=w.dtype,
            activation_bits=activation_bits,
        )
        packed, scale = quantize_weight(w, method)
        layer.weight_packed.copy_(packed)
        layer.weight_scale.copy_(scale)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias.detach())
        return layer.use_layout(preferred_layout(activation_bits, w.device))

    def _v1_codes(self) -> torch.Tensor:
        """``weight_packed`` in format v1 (the buffer itself when the layer holds v1)."""
        return self.weight_packed if self.layout == "v1" else to_v1(self.weight_packed, self.layout)

    @torch.no_grad()
    def use_layout(self, layout: str) -> "TernaryLinear":
        """Repacks ``weight_packed`` into ``layout`` (one of ``ternop.layouts.LAYOUTS``), in place."""
        check_layout(layout)
        if layout != self.layout:
            codes = self._v1_codes()
            self.weight_packed = codes if layout == "v1" else repack(codes, layout)
            self.layout = layout
        return self

    def _apply(self, fn, recurse=True):
        # nn.Module casts every floating-point buffer on .to(dtype); the scales are part of the
        # format (float16), so they keep their bits and follow only the device.
        order = list(self._buffers)
        scale = self._buffers.pop("weight_scale")
        try:
            super()._apply(fn, recurse)
        finally:
            moved = fn(scale)
            self._buffers["weight_scale"] = moved if moved.dtype == scale.dtype else scale.to(moved.device)
            for key in order:  # keep the state_dict order
                self._buffers[key] = self._buffers.pop(key)
        device = self.weight_packed.device
        if device.type != "meta":
            self.use_layout(preferred_layout(self.activation_bits, device))
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.layout != "v1":  # checkpoints hold format v1
            destination[prefix + "weight_packed"] = self._v1_codes()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):  # fmt: skip
        errors = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)  # fmt: skip
        if prefix + "weight_packed" in state_dict and len(error_msgs) == errors and self.layout != "v1":
            layout, self.layout = self.layout, "v1"  # the buffer now holds the state dict's v1 codes
            self.use_layout(layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            # Only when the caller mixes dtypes; a model moved with .to(dtype) already holds it in x's dtype.
            bias = bias.to(x.dtype)
        if self.activation_bits == 8 and torch.compiler.is_compiling():
            # Compiled: quantize x in the graph, where Inductor can fuse it into what produces x;
            # for a given x, linear_q8 then gives what ternary_linear(..., 8) gives, bit for bit.
            q, x_scale = quantize_rows(x)
            return linear_q8(q, x_scale, self.weight_packed, self.weight_scale, bias, out_dtype=x.dtype,
                             layout=self.layout)
        return ternary_linear(x, self.weight_packed, self.weight_scale, bias, self.activation_bits, self.layout)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self._v1_codes(), self.weight_scale, dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activation_bits={self.activation_bits}"
                + (f", layout={self.layout}" if self.layout != "v1" else ""))  # fmt: skip


@torch.no_grad()
def quantize_module(model: nn.Module, skip=(), method: str = "optimal",
                    activation_bits: int = DEFAULT_ACTIVATION_BITS) -> QuantizeReport:  # fmt: skip
    """Replaces, in place, each nn.Linear chosen by ``ternop.selection`` with a TernaryLinear.

    The new layers run with ``activation_bits`` (16 or 8). A skip pattern that matches no linear layer raises ValueError before anything changes.
    """
    check_activation_bits(activation_bits, "quantize_module")
    targets, dense = select_linears(model, skip)
    report = QuantizeReport(skipped=dense)
    for name, module in targets.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, TernaryLinear.from_linear(module, method, activation_bits))
        report.quantized.append(name)
        report.dense_bytes += module.weight.numel() * module.weight.element_size()
        report.ternary_bytes += packed_bytes(module.out_features, module.in_features)
    return report
