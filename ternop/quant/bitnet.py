"""Hugging Face BitNet checkpoints (transformers' ``quant_method: "bitnet"``) -> format-v1 layers, exactly.

transformers knows three forms of a BitNet linear layer (``quantization_config.linear_class`` and
``quantization_mode``); each dequantizes, in the dtype of the stored tensors, to one value per
tensor times a ternary matrix:

``bitlinear`` (the default; microsoft/bitnet-b1.58-2B-4T)
    ``weight`` is uint8 ``[N/4, K]``: codes packed along the *output* dimension, four per byte.
    Bits ``2i..2i+1`` of byte ``[r, k]`` hold row ``i * N/4 + r`` as ``code = value + 1``
    (0 is -1, 1 is 0, 2 is +1; 3 is unused). ``weight_scale`` ``[1]`` *divides* the output
    (``BitLinear`` computes ``F.linear(x_q, w) / (x_scale * weight_scale)``), so
    ``W = value / weight_scale``. transformers never forms that weight; ternop computes the division
    in float16, the format's scale dtype: each scale is ``1 / weight_scale`` rounded once to float16
    (relative error at most 2^-11; the checkpoint's own bf16 would give 2^-8).
``autobitlinear``, ``quantization_mode: "offline"``
    ``weight`` packed as above (or already unpacked to {-1, 0, 1}); ``weight_scale`` ``[1]``
    *multiplies* the output: ``W = value * weight_scale``.
``autobitlinear``, ``quantization_mode: "online"`` (master weights, e.g. a bf16 training checkpoint)
    ``weight`` is the dense master weight and ``AutoBitLinear`` ternarizes it on every call, as
    BitNet b1.58 defines it (absmean, one scale per tensor, in fp32):
    ``s = 1 / max(mean|w|, 1e-5)``, ``W = (round(w * s).clamp(-1, 1) / s)`` cast back to w's dtype.
    A ``BitNetForCausalLM`` folder without a ``quantization_config`` is read the same way.

In every form the dequantized ``W`` is then stored exactly by :func:`ternop.quant.exact.exact_pair`
(each 128-block gets the tensor's one scale, or 0 where the block is all zeros).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ternop.quant.exact import NotExact

VALUES_PER_BYTE = 4
SCALE_SUFFIX = ".weight_scale"

FORMS = ("bitlinear", "autobitlinear", "master")


@dataclass(frozen=True)
class BitNetSource:
    """How a BitNet folder stores its linear layers (read from config.json)."""

    form: str  # one of FORMS
    modules_to_not_convert: tuple[str, ...] | None  # transformers' list; None means its default (lm_head)
    projection_norm_eps: float | None  # use_rms_norm: an RMSNorm (``<prefix>.rms_norm.weight``) before each layer

    @property
    def description(self) -> str:
        return {
            "bitlinear": "HF BitNet, packed (linear_class bitlinear: W = value / weight_scale)",
            "autobitlinear": "HF BitNet, offline autobitlinear (W = value * weight_scale)",
            "master": "HF BitNet, master weights (ternarized as BitNet b1.58: absmean per tensor)",
        }[self.form]


def bitnet_source(config: dict) -> BitNetSource | None:
    """The BitNet form of a folder from its config.json, or None if it is not a BitNet checkpoint."""
    qc = config.get("quantization_config")
    if qc is None:
        if "BitNetForCausalLM" in (config.get("architectures") or []):
            return BitNetSource("master", None, None)
        return None
    if qc.get("quant_method") != "bitnet":
        return None
    linear_class = qc.get("linear_class", "bitlinear")
    mode = qc.get("quantization_mode", "offline")
    if linear_class not in ("bitlinear", "autobitlinear") or mode not in ("offline", "online"):
        raise NotExact(
            f"quantization_config: linear_class {linear_class!r} / quantization_mode {mode!r} is not a BitNet "
            "form transformers defines (bitlinear; autobitlinear offline or online)"
        )
    form = "bitlinear" if linear_class == "bitlinear" else ("autobitlinear" if mode == "offline" else "master")
    skip = qc.get("modules_to_not_convert")
    eps = float(qc.get("rms_norm_eps") or 1e-6) if qc.get("use_rms_norm") else None
    return BitNetSource(form, None if skip is None else tuple(skip), eps)


def is_converted_by_transformers(prefix: str, skip: tuple[str, ...] | None) -> bool:
    """Whether transformers' BitNet quantizer replaces the linear layer ``prefix`` (its ``should_convert_module``)."""
    patterns = ("lm_head",) if skip is None else skip
    return not any(re.match(f"{p}\\.", prefix) or re.match(p, prefix) or prefix.endswith(p) for p in patterns)


def unpack_values(packed: torch.Tensor, name: str) -> torch.Tensor:
    """transformers' BitNet packing: uint8 ``[N/4, K]`` -> int8 values ``[N, K]`` in {-1, 0, 1}."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise NotExact(f"{name}: a packed BitNet weight is uint8 [N/4, K], got {packed.dtype} {list(packed.shape)}")
    codes = torch.cat([(packed >> (2 * i)) & 3 for i in range(VALUES_PER_BYTE)], dim=0)
    bad = codes == 3
    if bool(bad.any()):
        r, k = (int(i) for i in bad.nonzero()[0])
        raise NotExact(f"{name}: code 0b11 (value 2, not ternary) for output row {r}, input {k}")
    return codes.to(torch.int8) - 1


def master_dequantized(weight: torch.Tensor) -> torch.Tensor:
    """BitNet b1.58's weight ternarization (absmean, one scale per tensor, fp32), returned in weight's dtype."""
    w = weight.to(torch.float32)
    scale = 1.0 / w.abs().mean().clamp_(min=1e-5)
    return ((w * scale).round().clamp(-1, 1) / scale).to(weight.dtype)


def dequantized_weight(source: BitNetSource, name: str, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> torch.Tensor:
    """The dense ``[N, K]`` a BitNet layer computes with, as its form defines it (module docstring)."""
    if source.form == "master":
        if not weight.is_floating_point():
            raise NotExact(f"{name}: master weights must be floating point, got {weight.dtype}")
        return master_dequantized(weight)
    if weight_scale is None:
        raise NotExact(f"{name}: a {source.form} layer needs {name}_scale beside it")
    if weight_scale.numel() != 1 or not weight_scale.is_floating_point():
        raise NotExact(f"{name}_scale: expected one floating-point value per tensor, got {weight_scale.dtype} "
                       f"{list(weight_scale.shape)}")  # fmt: skip
    ws = weight_scale.reshape(1, 1)
    values = unpack_values(weight, name) if weight.dtype == torch.uint8 else weight
    if source.form == "autobitlinear":
        return values.to(ws.dtype) * ws
    # BitLinear divides by weight_scale; v1 multiplies by a float16 scale, so the division is done in float16.
    ws16 = ws.to(torch.float16)
    if not bool(torch.isfinite(ws16).all()) or float(ws16) == 0 or not torch.equal(ws16.to(ws.dtype), ws):
        raise NotExact(f"{name}_scale = {float(ws)!r} is zero or outside float16's range")
    return values.to(torch.float16) / ws16
