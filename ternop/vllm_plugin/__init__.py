"""ternop's vLLM plugin: registers the ``ternary`` quantization method and the BitNet model.

vLLM finds :func:`register` through the ``vllm.general_plugins`` entry point and calls it in
every process it starts (front end, engine core, workers), so it is idempotent and cheap:
it imports the config module and registers the class once, and names the models in
:data:`MODELS` to vLLM's model registry by import path (their modules load only when used).
"""

from __future__ import annotations

import os
import warnings

_registered = False

MODELS = {
    "BitNetForCausalLM": "ternop.vllm_plugin.bitnet:BitNetForCausalLM",
    "BitNetQwen3ForCausalLM": "ternop.vllm_plugin.bitnet_qwen3:BitNetQwen3ForCausalLM",
    "BitNetQwen3Model": "ternop.vllm_plugin.bitnet_qwen3:BitNetQwen3Model",
}
"""Architectures (config.json ``architectures``) the plugin adds to vLLM, when vLLM has none of that name."""


def register() -> None:
    """Registers ``quant_method: "ternary"`` and :data:`MODELS` with vLLM. Safe to call any number of times.

    It also keeps CPython's freed frame-stack chunks for reuse in this process
    (:mod:`ternop.vllm_plugin.stack_chunks`; ``TERNOP_KEEP_STACK_CHUNKS=0`` turns that off); a
    failure to build that allocator is reported as a warning and changes nothing else.

    With ``TERNOP_FUSE_QUANT`` set (0 or 1) it sets ``VLLM_DISABLE_COMPILE_CACHE=1`` unless that
    is set: the variable changes the graph vLLM compiles (where int8 layers quantize x,
    ``linear_method.quant_in_graph``), but not the key of vLLM's compile cache, so a graph
    compiled under another setting would be loaded from the cache instead. Unset, the choice
    follows the model's runner, which the key holds.
    """
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry

    from ternop.vllm_plugin import stack_chunks

    if stack_chunks.enabled_by_env():
        try:
            stack_chunks.keep_stack_chunks()
        except (RuntimeError, OSError) as exc:  # no compiler, or a library that does not load
            warnings.warn(f"ternop: the frame-stack chunk allocator is not installed ({exc}); vLLM runs without "
                          f"it, possibly slower on the host. {stack_chunks.ENV_ENABLE}=0 skips it.", stacklevel=2)  # fmt: skip

    from ternop.vllm_plugin import _compat
    from ternop.vllm_plugin.config import TernaryConfig
    from ternop.vllm_plugin.linear_method import FUSE_QUANT_SETTING

    if FUSE_QUANT_SETTING:
        os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")

    _compat.register_quantization_config("ternary", TernaryConfig)
    supported = set(ModelRegistry.get_supported_archs())
    for arch, target in MODELS.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, target)
    _registered = True


def linear_methods(model) -> dict[str, int]:
    """How many layers of a loaded vLLM model use each quantization method class.

    Pass it to ``LLM.apply_model``; it lives here, importable, so that vLLM's worker
    processes can unpickle it. Example: ``{"TernaryLinearMethod": 24, "UnquantizedLinearMethod": 2}``.
    Norms that hand int8 rows straight to the next layer (the BitNet models' norms with int8
    activations, ``ternop::rms_norm_quant``) are counted as ``"rms_norm_quant"``, and ternary
    layers with int8 activations as ``"int8_quantized_in_graph"`` or ``"int8_quantized_in_op"``,
    by where a compiled model quantizes their x (``linear_method.quant_in_graph``).
    """
    counts: dict[str, int] = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            name = type(method).__name__
            counts[name] = counts.get(name, 0) + 1
        if getattr(module, "quantize_in_norm", False):
            counts["rms_norm_quant"] = counts.get("rms_norm_quant", 0) + 1
        if getattr(module, "ternop_activation_bits", None) == 8:
            where = "int8_quantized_in_graph" if module.ternop_quant_in_graph else "int8_quantized_in_op"
            counts[where] = counts.get(where, 0) + 1
    return counts


__all__ = ["MODELS", "linear_methods", "register"]
