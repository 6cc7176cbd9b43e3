"""safetensors at the byte level: the one dtype table, header reading, and a streaming writer.

The ``safetensors`` package writes a file from a dict of every tensor in it; a checkpoint
converter that must stay near one tensor of memory writes the same byte layout itself:
an 8-byte little-endian header length, a JSON header (name -> dtype, shape, data_offsets),
padding to 8 bytes, then the tensors' bytes in header order.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# The one table of safetensors dtype codes: torch dtype <-> code, and bytes per element.
DTYPES: dict[torch.dtype, tuple[str, int]] = {
    torch.float64: ("F64", 8), torch.float32: ("F32", 4), torch.float16: ("F16", 2), torch.bfloat16: ("BF16", 2),
    torch.int64: ("I64", 8), torch.int32: ("I32", 4), torch.int16: ("I16", 2), torch.int8: ("I8", 1),
    torch.uint8: ("U8", 1), torch.bool: ("BOOL", 1),
}  # fmt: skip
_BY_CODE = {code: dtype for dtype, (code, _) in DTYPES.items()}


def dtype_code(dtype: torch.dtype) -> str:
    """torch dtype -> safetensors code ("F32", "BF16", ...)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors by ternop's writer")
    return DTYPES[dtype][0]


def torch_dtype(code: str) -> torch.dtype:
    """safetensors code ("F32", "BF16", ...) -> torch dtype."""
    if code not in _BY_CODE:
        raise ValueError(f"safetensors dtype {code} is not supported by ternop")
    return _BY_CODE[code]


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors by ternop's writer")
    return DTYPES[dtype][1]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file, from its header: no data is read."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_size(self.dtype)


def read_header(path: Path) -> tuple[list[TensorInfo], dict[str, str]]:
    """The tensors of one safetensors file, in header order, and its ``__metadata__``."""
    from safetensors import safe_open

    out = []
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            sl = f.get_slice(name)
            out.append(TensorInfo(name, torch_dtype(sl.get_dtype()), tuple(sl.get_shape()), Path(path)))
        metadata = f.metadata() or {}
    return out, metadata


def write_safetensors(
    path: Path,
    plan: list[tuple[str, torch.dtype, tuple[int, ...]]],
    produce: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """Writes ``plan`` (name, dtype, shape) to ``path``; ``produce(name)`` returns each tensor in turn.

    The header is written first from the plan, so only one tensor is held at a time.
    """
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, dtype, shape in plan:
        size = element_size(dtype) * math.prod(shape)
        header[name] = {"dtype": dtype_code(dtype), "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, dtype, shape in plan:
            t = produce(name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(
                    f"{name}: expected {dtype} {list(shape)}, the transform returned {t.dtype} {list(t.shape)}"
                )
            f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
