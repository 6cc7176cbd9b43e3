"""ternop's vLLM plugin: registers the ``ternary`` quantization method.

vLLM finds :func:`register` through the ``vllm.general_plugins`` entry point and calls it in
every process it starts (front end, engine core, workers), so it is idempotent and cheap:
it imports the config module and registers the class once.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    """Registers ``quant_method: "ternary"`` with vLLM. Safe to call any number of times."""
    global _registered
    if _registered:
        return
    from ternop.vllm_plugin import _compat
    from ternop.vllm_plugin.config import TernaryConfig

    _compat.register_quantization_config("ternary", TernaryConfig)
    _registered = True


def linear_methods(model) -> dict[str, int]:
    """How many layers of a loaded vLLM model use each quantization method class.

    Pass it to ``LLM.apply_model``; it lives here, importable, so that vLLM's worker
    processes can unpickle it. Example: ``{"TernaryLinearMethod": 24, "UnquantizedLinearMethod": 2}``.
    """
    counts: dict[str, int] = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            name = type(method).__name__
            counts[name] = counts.get(name, 0) + 1
    return counts


__all__ = ["linear_methods", "register"]
