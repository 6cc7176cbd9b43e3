"""A GGUF file as transformers reads it: its config, its tokenizer, and each tensor's Hugging Face name.

transformers maps a GGUF file of the architectures it supports (llama, qwen2, qwen3, ...) onto
its own model: config from the metadata, a fast tokenizer from ``tokenizer.ggml.*``, and
tensor names (``blk.0.attn_q.weight`` -> ``model.layers.0.self_attn.q_proj.weight``), with a
per-architecture processor that undoes llama.cpp's reordering (llama's Q and K rows are
permuted for its rotary layout). :func:`read_gguf_model` gives ternop's converter those
pieces, so that a converted checkpoint holds exactly what ``from_pretrained(..., gguf_file=...)``
would load, one tensor at a time instead of the whole model.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class GgufModel:
    """What transformers makes of one GGUF file."""

    architecture: str  # the file's general.architecture
    config: dict  # the transformers config, as config.json holds it
    names: dict[str, str]  # GGUF tensor name -> transformers tensor name
    shapes: dict[str, tuple[int, ...]]  # transformers tensor name -> the model's shape for it
    process: Callable[[np.ndarray, str], np.ndarray]  # (dense values, GGUF name) -> values in transformers' order
    save_tokenizer: Callable[[Path], None]


def _field(reader, key: str):
    if key not in reader.fields:
        return None
    field = reader.fields[key]
    return field.contents() if hasattr(field, "contents") else field.parts[field.data[0]][0]


def read_gguf_model(path: str | os.PathLike, reader) -> GgufModel:
    """The config, names and tensor processor transformers uses for the GGUF file ``path``.

    ``reader`` is the file's ``gguf.GGUFReader``. Raises ValueError for an architecture
    transformers does not map from GGUF.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import (
        GGUF_SUPPORTED_ARCHITECTURES,
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    path = Path(path)
    arch = str(_field(reader, "general.architecture"))
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path.name}: GGUF architecture {arch!r} is not one transformers maps from GGUF "
            f"(it maps {', '.join(sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ('general', 'tokenizer')))})"
        )
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is not None and getattr(config, "head_dim", None) not in (None, int(key_length)):
        # llama.cpp stores the head size as key_length; transformers' qwen3 mapping does not read it.
        config.head_dim = int(key_length)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed)
    names = get_gguf_hf_weights_map(model, processor)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}

    def process(values: np.ndarray, gguf_name: str) -> np.ndarray:
        result = processor.process(weights=values, name=gguf_name, tensor_key_mapping=names,
                                   parsed_parameters={"tensors": {}})  # fmt: skip
        if result.name is None:
            raise ValueError(f"{gguf_name}: transformers merges this tensor with others (MoE experts); "
                             "ternop convert reads dense architectures only")  # fmt: skip
        return result.weights

    def save_tokenizer(dst: Path) -> None:
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(dst))

    config_dict = config.to_dict()
    config_dict.pop("_name_or_path", None)
    return GgufModel(arch, config_dict, names, shapes, process, save_tokenizer)
