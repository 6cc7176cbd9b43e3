"""The conversion plan of a GGUF file whose linear layers are llama.cpp's ternary types.

``TQ2_0`` and ``TQ1_0`` blocks hold 256 weights along K (ggml's ``ne0``, the input dimension)
and one float16 scale ``d``; each weight is ``d * t`` with ``t`` in {-1, 0, 1} (``TQ2_0``: 2 bits
per weight, ``t = q - 1``; ``TQ1_0``: five base-3 digits per byte). A 256-block therefore becomes two
128-blocks of format v1, both with scale ``|d|`` (codes swapped where ``d < 0``), which is exact.
The ``gguf`` package (llama.cpp's own Python reader) dequantizes each tensor; transformers
(:mod:`ternop.hf.gguf`) names it and undoes llama.cpp's row order; :func:`ternop.quant.exact.exact_pair`
stores it and checks that the pair dequantizes to exactly those values.

Which tensors become what:
- a ``TQ1_0`` / ``TQ2_0`` linear weight inside the transformer blocks -> a ternary layer;
- an ``F32`` / ``F16`` / ``BF16`` linear weight there -> dense, listed in ``modules_to_not_convert``;
- any other type for such a layer (``Q4_K``, ...) -> an error naming the tensor: it is not ternary;
- everything else (embeddings, norms, ``output.weight``) -> dense, dequantized exactly, in the
  narrowest of float16 / bfloat16 / float32 that holds every value of it.
The checkpoint runs with ``activation_bits: 16`` (llama.cpp's TQ types carry no per-token int8 rule).
"""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ternop.checkpoint import CheckpointError
from ternop.quant.exact import NotExact
from ternop.quant.plan import Dense, Layer, Plan
from ternop.selection import in_transformer_block

I2_S_TYPE = 36  # bitnet.cpp's I2_S: see docs/CHECKPOINTS.md for why it is not read


def _reader(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CheckpointError("reading GGUF files needs the gguf package: pip install gguf (or ternop[gguf])") from None

    try:
        return GGUFReader(str(path))
    except ValueError as e:
        if re.search(rf"\b{I2_S_TYPE}\b\)? is not a valid", str(e)):
            raise CheckpointError(
                f"{path.name} holds tensors of type {I2_S_TYPE} (bitnet.cpp's I2_S), which ternop convert does not "
                "read: its byte layout depends on the machine that wrote it and the file does not say which. "
                "Convert the Hugging Face BitNet checkpoint instead"
            ) from None
        raise CheckpointError(f"{path.name}: the gguf package cannot read it ({e})") from None


def _narrowest(values: torch.Tensor) -> torch.dtype:
    for dtype in (torch.float16, torch.bfloat16):
        if torch.equal(values.to(dtype).to(values.dtype), values):
            return dtype
    return torch.float32


def _dense_values(tensor, process) -> torch.Tensor:
    from gguf import dequantize

    return torch.from_numpy(np.array(process(dequantize(tensor.data, tensor.tensor_type), tensor.name)))


def plan_gguf(path: Path) -> Plan:
    """The plan for the GGUF file ``path``; CheckpointError / NotExact for what cannot convert exactly."""
    reader = _reader(path)
    from gguf import GGMLQuantizationType as T

    from ternop.hf.gguf import read_gguf_model

    try:
        model = read_gguf_model(path, reader)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{path.name}: {e}") from None
    ternary, floats = (T.TQ1_0, T.TQ2_0), (T.F32, T.F16, T.BF16)
    plan = Plan(description=f"GGUF ({model.architecture})", config=model.config, activation_bits=16,
                write_files=model.save_tokenizer)  # fmt: skip
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        hf = model.names.get(tensor.name)
        if hf is None:
            continue  # what transformers does not load either (rope frequency tables, ...)
        kind = T(tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if hf in model.shapes and model.shapes[hf] != shape:
            raise CheckpointError(
                f"{tensor.name} ({hf}) has shape {list(shape)}, but transformers' model for this file's config "
                f"expects {list(model.shapes[hf])}"
            )
        types[kind.name] = types.get(kind.name, 0) + 1
        load = partial(_dense_values, tensor, model.process)
        prefix = hf[: -len(".weight")]
        linear = hf.endswith(".weight") and len(shape) == 2 and in_transformer_block(hf) and "embed" not in hf
        if linear and kind in ternary:
            n, k = shape
            plan.layers.append(Layer(prefix, n, k, load, int(tensor.n_bytes)))
        elif linear and kind not in floats:
            raise NotExact(
                f"{tensor.name} ({hf}) is {kind.name}, not a ternary type (TQ1_0, TQ2_0): ternop convert keeps "
                "linear layers ternary or, when stored as F32/F16/BF16, dense, and never rounds"
            )
        else:
            if hf.endswith(".weight") and len(shape) == 2 and "embed" not in hf:
                plan.dense_linears[prefix] = f"stored as {kind.name}"
            if kind in floats:
                dtype = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[kind]
            else:
                dtype = _narrowest(load())
            plan.dense.append(Dense(hf, dtype, shape, load))
    if not plan.layers:
        raise CheckpointError(f"{path.name} has no TQ1_0 / TQ2_0 linear layer (types: {types})")
    plan.description += ": " + ", ".join(f"{n} {name}" for name, n in sorted(types.items()))
    return plan
