"""A streaming safetensors writer: the header is planned first, then one tensor is held at a time.

The ``safetensors`` package writes a file from a dict of every tensor in it; a checkpoint
converter that must stay near one tensor of memory writes the same byte layout itself:
an 8-byte little-endian header length, a JSON header (name -> dtype, shape, data_offsets),
padding to 8 bytes, then the tensors' bytes in header order.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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
        if dtype not in _ST_DTYPES:
            raise ValueError(f"{name}: dtype {dtype} cannot be stored in safetensors by this writer")
        size = element_size(dtype)
        for d in shape:
            size *= d
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
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


def st_dtype(code: str) -> torch.dtype:
    """safetensors dtype string ("F32", "BF16", ...) -> torch dtype."""
    inverse = {v: k for k, v in _ST_DTYPES.items()}
    if code not in inverse:
        raise ValueError(f"safetensors dtype {code} is not supported by ternop's writer")
    return inverse[code]
