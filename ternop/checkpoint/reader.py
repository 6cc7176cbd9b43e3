"""Reading format-v1 checkpoints: the folder, its ``quantization_config`` and its ternary layers.

A v1 checkpoint is a Hugging Face model folder in which each quantized linear layer's
``<prefix>.weight`` is replaced by ``<prefix>.weight_packed`` (uint8 [N, K/4]) and
``<prefix>.weight_scale`` (float16 [N, K/128]); ``config.json`` gains a
``quantization_config`` with ``quant_method: "ternary"`` (docs/FORMAT.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from ternop.checkpoint.safetensors_io import TensorInfo, read_header
from ternop.format import (
    BLOCK_SIZE,
    DEFAULT_ACTIVATION_BITS,
    FORMAT_VERSION,
    FormatError,
    check_activation_bits,
    check_shapes,
    dequantize,
)

QUANT_METHOD = "ternary"
PACKED_SUFFIX = ".weight_packed"
SCALE_SUFFIX = ".weight_scale"


class CheckpointError(ValueError):
    """A model folder cannot be read or written; the message says which file or tensor and why."""


def model_folder(path: str | os.PathLike) -> Path:
    """``path`` as a Path; CheckpointError if it is not an existing folder."""
    p = Path(path)
    if not p.is_dir():
        what = "is a file, not a folder" if p.exists() else "does not exist"
        raise CheckpointError(f"model folder {str(p)!r} {what}")
    return p


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The folder's ``*.safetensors`` files, sorted; CheckpointError if there are none."""
    src = model_folder(path)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"no *.safetensors in {str(src)!r}; ternop reads safetensors only "
            "(convert a pytorch_model.bin with transformers' save_pretrained(safe_serialization=True))"
        )
    return files


def load_config(path: str | os.PathLike) -> dict:
    """The folder's config.json as a dict ({} when it has none)."""
    file = model_folder(path) / "config.json"
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e})") from e


def read_quant_config(path: str | os.PathLike) -> dict | None:
    """The checkpoint's ``quantization_config`` with defaults filled in, or None if it has none.

    Raises CheckpointError for a missing folder, a quant_method other than "ternary" or an
    unsupported format_version / block_size / activation_bits (16 when absent).
    """
    qc = load_config(path).get("quantization_config")
    if qc is None:
        return None
    if qc.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"{path}: quantization_config.quant_method is {qc.get('quant_method')!r}, not 'ternary'")
    out = {
        "quant_method": QUANT_METHOD,
        "format_version": int(qc.get("format_version", FORMAT_VERSION)),
        "block_size": int(qc.get("block_size", BLOCK_SIZE)),
        "modules_to_not_convert": list(qc.get("modules_to_not_convert") or []),
    }
    try:
        out["activation_bits"] = check_activation_bits(qc.get("activation_bits", DEFAULT_ACTIVATION_BITS),
                                                       f"{path}: quantization_config")
    except FormatError as e:
        raise CheckpointError(str(e)) from None
    if out["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {out['format_version']} is not supported (expected 1)")
    if out["block_size"] != BLOCK_SIZE:
        raise CheckpointError(f"{path}: block_size {out['block_size']} is not supported (format v1 uses 128)")
    return out


def tensor_index(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """name -> TensorInfo (file, dtype, shape) for every tensor of the folder, from the headers only."""
    out: dict[str, TensorInfo] = {}
    for file in safetensors_files(path):
        for info in read_header(file)[0]:
            if info.name in out:
                raise CheckpointError(f"{info.name} is stored twice: in {out[info.name].file.name} and {file.name}")
            out[info.name] = info
    return out


def ternary_prefixes(path: str | os.PathLike) -> list[str]:
    """The prefixes of the checkpoint's ternary layers (those with a ``<prefix>.weight_packed``), sorted."""
    return sorted(n[: -len(PACKED_SUFFIX)] for n in tensor_index(path) if n.endswith(PACKED_SUFFIX))


def iter_tensors(path: str | os.PathLike) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the folder, one file at a time."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_ternary_layers(path: str | os.PathLike) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """prefix -> (weight_packed uint8 [N, K/4], weight_scale float16 [N, K/128]) for every ternary layer.

    Codes and scales of one layer may sit in different files. Checks shapes and dtypes
    (not the codes: see ternop.format.validate).
    """
    packed, scale = {}, {}
    for name, t in iter_tensors(path):
        if name.endswith(PACKED_SUFFIX):
            packed[name[: -len(PACKED_SUFFIX)]] = t
        elif name.endswith(SCALE_SUFFIX):
            scale[name[: -len(SCALE_SUFFIX)]] = t
    for prefix in sorted(set(packed) ^ set(scale)):
        have, miss = (PACKED_SUFFIX, SCALE_SUFFIX) if prefix in packed else (SCALE_SUFFIX, PACKED_SUFFIX)
        raise CheckpointError(f"{prefix}: the checkpoint has {prefix}{have} but no {prefix}{miss}")
    out = {}
    for prefix in sorted(packed):
        check_shapes(packed[prefix], scale[prefix], prefix)
        out[prefix] = (packed[prefix], scale[prefix])
    return out


def dequantized_state_dict(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, with each ternary pair replaced by a dense ``<prefix>.weight``.

    The dense weight is ``[N, K]`` in ``dtype`` (fp32 by default); other tensors keep their stored dtype.
    """
    layers = load_ternary_layers(path)
    out = {}
    for name, t in iter_tensors(path):
        if not (name.endswith(PACKED_SUFFIX) or name.endswith(SCALE_SUFFIX)):
            out[name] = t
    for prefix, (packed, scale) in layers.items():
        out[prefix + ".weight"] = dequantize(packed, scale, dtype)
    return out
