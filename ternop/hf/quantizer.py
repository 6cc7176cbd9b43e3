"""transformers' view of a v1 checkpoint: ``quant_method: "ternary"`` as a custom quantizer.

Registered through transformers' public ``register_quantization_config`` / ``register_quantizer``,
so ``AutoModel.from_pretrained(ternary_dir)`` (and ``SentenceTransformer(ternary_dir)``, which
calls it) builds the model with :class:`ternop.TernaryLinear` in place of each ternary layer
and loads ``weight_packed`` / ``weight_scale`` / ``bias`` into it. The layers replaced are
exactly those whose ``<prefix>.weight_packed`` is in the checkpoint's safetensors headers; they
run with the checkpoint's ``activation_bits`` (16 or 8), which ``save_pretrained`` writes back.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ternop.checkpoint import PACKED_SUFFIX, QUANT_METHOD
from ternop.checkpoint.safetensors_io import read_header
from ternop.format import BLOCK_SIZE, DEFAULT_ACTIVATION_BITS, FORMAT_VERSION, check_activation_bits
from ternop.hf.names import match_names
from ternop.layouts import preferred_layout
from ternop.modules import TernaryLinear


class TernaryHfConfig(QuantizationConfigMixin):
    """``{"quant_method": "ternary", "format_version": 1, "block_size": 128, "modules_to_not_convert": [...],
    "activation_bits": 16}``; an ``activation_bits`` other than 16 or 8 is an error that names the field."""

    def __init__(self, format_version: int = FORMAT_VERSION, block_size: int = BLOCK_SIZE,
                 modules_to_not_convert: list[str] | None = None, activation_bits: int = DEFAULT_ACTIVATION_BITS,
                 **kwargs):  # fmt: skip
        if int(format_version) != FORMAT_VERSION:
            raise ValueError(f"ternary quantization_config: format_version {format_version} is not supported (expected 1)")
        if int(block_size) != BLOCK_SIZE:
            raise ValueError(f"ternary quantization_config: block_size {block_size} is not supported (format v1 uses 128)")
        self.quant_method = QUANT_METHOD
        self.format_version = FORMAT_VERSION
        self.block_size = BLOCK_SIZE
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self.activation_bits = check_activation_bits(activation_bits, "ternary quantization_config")
        self.extra = {k: v for k, v in kwargs.items() if k != "quant_method"}  # kept, so save_pretrained keeps them

    def to_dict(self) -> dict:
        return {"quant_method": QUANT_METHOD, "format_version": self.format_version, "block_size": self.block_size,
                "modules_to_not_convert": list(self.modules_to_not_convert), "activation_bits": self.activation_bits,
                **self.extra}  # fmt: skip


def replace_linears(model: nn.Module, module_names: Iterable[str], dtype: torch.dtype | None = None,
                    activation_bits: int = DEFAULT_ACTIVATION_BITS) -> None:  # fmt: skip
    """Replaces each named ``nn.Linear`` of ``model`` by an empty TernaryLinear on the same device,
    running with ``activation_bits``."""
    for name in module_names:
        old = model.get_submodule(name)
        if not isinstance(old, nn.Linear):
            raise ValueError(f"ternary layer {name} is a {type(old).__name__} in the model, not an nn.Linear")
        device = old.weight.device
        layer = TernaryLinear(old.in_features, old.out_features, bias=old.bias is not None, device=device,
                              dtype=dtype or old.weight.dtype, activation_bits=activation_bits)  # fmt: skip
        model.set_submodule(name, layer)


def ternary_modules(model: nn.Module, checkpoint_files: Iterable[str | Path]) -> list[str]:
    """The model's module names of the checkpoint's ternary layers; ValueError for one with no nn.Linear."""
    prefixes = [i.name[: -len(PACKED_SUFFIX)] for f in checkpoint_files for i in read_header(Path(f))[0]
                if i.name.endswith(PACKED_SUFFIX)]  # fmt: skip
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    found = match_names(model, linears, prefixes)
    missing = sorted(set(prefixes) - set(found))
    if missing:
        raise ValueError(
            f"the checkpoint's ternary layers {missing[:3]} have no nn.Linear in {type(model).__name__} "
            "(was the checkpoint written for another architecture?)"
        )
    return [found[p] for p in prefixes]


class TernaryHfQuantizer(HfQuantizer):
    """Loads pre-quantized v1 checkpoints; it cannot quantize a dense model on the fly (use ``ternop quantize``)."""

    requires_calibration = True  # pre-quantized checkpoints only

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, dtype=None, **kwargs):
        if not checkpoint_files:  # transformers versions that do not pass the files: the local folder's
            folder = Path(getattr(model.config, "name_or_path", "") or "")
            checkpoint_files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
        if not checkpoint_files:
            raise ValueError("ternary checkpoints load from a local folder of *.safetensors files; none were found")
        bits = getattr(self.quantization_config, "activation_bits", DEFAULT_ACTIVATION_BITS)
        replace_linears(model, ternary_modules(model, checkpoint_files), dtype, bits)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        # The weights were set in place (no .to()): each layer takes the layout its device reads fastest.
        for module in model.modules():
            if isinstance(module, TernaryLinear) and module.weight_packed.device.type != "meta":
                module.use_layout(preferred_layout(module.activation_bits, module.weight_packed.device))
        return model

    def _dequantize(self, model, dtype=None):
        """Replaces every TernaryLinear by an nn.Linear holding its dense weight (value x scale)."""
        if isinstance(dtype, str):  # transformers passes config.dtype, a name once the config was saved
            dtype = getattr(torch, dtype)
        for name, module in list(model.named_modules()):
            if isinstance(module, TernaryLinear):
                wdtype = dtype or (module.bias.dtype if module.bias is not None else torch.float32)
                dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                  device=module.weight_packed.device, dtype=wdtype)  # fmt: skip
                with torch.no_grad():
                    dense.weight.copy_(module.dequantized_weight(wdtype))
                    if module.bias is not None:
                        dense.bias.copy_(module.bias)
                model.set_submodule(name, dense)
        return model

    def is_serializable(self) -> bool:
        # save_pretrained writes weight_packed / weight_scale / bias and this config: a v1 checkpoint.
        return True

    @property
    def is_trainable(self) -> bool:
        return False


_registered = False


def register() -> None:
    """Registers ``quant_method: "ternary"`` with transformers. Idempotent."""
    global _registered
    if _registered:
        return
    for registrar, cls in ((register_quantization_config, TernaryHfConfig), (register_quantizer, TernaryHfQuantizer)):
        try:
            registrar(QUANT_METHOD)(cls)
        except ValueError as e:  # registered already (transformers refuses a second registration)
            if "already registered" not in str(e):
                raise
    _registered = True
