"""The one place that knows how vLLM 0.26 and 0.32 differ, for the parts the plugin uses.

Both versions provide the same quantization-config and parameter classes; the differences
handled here are where a helper lives or whether it exists at all.
"""

from __future__ import annotations

import vllm
from vllm.model_executor.layers import linear as _linear
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config as _register_quant
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter

VLLM_VERSION = tuple(int(p) for p in vllm.__version__.split("+")[0].split(".")[:2] if p.isdigit())

__all__ = [
    "GroupQuantScaleParameter",
    "LinearBase",
    "LinearMethodBase",
    "PackedvLLMParameter",
    "QuantizationConfig",
    "UnquantizedLinearMethod",
    "VLLM_VERSION",
    "register_quantization_config",
    "register_weight_loader_v2",
]


def register_quantization_config(name: str, cls: type) -> None:
    _register_quant(name)(cls)


def register_weight_loader_v2(cls: type) -> type:
    """Opts a LinearMethod into weight_loader_v2, where vLLM's parameter classes do the TP slicing.

    Newer vLLM has a decorator for it; older ones keep a list of class names.
    """
    decorator = getattr(_linear, "register_weight_loader_v2_supported_method", None)
    if decorator is not None:
        if cls.__name__ not in _linear.WEIGHT_LOADER_V2_SUPPORTED:
            decorator(cls)
    elif cls.__name__ not in _linear.WEIGHT_LOADER_V2_SUPPORTED:
        _linear.WEIGHT_LOADER_V2_SUPPORTED.append(cls.__name__)
    return cls


def rename_mapper(mapper):
    """The renaming part of an hf->vLLM WeightsMapper (0.32 splits it out; 0.26 passes it whole)."""
    get = getattr(mapper, "get_rename_mapper", None)
    return get() if get is not None else mapper
