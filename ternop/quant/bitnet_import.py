"""The conversion plan of a Hugging Face BitNet folder (:mod:`ternop.quant.bitnet` has the forms and their math).

Which layers become ternary:
- packed forms: every ``<prefix>.weight`` stored as uint8 with a ``<prefix>.weight_scale`` beside
  it, and every float ``<prefix>.weight`` that transformers' BitNet quantizer replaces;
- master form: every linear weight transformers' quantizer replaces (all but
  ``modules_to_not_convert``, by default ``lm_head``).
Every other tensor is copied unchanged; the dense linear layers among them (``lm_head``) are listed
in ``modules_to_not_convert``. The checkpoint runs with ``activation_bits: 8`` (BitNet quantizes
activations per token to int8).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from ternop.checkpoint import CheckpointError, load_config, tensor_index
from ternop.quant.bitnet import SCALE_SUFFIX, bitnet_source, dequantized_weight, is_converted_by_transformers
from ternop.quant.plan import Dense, Layer, Plan, copy_side_files

PROJECTION_NORM_KEY = "ternop_projection_norm_eps"
"""config.json key of a converted ``use_rms_norm`` checkpoint: the eps of the RMSNorm before each ternary layer
(read by ternop.vllm_plugin.bitnet_qwen3; docs/CHECKPOINTS.md)."""
NORMED_ARCHITECTURES = {"Qwen3Model": "BitNetQwen3Model", "Qwen3ForCausalLM": "BitNetQwen3ForCausalLM"}
"""The architecture a converted ``use_rms_norm`` checkpoint is served as (ternop's vLLM plugin registers them)."""


def _read(file: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(name)


def _layer_weight(source, index, prefix: str) -> torch.Tensor:
    info = index[prefix + ".weight"]
    scale = index.get(prefix + SCALE_SUFFIX)
    weight_scale = _read(scale.file, scale.name) if scale is not None else None
    return dequantized_weight(source, prefix + ".weight", _read(info.file, info.name), weight_scale)


def _is_linear(name: str, shape: tuple[int, ...]) -> bool:
    return name.endswith(".weight") and len(shape) == 2 and "embed" not in name.rsplit(".", 2)[-2].lower()


def plan_bitnet(src: Path) -> Plan:
    """The plan for the BitNet folder ``src``; CheckpointError if it is not one."""
    config = load_config(src)
    source = bitnet_source(config)
    if source is None:
        qc = config.get("quantization_config")
        what = f"quant_method {qc.get('quant_method')!r}" if qc else f"architectures {config.get('architectures')}"
        raise CheckpointError(
            f"{str(src)!r} is not a ternary source ternop convert reads ({what}); it reads Hugging Face BitNet "
            "folders (quant_method 'bitnet' or BitNetForCausalLM) and GGUF files with TQ1_0/TQ2_0 layers. "
            "For a floating-point model use ternop quantize"
        )
    index = tensor_index(src)
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    if source.projection_norm_eps is not None:
        config[PROJECTION_NORM_KEY] = source.projection_norm_eps
        config["architectures"] = [NORMED_ARCHITECTURES.get(a, a) for a in config.get("architectures") or []]
    plan = Plan(description=source.description, config=config, activation_bits=8,
                write_files=partial(copy_side_files, src))  # fmt: skip
    for name, info in index.items():
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] + ".weight" in index:
            continue  # read with its layer
        prefix = name[: -len(".weight")]
        if not _is_linear(name, info.shape) and info.dtype != torch.uint8:
            plan.dense.append(Dense(name, info.dtype, info.shape, partial(_read, info.file, name)))
            continue
        packed = info.dtype == torch.uint8
        if packed and source.form == "master":
            raise CheckpointError(f"{name} is packed (uint8) but the folder's config says master weights")
        if not packed and not is_converted_by_transformers(prefix, source.modules_to_not_convert):
            plan.dense.append(Dense(name, info.dtype, info.shape, partial(_read, info.file, name)))
            plan.dense_linears[prefix] = "transformers' BitNet quantizer leaves it dense"
            continue
        if len(info.shape) != 2:
            raise CheckpointError(f"{name}: a BitNet layer's weight must be 2-D, got shape {list(info.shape)}")
        n, k = (info.shape[0] * 4, info.shape[1]) if packed else info.shape
        size = info.nbytes + (index[prefix + SCALE_SUFFIX].nbytes if prefix + SCALE_SUFFIX in index else 0)
        plan.layers.append(Layer(prefix, n, k, partial(_layer_weight, source, index, prefix), size))
    orphans = [n for n in index if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] + ".weight" not in index]
    if orphans:
        raise CheckpointError(f"{orphans[0]} has no weight beside it")
    if not plan.layers:
        raise CheckpointError(f"{str(src)!r}: found no BitNet linear layer to convert")
    return plan
