"""``convert_checkpoint``: a checkpoint that is already ternary -> a format-v1 checkpoint, exactly.

Sources (docs/CHECKPOINTS.md has the exact mapping of each):
- a Hugging Face BitNet folder (``quant_method: "bitnet"``, :mod:`ternop.quant.bitnet`);
- a GGUF file whose linear layers are ``TQ1_0`` or ``TQ2_0`` (:mod:`ternop.quant.gguf_import`).

The source is first turned into a :class:`ternop.quant.plan.Plan` from headers and metadata, so that a
layer that cannot convert (a K that is not a multiple of 128, an unknown tensor type) fails
before any byte is written; the plan is then written whole or not at all, each ternary layer
checked to dequantize to exactly the source's dequantized weight.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ternop.checkpoint import CheckpointError, check_destination, quant_config
from ternop.format import packed_bytes
from ternop.quant.plan import SHARD_BYTES, Plan, check_layer_shapes, write_plan
from ternop.selection import QuantizeReport


@dataclass
class ConvertReport(QuantizeReport):
    """What convert_checkpoint wrote: the layers made ternary, those left dense (and why), where."""

    dst: str = ""
    source: str = ""
    activation_bits: int = 16


def plan_source(src: str | os.PathLike) -> Plan:
    """The plan for ``src``: a GGUF file, or a folder holding one GGUF file or a Hugging Face BitNet checkpoint."""
    path = Path(src)
    if not path.exists():
        raise CheckpointError(f"source {str(path)!r} does not exist")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not any(path.glob("*.safetensors")) and len(ggufs) == 1:
            path = ggufs[0]
        elif not any(path.glob("*.safetensors")) and len(ggufs) > 1:
            raise CheckpointError(f"{str(src)!r} holds several GGUF files; name the one to convert")
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{str(src)!r} is a file but not a .gguf file; ternop convert reads GGUF files "
                                  "and Hugging Face BitNet folders")  # fmt: skip
        from ternop.quant.gguf_import import plan_gguf

        return plan_gguf(path)
    from ternop.quant.bitnet_import import plan_bitnet

    return plan_bitnet(path)


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, overwrite: bool = False,
                       progress: bool = True, activation_bits: int | None = None,
                       shard_bytes: int = SHARD_BYTES) -> ConvertReport:  # fmt: skip
    """Converts the ternary checkpoint ``src`` into a v1 checkpoint at ``dst``; each layer exactly.

    ``activation_bits`` (16 or 8) overrides the mode the source implies: 8 for BitNet (trained
    with int8 activations per token), 16 for GGUF. Every check (source, layer shapes and types,
    destination) runs before any byte is written.
    """
    if activation_bits is not None:
        quant_config([], activation_bits)  # CheckpointError naming an unknown value
    plan = plan_source(src)
    check_destination(src, dst, overwrite)
    if activation_bits is not None:
        plan.activation_bits = activation_bits
    check_layer_shapes(plan.layers)
    write_plan(plan, dst, overwrite=overwrite, progress=progress, shard_bytes=shard_bytes)
    report = ConvertReport(dst=str(dst), source=plan.description, activation_bits=plan.activation_bits)
    report.quantized = [layer.prefix for layer in plan.layers]
    report.skipped = dict(plan.dense_linears)
    report.dense_bytes = sum(layer.source_bytes for layer in plan.layers)
    report.ternary_bytes = sum(packed_bytes(layer.n, layer.k) for layer in plan.layers)
    return report
