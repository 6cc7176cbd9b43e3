"""Loading Hugging Face models, dense or ternary, through transformers' own ``from_pretrained``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from ternop.checkpoint import model_folder, read_quant_config, safetensors_files
from ternop.hf.quantizer import register, replace_linears, ternary_modules

# Weights a checkpoint may lack without harm: buffers rebuilt at init, an unused pooler, a tied head.
_MAY_BE_MISSING = ("position_ids", "pooler.", "lm_head.weight")


def is_causal_lm(path: str | os.PathLike) -> bool:
    """Whether config.json names a ``*ForCausalLM`` architecture."""
    config = json.loads((model_folder(path) / "config.json").read_text())
    return any(a.endswith("ForCausalLM") for a in config.get("architectures") or [])


def _auto(path, causal: bool | None):
    from transformers import AutoModel, AutoModelForCausalLM

    if causal is None:
        causal = is_causal_lm(path)
    return AutoModelForCausalLM if causal else AutoModel


def load_model(path: str | os.PathLike, *, causal: bool | None = None, dtype: torch.dtype = torch.float32,
               dense: bool = False) -> nn.Module:  # fmt: skip
    """The model in ``path`` in eval mode: ``AutoModelForCausalLM`` for causal LMs, else ``AutoModel``.

    A ternary checkpoint's layers are :class:`ternop.TernaryLinear` (the op); with ``dense=True``
    they are ``nn.Linear`` holding the dequantized weights instead (a reference model).
    Raises ValueError if the checkpoint lacks weights the model needs.
    """
    register()
    path = model_folder(path)
    model, info = _auto(path, causal).from_pretrained(str(path), dtype=dtype, output_loading_info=True)
    missing = [k for k in info.get("missing_keys", ()) if not any(s in k for s in _MAY_BE_MISSING)]
    if missing:
        raise ValueError(f"{path}: no weights in the checkpoint for {sorted(missing)[:5]}")
    if dense and getattr(model, "hf_quantizer", None) is not None:
        model = model.dequantize()
    return model.eval()


def build_layout(path: str | os.PathLike, *, causal: bool | None = None, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of ``path`` on the meta device, ternary layers in place, without reading any weight."""
    from transformers import AutoConfig

    register()
    path = model_folder(path)
    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = _auto(path, causal).from_config(config, dtype=dtype)
    qc = read_quant_config(path)
    if qc is not None:
        replace_linears(model, ternary_modules(model, safetensors_files(path)), dtype, qc["activation_bits"])
    return model.eval()


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(path)))
