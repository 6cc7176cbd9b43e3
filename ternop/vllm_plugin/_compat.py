"""The one place that knows how vLLM 0.26 and 0.32 differ, for the parts the plugin uses.

Both versions provide the same quantization-config and parameter classes, linear layers, Llama
and Qwen3 layers, RMSNorm, LM head, logits processor, pooling adapter and model registry, with
the same signatures. The differences, each found by feature, not by version number:

- opting a linear method into ``weight_loader_v2``: a decorator (0.32) or a list of names (0.26),
  :func:`register_weight_loader_v2`;
- the skip list's view of a model's weight mapper: ``get_rename_mapper`` (0.32) or
  ``get_unstacked_mapper`` (0.26), :func:`rename_mapper`;
- ``Qwen3Model`` takes its decoder layer from a ``decoder_layer_type`` class attribute in 0.32
  but hard-codes it in 0.26; ``Qwen2Model.__init__`` takes it as an argument in both, so the
  BitNet-style Qwen3 builds its stack through that (``bitnet_qwen3.ProjectionNormQwen3Model``);
- a checkpoint that holds ``lm_head.weight`` beside tied embeddings: 0.32's weight loader skips
  the alias by itself (and has no ``skip_prefixes``), 0.26's needs ``skip_prefixes=["lm_head."]``,
  as vLLM's own models pass it there (:func:`weights_loader`).

And one naming quirk: 0.32's BERT builds its self-attention with the prefix ``attention.output``, so
the fused ``qkv_proj`` of the checkpoint's ``attention.self.query/key/value`` is named
``...attention.output.qkv_proj``; :func:`part_heads` says where such a layer's parts live.
"""

from __future__ import annotations

import logging

import vllm
from vllm.logger import init_logger
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
    "part_heads",
    "rename_mapper",
    "vllm_logger",
    "weights_loader",
]


def vllm_logger(name: str) -> logging.Logger:
    """A logger whose lines appear in vLLM's log: vLLM gives handlers only to its "vllm" logger
    and the loggers under it, so the plugin's own lines go to ``vllm.<name>``."""
    return init_logger(f"vllm.{name}")


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
    """The renaming part of an hf->vLLM WeightsMapper, without the fusing of q/k/v or gate/up.

    vLLM already hands a quantization config that part; taking it again is a no-op and keeps
    a whole mapper (with stacked names) from renaming ``q_proj`` to ``qkv_proj`` in the skip list.
    """
    for name in ("get_rename_mapper", "get_unstacked_mapper"):
        get = getattr(mapper, name, None)
        if get is not None:
            return get()
    return mapper


def weights_loader(model, config):
    """vLLM's ``AutoWeightsLoader`` for ``model``; with tied embeddings it skips a checkpoint's ``lm_head.*``.

    0.32's loader knows tied parameters by itself and no longer takes ``skip_prefixes``; 0.26's
    takes it, and without it fails on an ``lm_head.weight`` that the model does not hold.
    """
    import inspect

    from vllm.model_executor.models.utils import AutoWeightsLoader

    kwargs = {}
    takes_skip = "skip_prefixes" in inspect.signature(AutoWeightsLoader).parameters
    if takes_skip and getattr(config, "tie_word_embeddings", False):
        kwargs["skip_prefixes"] = ["lm_head."]
    return AutoWeightsLoader(model, **kwargs)


def part_heads(head: str, fused: str) -> list[str]:
    """The dotted paths under which the checkpoint holds the parts of vLLM's fused layer ``{head}.{fused}``.

    ``head`` itself and, for a ``qkv_proj`` under ``attention.output``, ``attention.self``: vLLM's
    ``BertAttention`` hands its ``BertSelfAttention`` the prefix ``{prefix}.output`` (0.32), while
    BERT checkpoints name the parts ``attention.self.query/key/value``. Without it a dense q/k/v of a
    BERT layer would not be seen as skipped, and loading would fail inside vLLM's weight loader.
    """
    heads = [head]
    if fused == "qkv_proj" and (head == "attention.output" or head.endswith(".attention.output")):
        heads.append(head[: -len("output")] + "self")
    return heads
